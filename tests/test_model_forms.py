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

import math

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from families import train_steps
from helpers import assert_ranks_match, parallelize_on, reference_run, seeded, spawn_ranks, token_batches

pytestmark = pytest.mark.multiprocess
V, H, NH, S, L = 128, 64, 4, 16, 4
D = H // NH


def precompute_freqs_cis(dim, end, theta=10000.0):
    freqs = 1.0 / (theta ** (torch.arange(0, dim, 2)[: (dim // 2)].float() / dim))
    t = torch.arange(end)
    freqs = torch.outer(t, freqs).float()
    return torch.polar(torch.ones_like(freqs), freqs)


def apply_rotary_emb(xq, xk, freqs_cis):
    xq_ = torch.view_as_complex(xq.float().reshape(*xq.shape[:-1], -1, 2))
    xk_ = torch.view_as_complex(xk.float().reshape(*xk.shape[:-1], -1, 2))
    fc = freqs_cis.view(1, xq_.shape[1], 1, xq_.shape[-1])
    xq_out = torch.view_as_real(xq_ * fc).flatten(3)
    xk_out = torch.view_as_real(xk_ * fc).flatten(3)
    return xq_out.type_as(xq), xk_out.type_as(xk)


class RMSNorm(nn.Module):
    def __init__(s, d, eps=1e-6):
        super().__init__()
        s.eps = eps
        s.weight = nn.Parameter(torch.ones(d))

    def forward(s, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + s.eps) * s.weight


class MetaAttn(nn.Module):  # Meta's llama: complex rope, manual softmax attention, einsum variant
    def __init__(s, einsum=False):
        super().__init__()
        s.einsum = einsum
        s.wq, s.wk, s.wv, s.wo = (nn.Linear(H, H, bias=False) for _ in range(4))

    def forward(s, x, freqs_cis):
        b, t, _ = x.shape
        q, k, v = s.wq(x).view(b, t, NH, D), s.wk(x).view(b, t, NH, D), s.wv(x).view(b, t, NH, D)
        q, k = apply_rotary_emb(q, k, freqs_cis)
        if s.einsum:
            scores = torch.einsum("bqhd,bkhd->bhqk", q, k) / math.sqrt(D)
            mask = torch.full((t, t), float("-inf")).triu(1)
            p = F.softmax(scores + mask, dim=-1)
            o = torch.einsum("bhqk,bkhd->bqhd", p, v).reshape(b, t, H)
        else:
            q, k, v = (z.transpose(1, 2) for z in (q, k, v))
            scores = q @ k.transpose(2, 3) / math.sqrt(D)
            scores = scores + torch.full((t, t), float("-inf")).triu(1)
            o = (F.softmax(scores.float(), dim=-1).type_as(q) @ v).transpose(1, 2).contiguous().view(b, t, H)
        return s.wo(o)


class FF(nn.Module):
    def __init__(s):
        super().__init__()
        s.w1, s.w2, s.w3 = nn.Linear(H, 96, bias=False), nn.Linear(96, H, bias=False), nn.Linear(H, 96, bias=False)

    def forward(s, x):
        return s.w2(F.silu(s.w1(x)) * s.w3(x))


class TB(nn.Module):
    def __init__(s, einsum):
        super().__init__()
        s.attention = MetaAttn(einsum)
        s.feed_forward = FF()
        s.attention_norm = RMSNorm(H)
        s.ffn_norm = RMSNorm(H)

    def forward(s, x, fc):
        h = x + s.attention(s.attention_norm(x), fc)
        return h + s.feed_forward(s.ffn_norm(h))


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


def _split_and_train_every_variant():
    out = {}
    for name in VARIANTS:
        d = variant_batches()
        # f and g of tensor parallelism alone are counted per layer
        program = parallelize_on(make(name), d, 4, tp=2, pp=2, microbatches=2, sequence_parallel=False)
        per_layer = {k: v for k, v in program.collectives(by_layer=True).items() if k[0] is not None}
        out[name] = (
            train_steps(program.materialize(), d, 1e-3),
            program.fallbacks(),
            program.plan.rejected,
            program.replicated_weights(),
            per_layer,
        )
    return out


@pytest.fixture(scope="module")
def variant_runs():
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
