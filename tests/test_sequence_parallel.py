"""Sequence parallelism: parity with one device, its collectives and bytes, the activations it saves.

Parity (one spawn of 4 gloo ranks, every case in it): sequence parallelism at
tp=4 and tp=2, with pp=2 interleaved (v=2), with recompute='layer', with
dp=2, on the reference models, three HuggingFace families (GPT-2: tied head;
Llama: grouped-query attention; GPT-J: parallel blocks) and an
``nn.TransformerEncoder`` language model; loss and every gradient against the
single-device run, tolerances as in test_tp_parity (``families.assert_steps_match``:
fp32 first step element-wise rtol 1e-5 / atol 1e-6, the parallel run only
reorders sums; after AdamW per tensor).

Structure (compile only, no process group): each all-reduce after a
row-parallel linear becomes one reduce-scatter and the next f one all-gather,
the same bytes on the wire; a pipeline boundary inside the split region sends
1/t of the replicated one. Kept activations: the engine's saved-tensor count
falls by what the graph predicts (the split ops save 1/t).
"""

import pytest
import torch
import torch.nn as nn
from families import SEQ, hf_gptj, make, train_steps
from helpers import assert_ranks_match, parallelize_on, reference_run, seeded, spawn_ranks, token_batches

import autopar
from autopar.core.collectives import collective_named, wire_factor
from autopar.core.comm import TPGroup
from autopar.reference.models import build

LR, ROWS = 1e-3, 4


class EncoderLM(nn.Module):
    """A language model around ``nn.TransformerEncoder`` (batch_first, post-norm, causal mask)."""

    def __init__(self, vocab: int = 320, width: int = 64, layers: int = 2):
        super().__init__()
        self.emb = nn.Embedding(vocab, width)
        self.pos = nn.Parameter(torch.randn(1, SEQ, width) * 0.02)
        layer = nn.TransformerEncoderLayer(width, 4, 2 * width, dropout=0.0, batch_first=True)
        self.enc = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.head = nn.Linear(width, vocab)
        self.register_buffer("mask", nn.Transformer.generate_square_subsequent_mask(SEQ), persistent=False)

    def forward(self, x):
        return self.head(self.enc(self.emb(x) + self.pos, mask=self.mask, is_causal=True))


def _model(name: str):
    if name == "encoder":
        return seeded(EncoderLM), 320
    if name == "hf-gptj":
        return seeded(hf_gptj), 320
    if name == "llama-4":
        return seeded(build, "llama", vocab_size=320, seq_len=SEQ, n_layer=4, n_head=8, n_kv_head=4, d_model=64,
                      d_ff=96), 320
    return make(name)


# (model, tp, pp, virtual stages, recompute) on 4 ranks: dp = 4 / (tp * pp)
CASES = [("nanogpt", 4, 1, 1, "none"), ("llama-4", 2, 2, 2, "layer"), ("hf-gpt2", 2, 2, 1, "none"),
         ("hf-llama", 2, 1, 1, "none"), ("hf-gptj", 2, 1, 1, "layer"), ("encoder", 2, 1, 1, "none")]


def _data(vocab):
    return token_batches(vocab, steps=2, rows=ROWS, seed=5)


def _run(case):
    name, tp, pp, v, recompute = case
    model, vocab = _model(name)
    data = _data(vocab)
    dp, m = 4 // (tp * pp), 2
    program = parallelize_on(model, data, ROWS // (dp * m), tp=tp, pp=pp, virtual_stages=v, microbatches=m,
                             recompute=recompute, sequence_parallel=True)
    losses, grads = train_steps(program.materialize(), data, LR)
    return losses, grads, len(program.sequence.seeds)


