"""Compiled chunks (``compile=``) on 2 gloo ranks: one device's loss and gradients, one graph per chunk.

Every chunk's forward and backward is compiled by ``torch.compile`` with the
``aot_eager`` backend: AOTAutograd's joint graph, partitioned into forward and
backward as Inductor gets it, run by eager kernels. That is the whole path a
compiled chunk takes except Inductor's code generation, which costs 25-30 s per
chunk on these CPUs (``bench/compiled.py`` measures Inductor). The runs:

- the reference GPT at tp=2 with sequence parallelism and recompute='layer'
  (the checkpointed layers and the sequence-parallel collectives inside the
  compiled graph), then an evaluation step;
- HF Llama (4 layers) at pp=2 interleaved (v=2), HF GPT-2 at pp=2 1F1B;
- GPT-2 with fused QKV at dp=2 with the distributed optimizer;
- the zero-bubble schedules, their backward graphs split into B and W
  (``runtime/engine/compiled_split.py``): Llama at pp=2 ZB-V, and the reference
  GPT at pp=2 ZB-H1 with recompute='layer';
- HF GPT-2 at tp=2 in bf16, against the same program run eagerly.

The fp32 runs match one device as the eager engine does (``families.assert_steps_match``:
the first step element-wise within rtol 1e-5 / atol 1e-6, later steps per tensor;
aot_eager reorders nothing, so the tolerances are the parallel run's own). The bf16
run equals the eager engine's bit for bit. Each chunk compiles to one graph, with
no break, in training and evaluation; with tp, the two ranks capture the same
graph (the rank an input of it, not a constant), so one compile serves both.
"""

import pytest
import torch
from families import assert_steps_match, batches, make
from helpers import assert_bitwise_equal, parallelize_on, reference_run, spawn_ranks

pytestmark = pytest.mark.multiprocess

LR, STEPS, ROWS = 1e-3, 2, 4
RUNS = {
    "nanogpt tp2 sp recompute": ("nanogpt", 2, dict(tp=2, sequence_parallel=True, recompute="layer")),
    "hf-llama pp2 interleaved": ("hf-llama", 4, dict(pp=2, virtual_stages=2, microbatches=2)),
    "hf-gpt2 pp2 1f1b": ("hf-gpt2", 2, dict(pp=2, schedule="1f1b", microbatches=2)),
    "gpt2-fused dp2 distributed optimizer": ("gpt2-fused", 2, dict(dp=2)),
    "llama pp2 zbv": ("llama", 4, dict(pp=2, virtual_stages=2, schedule="zbv", microbatches=4)),
    "nanogpt pp2 zb-h1 recompute": ("nanogpt", 2, dict(pp=2, schedule="zb-h1", microbatches=4, recompute="layer")),
}
BF16 = ("hf-gpt2", 2, dict(tp=2, precision="bf16"))


def _rows(layout: dict) -> int:
    return ROWS // (layout.get("dp", 1) * layout.get("microbatches", 1))


def _compiled_program(family: str, layers: int, layout: dict, compile="aot_eager"):
    model, vocab = make(family, layers=layers)
    data = batches(vocab, steps=STEPS, rows=ROWS)
    return parallelize_on(model, data, _rows(layout), compile=compile, **layout), data


def _train(program, data, distributed: bool = False):
    engine = program.materialize()
    if distributed:
        opt = engine.distributed_optimizer(torch.optim.AdamW, lr=LR)
    else:
        opt = torch.optim.AdamW(engine.parameters(), lr=LR)
    losses, grads = [], []
    for inputs, targets in data:
        losses.append(engine.train_step(*inputs, *targets))
        grads.append(engine.full_grads())
        opt.step()
        opt.zero_grad()
    return engine, losses, grads


def _graphs(engine) -> dict:
    same = {key: run.same_as_first for key, run in _compiled_runs(engine)}
    return {key: (r.graphs, tuple(r.breaks), same[key]) for key, r in engine.compiled().items()}


def _compiled_runs(engine):
    for mode, runnables in (("train", engine.compute.runnables), ("eval", engine.compute.eval_runnables)):
        for chunk, run in runnables.items():
            yield (mode, chunk), run


def _run_all():
    out = {}
    for label, (family, layers, layout) in RUNS.items():
        program, data = _compiled_program(family, layers, layout)
        engine, losses, grads = _train(program, data, distributed="dp" in layout)
        if label.startswith("nanogpt tp2"):
            (x,), (y,) = data[0]
            engine.eval_step(x, y)
        out[label] = (losses, grads, _graphs(engine))
    runs = [_train(_compiled_program(*BF16, compile=c)[0], _compiled_program(*BF16)[1]) for c in ("aot_eager", None)]
    out["bf16"] = [(losses, grads) for _, losses, grads in runs]
    return out


@pytest.fixture(scope="module")
def compiled_runs():
    for family, layers, layout in [*RUNS.values(), BF16]:  # compiled here once, inherited by both ranks
        _compiled_program(family, layers, layout)
    _compiled_program(*BF16, compile=None)
    return spawn_ranks(_run_all, 2, timeout_s=900)


