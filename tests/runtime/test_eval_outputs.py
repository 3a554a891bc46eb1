"""The logits of an evaluation step: ``engine.eval_step(x, y, outputs=True) -> (loss, logits)``.

On 4 gloo ranks (one spawn, every layout of 4 ranks in it): the reference GPT
with a tied head at tp=2 x pp=2 (the head's weight on the last stage, the
embedding's on the first) with sequence parallelism, with an untied head at
tp=2 x dp=2, and HuggingFace GPT-2 (a prime vocabulary of 257, padded to 258
for the vocabulary-parallel head) at tp=2 x dp=2; and a block whose output
(its last norm's, read by a mean-squared error) sequence parallelism leaves
split along the tokens, at tp=2 x dp=2. The logits every asking rank
gets equal the single-device model's in ``eval()`` mode for the same batch;
the loss still equals its evaluation loss, and the argmax accuracy computed
from the logits equals the one computed on one device. Asking on one rank, on
the last stage, and with a replica's own batch return what they say and None
elsewhere. Without a process group: the training graphs are the same with the
logits marked as without, and what cannot be returned fails before any work.
"""

from __future__ import annotations

import functools

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from families import make
from helpers import parallelize_on, seeded, spawn_ranks, token_batches

import autopar
import autopar.compiler.trace as trace_module
import autopar.compiler.trace_reuse as trace_reuse
from autopar.compiler.trace import default_logits
from autopar.reference.models import build
from autopar.runtime.engine.eval_outputs import LogitsOutput

VOCAB, SEQ, M, MB = 320, 16, 2, 2
# fp32 on both sides; the parallel logits differ from one device's only by reordered sums
# (tensor-parallel all-reduces in the blocks, sequence parallelism's reduce-scatters): measured at
# most 2.4e-7 in absolute value for the language models (logits up to 1.1 in size) and 4.8e-7 for
# the regressor (outputs up to 3.5), so atol 1e-5 (rtol 1e-5) has a margin of 20 and still fails
# on any wrong row, column or shard (differences of order 0.1). The losses (about 6, about 2):
# within 1e-5 relative.
LOGITS_TOLERANCE = dict(rtol=1e-5, atol=1e-5)
LOSS_TOLERANCE = dict(rtol=1e-5, atol=1e-6)


def _dropout_gpt(tied: bool):
    return seeded(build, "gpt", vocab_size=VOCAB, seq_len=SEQ, n_layer=2, n_head=4, d_model=64, dropout=0.5,
                  tie_embeddings=tied)


def _hf_gpt2():
    return make("hf-gpt2", seed=0)[0]


class _Regressor(nn.Module):
    """A block whose output is its last norm's, read by a mean-squared error: under sequence
    parallelism the output runs on 1/t of the tokens (``Shard(1)``), gathered only for the loss."""

    def __init__(self, width: int = 32):
        super().__init__()
        self.ln, self.fc, self.proj = nn.LayerNorm(width), nn.Linear(width, 4 * width), nn.Linear(4 * width, width)
        self.ln_f = nn.LayerNorm(width)

    def forward(self, x):
        return self.ln_f(x + self.proj(F.gelu(self.fc(self.ln(x)))))


# name -> (model factory, vocabulary (None: the regressor, its loss F.mse_loss), layout)
LAYOUTS = {
    "gpt-tied tp2pp2 sp": (functools.partial(_dropout_gpt, True), VOCAB,
                           dict(tp=2, pp=2, dp=1, sequence_parallel=True)),
    "gpt-untied tp2dp2": (functools.partial(_dropout_gpt, False), VOCAB, dict(tp=2, pp=1, dp=2)),
    "hf-gpt2 tp2dp2": (_hf_gpt2, 257, dict(tp=2, pp=1, dp=2)),
    "tokens split tp2dp2 sp": (functools.partial(seeded, _Regressor), None, dict(tp=2, pp=1, dp=2,
                                                                                 sequence_parallel=True)),
}


