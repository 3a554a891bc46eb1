"""Models written the ways people write them, on 4 gloo ranks (tp=2 x pp=2).

- A Llama as Meta's reference code writes it: rotary embeddings through complex
  numbers (``view_as_complex`` / ``view_as_real`` on the split heads), attention
  written out (``q @ k^T``, a mask, softmax) or with ``torch.einsum``, SwiGLU,
  RMSNorm by hand, the blocks in a ModuleList or a ModuleDict.
- One block applied L times (weights shared across layers, as ALBERT): the
  layers are its calls, its weights are split everywhere at once, and the
  pipeline stages that share them sum their gradients.
- A language model from ``nn.TransformerEncoder`` (post- and pre-norm), whose
  ``nn.MultiheadAttention`` packs q, k and v in one projection, unflattens it
  into (3, E) and folds the heads into the batch dim (``b*heads``).

Each is split fully (2 f and 2 g per layer, no fallback, nothing left whole)
and matches one process over two AdamW steps (tolerances as in test_tp_parity).
"""

import pytest
import torch
import torch.nn as nn
from families import TB, RMSNorm, precompute_freqs_cis, train_steps
from helpers import assert_ranks_match, parallelize_on, reference_run, seeded, spawn_ranks, token_batches

pytestmark = pytest.mark.multiprocess
V, H, NH, S, L = 128, 64, 4, 16, 4
D = H // NH


class MetaLlama(nn.Module):
    def __init__(s, einsum=False, container="list"):
        super().__init__()
        s.tok_embeddings = nn.Embedding(V, H)
        blocks = [TB(einsum) for _ in range(L)]
        s.layers = (
            nn.ModuleList(blocks) if container == "list" else nn.ModuleDict({str(i): b for i, b in enumerate(blocks)})
        )
        s.norm = RMSNorm(H)
        s.output = nn.Linear(H, V, bias=False)
        s.register_buffer("freqs_cis", precompute_freqs_cis(D, S * 2), persistent=False)

    def forward(s, tokens):
        h = s.tok_embeddings(tokens)
        fc = s.freqs_cis[: tokens.shape[1]]
        for layer in s.layers if isinstance(s.layers, nn.ModuleList) else s.layers.values():
            h = layer(h, fc)
        return s.output(s.norm(h)).float()


class TorchEncoderLM(nn.Module):
    def __init__(self, norm_first):
        super().__init__()
        self.emb = nn.Embedding(V, H)
        self.pos = nn.Parameter(torch.zeros(1, S, H))
        layer = nn.TransformerEncoderLayer(H, NH, 4 * H, dropout=0.0, batch_first=True, norm_first=norm_first)
        self.enc = nn.TransformerEncoder(layer, L, enable_nested_tensor=False)
        self.head = nn.Linear(H, V)
        self.register_buffer("mask", nn.Transformer.generate_square_subsequent_mask(S), persistent=False)

    def forward(self, x):
        return self.head(self.enc(self.emb(x) + self.pos, mask=self.mask, is_causal=True))


class SharedLlama(MetaLlama):
    """One block applied L times (weights shared across layers): by a loop over the same module,
    or a ModuleList holding it L times."""

    def __init__(self, loop):
        super().__init__()
        self.loop = loop
        self.block = self.layers[0]
        self.layers = nn.ModuleList([self.block] * L)

    def forward(self, tokens):
        h = self.tok_embeddings(tokens)
        fc = self.freqs_cis[: tokens.shape[1]]
        for layer in ([self.block] * L if self.loop else self.layers):
            h = layer(h, fc)
        return self.output(self.norm(h)).float()


VARIANTS = {"complex_rope": lambda: MetaLlama(), "einsum": lambda: MetaLlama(einsum=True),
            "shared_block_loop": lambda: SharedLlama(loop=True), "shared_block_list": lambda: SharedLlama(loop=False),
            "module_dict": lambda: MetaLlama(container="dict"),
            "torch_encoder_post_norm": lambda: TorchEncoderLM(False),
            "torch_encoder_pre_norm": lambda: TorchEncoderLM(True)}


def make(name):
    return seeded(VARIANTS[name])


def variant_batches():
    return token_batches(V, steps=2, rows=8, seed=1, seq=S)


def _variant_program(name):
    # f and g of tensor parallelism alone are counted per layer
    return parallelize_on(make(name), variant_batches(), 4, tp=2, pp=2, microbatches=2, sequence_parallel=False)


def _split_and_train_every_variant():
    out = {}
    for name in VARIANTS:
        program = _variant_program(name)  # compiled in the test process before the spawn: inherited
        per_layer = {k: v for k, v in program.collectives(by_layer=True).items() if k[0] is not None}
        out[name] = (
            train_steps(program.materialize(), variant_batches(), 1e-3),
            program.fallbacks(),
            program.plan.rejected,
            program.replicated_weights(),
            per_layer,
        )
    return out


@pytest.fixture(scope="module")
def variant_runs():
    for name in VARIANTS:  # compile once here, not once per rank
        _variant_program(name)
    return spawn_ranks(_split_and_train_every_variant, 4, timeout_s=600)


@pytest.mark.parametrize("name", list(VARIANTS))
def test_split_fully(variant_runs, name):
    _, fallbacks, rejected, whole, per_layer = variant_runs[0][name]
    assert fallbacks == [] and rejected == [] and whole == []
    assert per_layer == {(i, kind): 2 for i in range(L) for kind in ("copy_to_tp", "reduce_from_tp")}


@pytest.mark.parametrize("name", list(VARIANTS))
def test_matches_one_process(variant_runs, name):
    assert_ranks_match(reference_run(make(name), variant_batches(), lr=1e-3), [res[name][0] for res in variant_runs],
                       label=name)