def _kept_bytes():
    """Bytes autograd keeps for one microbatch (the engine's count), without and with sequence parallelism."""
    model, vocab = _model("nanogpt")
    data = _data(vocab)
    out = {}
    for sp in (False, True):
        engine = parallelize_on(model, data, ROWS // 2, tp=2, dp=2, sequence_parallel=sp).materialize()
        engine.train_step(*data[0][0], *data[0][1])
        out[sp] = engine.stats["peak_activation_bytes"]
    return out


def _worker():
    return {case: _run(case) for case in CASES}, _kept_bytes()


@pytest.fixture(scope="module")
def ranks():
    return spawn_ranks(_worker, 4)


@pytest.mark.multiprocess
def test_sequence_parallel_matches_one_device(ranks):
    for case in CASES:
        model, vocab = _model(case[0])
        ref = reference_run(model, _data(vocab), lr=LR)
        assert_ranks_match(ref, [r[0][case][:2] for r in ranks], label=f"sequence parallel {case}")
        assert all(r[0][case][2] > 0 for r in ranks), f"{case}: nothing ran split on the tokens"


@pytest.mark.multiprocess
def test_kept_activations_fall_as_the_graph_predicts(ranks):
    model, vocab = _model("nanogpt")
    data = _data(vocab)
    whole = parallelize_on(model, data, ROWS // 2, tp=2, dp=2, sequence_parallel=False)
    split = parallelize_on(model, data, ROWS // 2, tp=2, dp=2, sequence_parallel=True)
    saved = _saved_by_node(whole)
    # the ops split on the tokens save 1/t of what they saved whole; every other op the same
    predicted = sum(b // 2 if n in split.sequence.split else b for n, b in saved.items())
    region_bytes = sum(b for n, b in saved.items() if n in split.sequence.split)
    assert region_bytes > 0
    for kept in (r[1] for r in ranks):
        assert kept[False] == sum(saved.values())
        assert kept[True] == predicted == kept[False] - region_bytes // 2


def _saved_by_node(program) -> dict[str, int]:
    """Bytes autograd saves for the backward during each node of the (one-chunk) program, weights
    excluded as the engine excludes them: one run on random tensors of one rank's shapes with an
    inspection group (collectives give shapes only)."""
    chunk = program.split.chunks[0]
    params = {p: torch.randn(program.local_shape(program.traced.param_of[p]), requires_grad=True) for p in chunk.params}
    ptrs = {t.data_ptr() for t in params.values()}
    args = [TPGroup(0, program.tp, None)]
    for node in list(chunk.gm.graph.nodes)[1:]:
        if node.op != "placeholder":
            break
        val = node.meta["local_val"]
        args.append(params[node.name] if node.name in params else torch.zeros(val.shape, dtype=val.dtype))
    saved: dict[str, int] = {}
    run = torch.fx.Interpreter(chunk.gm)
    current = [None]

    def run_node(n, _run=run.run_node):
        current[0] = n.name
        return _run(n)

    def pack(t):
        if t.data_ptr() not in ptrs:
            saved[current[0]] = saved.get(current[0], 0) + t.numel() * t.element_size()
        return t

    run.run_node = run_node
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        run.run(*args)
    return saved


def _program(tp, pp=1, sp=True, layers=2, **kw):
    model, vocab = make("nanogpt", layers=layers)
    data = _data(vocab)
    return parallelize_on(model, data, 2, tp=tp, pp=pp, microbatches=pp, dp=1, sequence_parallel=sp, **kw)


def _wire_bytes(program, names) -> float:
    """Bytes one rank sends per microbatch in the named collectives (ring wire factors)."""
    total = 0.0
    for node in program.rank_module.graph.nodes:
        if node.op == "call_function" and getattr(node.target, "__name__", "") in names:
            spec = collective_named(node.target.__name__)
            total += spec.nbytes(node) / len(spec.kinds) * sum(wire_factor(k, program.tp) for k in spec.kinds)
    return total


@pytest.mark.parametrize("tp", [2, 4])
def test_each_all_reduce_becomes_a_reduce_scatter_and_an_all_gather_of_the_same_bytes(tp):
    whole, split = _program(tp, sp=False), _program(tp)
    before, after = whole.collectives(by_layer=True), split.collectives(by_layer=True)
    for layer in range(2):
        assert before[(layer, "reduce_from_tp")] == 2 and after[(layer, "reduce_from_tp")] == 0
        assert after[(layer, "reduce_scatter_to_sp")] == 2
        # the f before each column-parallel region becomes the all-gather (layer 0's attention
        # reads the embedding, which is whole: its f stays)
        assert after[(layer, "gather_from_sp")] + after[(layer, "copy_to_tp")] == before[(layer, "copy_to_tp")] == 2
    assert split.collectives()["gather_from_sp"] == split.collectives()["reduce_scatter_to_sp"] == 4
    # a ring all-reduce is a reduce-scatter plus an all-gather: g and f moved 2 all-reduces of the
    # layer's activation; now 2 reduce-scatters and 2 all-gathers of it, the same bytes
    assert _wire_bytes(split, {"reduce_scatter_to_sp", "gather_from_sp"}) == pytest.approx(
        _wire_bytes(whole, {"reduce_from_tp"}) + _wire_bytes(whole, {"copy_to_tp"})
        - _wire_bytes(split, {"copy_to_tp"}))
    assert "reduce_scatter_to_sp" in split.code(0) and "gather_from_sp" in split.code(0)


def test_a_boundary_inside_the_split_region_sends_one_tp_th():
    whole, split = _program(2, pp=2, sp=False), _program(2, pp=2)
    (b_whole,), (b_split,) = whole.split.chunks[1].inputs, split.split.chunks[1].inputs
    assert b_whole.replicated and not b_split.replicated and whole.sent_sliced(b_whole)
    assert b_split.nbytes * 2 == b_whole.nbytes
    assert split.p2p_and_dp_bytes() == whole.p2p_and_dp_bytes()  # 1/t either way: sliced, or split already
    assert not any(k[0] == "boundary" for k in split.tp_communication(1))  # no all-gather on arrival


def test_summary_lists_what_runs_split_and_the_gathers():
    text = _program(2).summary()
    assert "Sequence parallelism" in text and "layer_norm" in text and "reduce_scatter_to_sp" in text
    model, vocab = make("hf-gpt2")
    data = _data(vocab)
    tp4 = parallelize_on(model, data, 2, tp=4, dp=1, sequence_parallel=True)
    assert len(tp4.sequence.gathers) == 4 and all("transformer.h." in g.module for g in tp4.sequence.gathers)
    assert "view splits the sharded dim unevenly" in " ".join(tp4.summary().split())


def test_bad_input_is_refused_before_any_work():
    with pytest.raises(ValueError, match=r"sequence_parallel=True .* tp=1 .* Fix: tp >= 2"):
        _program(1)
    model, vocab = make("nanogpt")
    x = torch.randint(0, vocab, (1, 15))
    with pytest.raises(autopar.api.SequenceParallelError, match=r"token dim 1 of size 15 .* Fix: .*multiple of 2"):
        autopar.parallelize(model, tp=2, example_inputs=(x,), example_targets=(x,), sequence_parallel=True)
    auto = autopar.parallelize(model, tp=2, example_inputs=(x,), example_targets=(x,), sequence_parallel=None)
    assert auto.sequence is None and "Sequence parallelism: off (tp=2 does not divide" in auto.summary()
    y = torch.randint(0, vocab, (1, 16))
    assert autopar.parallelize(model, tp=2, example_inputs=(y,), example_targets=(y,),
                               sequence_parallel=None).sequence is not None