def _eval_batch(vocab: int | None, dp: int) -> tuple[torch.Tensor, torch.Tensor]:
    if vocab is None:
        g = torch.Generator().manual_seed(5)
        return torch.randn(dp * M * MB, SEQ, 32, generator=g), torch.randn(dp * M * MB, SEQ, 32, generator=g)
    (x,), (y,) = token_batches(vocab, steps=1, rows=dp * M * MB, seed=5, seq=SEQ)[0]
    return x, y


def _loss_fn(vocab: int | None):
    return F.mse_loss if vocab is None else autopar.lm_cross_entropy


def _eval_output_program(name: str) -> autopar.ParallelProgram:
    """The layout's model and loss compiled for it (once per test and process), its batch's first
    microbatch as the example."""
    factory, vocab, layout = LAYOUTS[name]
    x, y = _eval_batch(vocab, layout["dp"])
    return parallelize_on(factory(), [((x,), (y,))], MB, microbatches=M, loss_fn=_loss_fn(vocab), **layout)


def _evaluate_every_layout() -> dict:
    """Per layout: the logits asked for everywhere, on rank 0 only, and (with dp) on the last stage
    with this replica's own rows; the losses of each."""
    out = {}
    for name, (_, vocab, layout) in LAYOUTS.items():
        x, y = _eval_batch(vocab, layout["dp"])
        engine = _eval_output_program(name).materialize()
        loss, logits = engine.eval_step(x, y, outputs=True)
        r = {"loss": loss, "logits": logits, "plain": engine.eval_step(x, y), "stage": engine.stage,
             "dp": engine.dp_rank, "split_dims": [s.dim for s in LogitsOutput.of(engine.program).splits]}
        r["loss_rank0"], r["logits_rank0"] = engine.eval_step(x, y, outputs=True, to=[0])
        if layout["dp"] > 1:
            rows = x.shape[0] // engine.dp_size
            mine = slice(engine.dp_rank * rows, (engine.dp_rank + 1) * rows)
            r["loss_own"], r["logits_own"] = engine.eval_step(x[mine], y[mine], outputs=True, to="last")
        out[name] = r
    return out


@functools.cache
def _results() -> list[dict]:
    for name in LAYOUTS:  # compile once here: the ranks inherit the programs
        _eval_output_program(name)
    return spawn_ranks(_evaluate_every_layout, 4, timeout_s=600)


@functools.cache
def _one_device_eval(name: str) -> tuple[torch.Tensor, float]:
    """One device, ``eval()`` mode: the logits and the loss of the layout's global batch."""
    factory, vocab, layout = LAYOUTS[name]
    model = factory().eval()
    x, y = _eval_batch(vocab, layout["dp"])
    with torch.no_grad():
        logits = default_logits(model(x))
    return logits, float(_loss_fn(vocab)(logits, y))