@pytest.mark.parametrize("label", list(RUNS))
def test_compiled_chunks_match_one_device(compiled_runs, label):
    family, layers, layout = RUNS[label]
    model, vocab = make(family, layers=layers)
    ref_losses, ref_grads = reference_run(model, batches(vocab, steps=STEPS, rows=ROWS), lr=LR)
    for rank, run in enumerate(compiled_runs):
        losses, grads, graphs = run[label]
        assert_steps_match(ref_losses, ref_grads, losses, grads, label=f"{label} rank {rank}")
        modes = {"train", "eval"} if label.startswith("nanogpt tp2") else {"train"}
        assert {mode for mode, _ in graphs} == modes, graphs
        # with tp, rank 1 captured the graph rank 0 did (the vocabulary offset an input, not a constant)
        same = True if RUNS[label][2].get("tp", 1) > 1 and rank > 0 else None
        assert set(graphs.values()) == {(1, (), same)}, f"{label} rank {rank}: not one graph per chunk: {graphs}"


def test_bf16_compiled_equals_eager_bitwise(compiled_runs):
    for rank, run in enumerate(compiled_runs):
        (c_losses, c_grads), (e_losses, e_grads) = run["bf16"]
        assert c_losses == e_losses, (rank, c_losses, e_losses)
        for step, (got, want) in enumerate(zip(c_grads, e_grads)):
            assert_bitwise_equal(got, want, f"bf16 rank {rank} step {step}")


def test_an_unknown_backend_is_refused_before_any_work():
    import autopar
    from autopar.core.errors import ConfigError

    model, vocab = make("nanogpt")
    (x,), (y,) = batches(vocab, steps=1, rows=2)[0]
    with pytest.raises(ConfigError, match=r"compile must be True \(Inductor\), False / None \(eager\) or one of"):
        autopar.parallelize(model, example_inputs=(x,), example_targets=(y,), compile="tensorrt")


def test_a_backward_graph_splits_into_input_and_weight_gradients():
    """B computes the input's gradient and what W needs of it; W reads only that and the saved
    tensors it uses, and computes the weights' gradients: together, autograd's."""
    from autopar.runtime.engine.compiled_split import collecting_weight_grads, split_backend

    def chunk(x, w1, w2):
        return ((x @ w1).relu() @ w2).tanh()

    torch.manual_seed(0)
    x, w1, w2 = torch.randn(5, 8, requires_grad=True), torch.randn(8, 16), torch.randn(16, 4)
    w1.requires_grad_(), w2.requires_grad_()
    grad_out = torch.randn(5, 4)
    want = torch.autograd.grad(chunk(x, w1, w2), (x, w1, w2), grad_out)
    run = torch.compile(chunk, backend=split_backend("aot_eager", frozenset({"w1", "w2"})))
    out = run(x, w1, w2)
    with collecting_weight_grads() as w:
        out.backward(grad_out)
    assert w1.grad is None and w2.grad is None and w.held_bytes() > 0  # B left the weights to W
    torch.testing.assert_close(x.grad, want[0], rtol=0, atol=0)
    got = w.run()
    assert set(got) == {"w1", "w2"} and w.held_bytes() == 0
    torch.testing.assert_close(got["w1"], want[1], rtol=0, atol=0)
    torch.testing.assert_close(got["w2"], want[2], rtol=0, atol=0)
    x.grad = None
    run(x, w1, w2).backward(grad_out)  # no collector open: W runs inside the backward, as unsplit
    torch.testing.assert_close(w2.grad, want[2], rtol=0, atol=0)


def test_tp_ranks_take_turns_compiling():
    """The first rank publishes the end of each compile (forward, then the lazy backward) on the store
    before its run, whose collectives need the others; a follower waits for it, and one whose leader
    never compiles goes on after its timeout."""
    from torch.distributed import HashStore

    from autopar.runtime.engine.compiled_chunks import CompiledChunk, CompileTurns

    class Chunk(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.w = torch.nn.Parameter(torch.randn(8, 8))

        def forward(self, x):
            return (x @ self.w).tanh()

    class Recorded:
        def __init__(self):
            self.store, self.seen = HashStore(), []

        def set(self, key, value):
            self.seen.append(key)
            self.store.set(key, value)

        def wait(self, keys, timeout):
            self.store.wait(keys, timeout)

        def get(self, key):
            return self.store.get(key)

        def check(self, keys):
            return self.store.check(keys)

    store = Recorded()
    leader = CompiledChunk(Chunk(), "aot_eager", turns=CompileTurns(store, "job/0/0", True, 5.0), name="train/1")
    x = torch.randn(4, 8, requires_grad=True)
    out = leader(x)
    graph, fw, bw = (f"job/0/0/train/1/{part}" for part in ("graph", "forward", "backward"))
    # the graph's fingerprint before compiling; the compile's end (Dynamo's callback, before the run);
    # again after the call
    assert store.seen == [graph, fw, fw]
    with leader.capturing():
        out.sum().backward()
    assert store.seen == [graph, fw, fw, bw, bw]  # the lazy backward's compile end, then after the backward
    follower = CompiledChunk(Chunk(), "aot_eager", turns=CompileTurns(store, "job/0/0", False, 5.0), name="train/1")
    with follower.capturing():  # (not the first call: nothing to capture)
        pass
    follower(x).sum().backward()
    assert follower.same_as_first and follower.report.waited_s < 1.0  # the leader's compile had ended

    class Other(Chunk):
        def forward(self, x):
            return (x @ self.w).relu()

    other = CompiledChunk(Other(), "aot_eager", turns=CompileTurns(store, "job/0/0", False, 5.0), name="train/1")
    other(x)
    assert other.same_as_first is False  # another graph: compiled at once, no wait for the leader's
    alone = CompiledChunk(Chunk(), "aot_eager", turns=CompileTurns(HashStore(), "job/0/1", False, 0.2),
                          name="train/1")
    alone(x)
    assert 0.2 <= alone.report.waited_s < 2.0  # no leader: it compiled on its own after the timeout
    assert "waited" in alone.report.describe()