def _accuracy(logits: torch.Tensor, y: torch.Tensor) -> float:
    return float((logits.argmax(-1) == y).float().mean())


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_logits_equal_one_device(name):
    """Every rank gets the whole logits of the global batch (all microbatches, every replica's rows,
    in order), equal to the single-device model's; the loss is unchanged by asking for them."""
    ref_logits, ref_loss = _one_device_eval(name)
    _, vocab, layout = LAYOUTS[name]
    _, y = _eval_batch(vocab, layout["dp"])
    for rank, results in enumerate(_results()):
        r = results[name]
        assert r["logits"].shape == ref_logits.shape, (name, rank, r["logits"].shape)
        torch.testing.assert_close(r["logits"], ref_logits, **LOGITS_TOLERANCE,
                                   msg=lambda m, rank=rank: f"{name} rank {rank}: {m}")
        torch.testing.assert_close(r["loss"], ref_loss, **LOSS_TOLERANCE)
        assert r["loss"] == r["plain"], (name, rank, r["loss"], r["plain"])
        # what was gathered: the vocabulary of the column-parallel head, the regressor's tokens
        assert r["split_dims"] == ([1] if vocab is None else [2]), (name, r["split_dims"])
        if vocab is None:
            continue
        # the same predicted token everywhere: the smallest gap between one device's two largest
        # logits of a position is 8e-5 for these batches, 300 times the largest difference (2.4e-7);
        # so the accuracy is equal, not close, against any targets: against the batch's (random,
        # about 1/V right) and against targets that are one device's prediction at every other position
        assert torch.equal(r["logits"].argmax(-1), ref_logits.argmax(-1)), (name, rank)
        half = y.clone()
        half.view(-1)[::2] = ref_logits.argmax(-1).view(-1)[::2]
        assert _accuracy(r["logits"], y) == _accuracy(ref_logits, y), (name, rank)
        assert _accuracy(r["logits"], half) == _accuracy(ref_logits, half) >= 0.5, (name, rank)


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_logits_on_the_ranks_that_ask(name):
    """``to=[0]``: rank 0 only gets them (the same as everywhere), the loss everywhere. With dp, a
    replica's own batch and ``to="last"``: the last stage's ranks get their replica's rows."""
    ref_logits, ref_loss = _one_device_eval(name)
    _, _, layout = LAYOUTS[name]
    per_replica = ref_logits.shape[0] // layout["dp"]
    for rank, results in enumerate(_results()):
        r = results[name]
        torch.testing.assert_close(r["loss_rank0"], ref_loss, **LOSS_TOLERANCE)
        if rank == 0:
            assert torch.equal(r["logits_rank0"], r["logits"])
        else:
            assert r["logits_rank0"] is None, (name, rank)
        if layout["dp"] == 1:
            continue
        assert r["logits_own"] is not None if r["stage"] == layout["pp"] - 1 else r["logits_own"] is None
        if r["logits_own"] is not None:
            rows = slice(r["dp"] * per_replica, (r["dp"] + 1) * per_replica)
            torch.testing.assert_close(r["logits_own"], ref_logits[rows], **LOGITS_TOLERANCE)


# ---------------------------------------------------------------- without a process group
def _program_and_batch(model, **layout):
    """``model`` compiled for ``layout`` on one batch of M microbatches, and that batch."""
    (x,), (y,) = token_batches(VOCAB, steps=1, rows=M * MB, seed=5, seq=SEQ)[0]
    config = dict(microbatches=M, world_size=layout["tp"] * layout["pp"], **layout)
    return parallelize_on(model, [((x,), (y,))], MB, **config), x, y


def test_training_graphs_unchanged(monkeypatch):
    """The logits are an extra output of the last chunk's evaluation graph only: every chunk's
    training graph (and its balanced cost) is the same as when tracing marks nothing."""
    marked, _, _ = _program_and_batch(_dropout_gpt(False), tp=2, pp=2)
    monkeypatch.setattr(trace_module, "_logits_marker", lambda t: t)
    trace_reuse.forget()  # the patched tracer traces again
    unmarked, _, _ = _program_and_batch(_dropout_gpt(False), tp=2, pp=2)
    assert unmarked.traced.logits is None and marked.traced.logits is not None
    for a, b in zip(marked.split.chunks, unmarked.split.chunks, strict=True):
        assert a.gm.code == b.gm.code, a.index
        assert len(a.gm.graph.nodes) == len(b.gm.graph.nodes), a.index
        assert a.eval_gm.code == b.eval_gm.code or a.index == len(marked.split.chunks) - 1
    assert marked.split.costs == unmarked.split.costs
    last = marked.split.chunks[-1]
    outputs = [n for n in last.gm.graph.nodes if n.op == "output"][0].args[0]
    eval_outputs = [n for n in last.eval_gm.graph.nodes if n.op == "output"][0].args[0]
    assert len(outputs) == 1 and len(eval_outputs) == 2, (outputs, eval_outputs)
    assert eval_outputs[1].name == marked.traced.logits
    # rank 2 holds the last stage (tp=2): its evaluation code returns the loss and the logits, its
    # training code the loss alone
    returns = [line.strip() for line in marked.code(2, eval=True).splitlines() if "return (" in line]
    assert returns[-1].endswith(f", {marked.traced.logits})"), returns
    returns = [line.strip() for line in marked.code(2).splitlines() if "return (" in line]
    assert returns[-1].count(",") == 1 and returns[-1].endswith(",)"), returns


@pytest.fixture(scope="module")
def one_device() -> tuple:
    """The tied GPT compiled for one device, and its batch: one compile for the tests that run it."""
    return _program_and_batch(_dropout_gpt(True), tp=1, pp=1)


def test_one_device_logits(one_device):
    """One rank, no process group: the logits of both microbatches equal ``model.eval()``'s."""
    model = _dropout_gpt(True)  # the weights the program was compiled from
    program, x, y = one_device
    loss, logits = program.materialize().eval_step(x, y, outputs=True)
    with torch.no_grad():
        want = model.eval()(x)
    torch.testing.assert_close(logits, want, rtol=0, atol=0)  # the same ops in the same order
    torch.testing.assert_close(loss, float(F.cross_entropy(want.flatten(0, 1), y.flatten())), **LOSS_TOLERANCE)


def test_what_cannot_be_returned_fails_first(one_device):
    """``output_fn`` returning no tensor autopar can find the logits in (an object of its own), or ``to``
    naming no rank of the world: a ValueError that says what and how to fix it, raised before the step
    runs. In a tuple beside other values the logits are found (``default_logits``) and returned."""
    from types import SimpleNamespace

    model = _dropout_gpt(True)
    (x,), (y,) = token_batches(VOCAB, steps=1, rows=M * MB, seed=5, seq=SEQ)[0]
    in_tuple = autopar.parallelize(model, example_inputs=(x[:MB],), example_targets=(y[:MB],), microbatches=M,
                                   world_size=1, output_fn=lambda out: (out, out.sum()),
                                   loss_fn=lambda out, t: F.cross_entropy(out[0].flatten(0, 1), t.flatten()))
    loss, logits = in_tuple.materialize().eval_step(x, y, outputs=True)
    assert logits.shape == (M * MB, SEQ, VOCAB)
    program = autopar.parallelize(model, example_inputs=(x[:MB],), example_targets=(y[:MB],), microbatches=M,
                                  world_size=1, output_fn=lambda out: SimpleNamespace(scores=out),
                                  loss_fn=lambda out, t: F.cross_entropy(out.scores.flatten(0, 1), t.flatten()))
    engine = program.materialize()
    with pytest.raises(ValueError, match="output_fn did not return a tensor"):
        engine.eval_step(x, y, outputs=True)
    assert engine.events == []  # nothing ran
    assert isinstance(engine.eval_step(x, y), float)  # the loss alone still works
    good = one_device[0].materialize()
    for to, match in ((3, r"rank\(s\) \[3\] outside the world of 1"), ("first", "expected 'all', 'last'")):
        with pytest.raises(ValueError, match=match):
            good.eval_step(x, y, outputs=True, to=to)


class _BiasedHead(nn.Module):
    """An embedding and a head written ``x @ W.T + b``: normalisation makes the pair one linear, which
    must keep the logits' mark the bias add carried."""

    def __init__(self):
        super().__init__()
        self.wte = nn.Embedding(VOCAB, 32)
        self.w = nn.Parameter(torch.randn(VOCAB, 32) * 0.1)
        self.b = nn.Parameter(torch.randn(VOCAB) * 0.1)

    def forward(self, x):
        return self.wte(x) @ self.w.T + self.b


def test_biased_head_logits():
    """A ``x @ W.T + b`` head made one linear by normalisation still returns its logits."""
    model = seeded(_BiasedHead)
    program, x, y = _program_and_batch(model, tp=1, pp=1)
    assert program.traced.logits is not None
    loss, logits = program.materialize().eval_step(x, y, outputs=True)
    with torch.no_grad():
        want = model.eval()(x)
    torch.testing.assert_close(logits, want, **LOGITS_TOLERANCE)  # linear vs matmul + add: rounding only
