"""An action that fails inside the engine says where: the rank, its (pp, dp, tp)
coordinates, the action, and the schedule grid with the action marked. With
peers, every rank raises the same root cause (none hangs), and a failed engine
refuses further steps on every rank.

The failure is deterministic and happens inside one action on one rank: that
rank's chunk graphs are wrapped to raise ``IndexError`` in the forward of a
microbatch holding the marker token ``MARK`` (an id inside the vocabulary, which
the other microbatches never hold).
"""

import time

import pytest
import torch
from helpers import spawn_ranks

import autopar
from autopar.reference.models import ModelConfig, build
from autopar.runtime.engine import ActionError, EngineFailedError

VOCAB, ROWS, SEQ, M = 256, 2, 16, 3
MARK = VOCAB - 1
"""The token id that marks the failing microbatch."""


def _marked_program(family: str = "gpt", **config):
    torch.manual_seed(0)
    model = build(family, ModelConfig(vocab_size=VOCAB))
    x = torch.randint(0, MARK, (ROWS, SEQ))
    return autopar.parallelize(model, microbatches=M, example_inputs=(x,), example_targets=x, **config)


def _marked_batch(bad_microbatch: int | None):
    """A global batch of M microbatches; ``bad_microbatch`` holds ``MARK`` in its inputs and targets."""
    x = torch.randint(0, MARK, (ROWS * M, SEQ), generator=torch.Generator().manual_seed(1))
    y = x.clone()
    if bad_microbatch is not None:
        x[bad_microbatch * ROWS, 3] = y[bad_microbatch * ROWS, 3] = MARK
    return x, y


class _RaisesOnMark:
    """A chunk graph that raises in the forward of a microbatch whose token ids (inputs, or the
    targets the last chunk reads) hold ``MARK``."""

    def __init__(self, run):
        self.run = run

    def __call__(self, *args):
        if any(isinstance(a, torch.Tensor) and a.dtype == torch.int64 and bool((a == MARK).any()) for a in args):
            raise IndexError(f"token id {MARK} marks this microbatch as failing")
        return self.run(*args)


def _failing_on(engine, rank: int):
    """``engine`` with its chunk graphs raising on ``MARK`` if it is global rank ``rank``."""
    if engine.mesh.rank == rank:
        for chunk, run in list(engine.runnables.items()):
            engine.runnables[chunk] = _RaisesOnMark(run)
    return engine


def test_failing_forward_names_rank_action_and_marks_the_grid():
    engine = _failing_on(_marked_program(tp=1).materialize(), 0)
    assert engine.train_step(*_marked_batch(None)) > 0  # the same engine steps on a good batch

    with pytest.raises(ActionError) as err:
        engine.train_step(*_marked_batch(1))
    msg = str(err.value)
    assert "rank 0 (pp=0, dp=0, tp=0)" in msg
    assert "failed running F0.1 (stage 0, step 2" in msg
    assert "IndexError" in msg  # the original error, also kept as the cause
    assert isinstance(err.value.__cause__, IndexError)
    # the grid: this rank's row with the failing action marked, the others not
    assert "1f1b p=1 v=1 m=3" in msg
    assert "[F0.1]" in msg and "[F0.0]" not in msg and "[B0.0]" not in msg
    row = next(line for line in msg.splitlines() if line.startswith("stage 0:"))
    assert row.split() == ["stage", "0:", "F0.0", "B0.0", "[F0.1]", "B0.1", "F0.2", "B0.2"]
    assert err.value.rank == 0 and err.value.coords == (0, 0, 0)
    assert [str(a) for a in err.value.actions] == ["F0.1"] and err.value.marks == ((0, 2),)
    assert err.value.root is None and err.value.root_rank == 0  # one rank: no peer to tell

    # one rank, no peer: nothing of the failed step is left in flight, and the next good step runs
    # and matches a fresh engine's (a failed step's gradients stay in .grad, as a failed backward's would)
    loss = engine.train_step(*_marked_batch(None))
    assert loss == pytest.approx(_marked_program(tp=1).materialize().train_step(*_marked_batch(None)), rel=1e-6)


def test_engine_device_and_batch_on_it():
    engine = _marked_program(tp=1).materialize()
    assert engine.device == torch.device("cpu")
    assert all(p.device == engine.device for p in engine.parameters())
    engine.train_step(*_marked_batch(None))
    assert all(p.grad.device == engine.device for p in engine.parameters())


def _fail_on_stage_0():
    engine = _failing_on(_marked_program(tp=1, pp=2).materialize(), 0)
    engine.train_step(*_marked_batch(2))  # stage 0 runs microbatch 2's forward F0.2; stage 1 waits for it
    return "unreachable"


@pytest.mark.multiprocess
def test_a_failing_action_on_one_stage_stops_the_other():
    """Stage 0 fails in F0.2 while stage 1 waits for that microbatch's activations: the launcher
    reports stage 0's failure with its context (not a timeout of the waiting rank) and stops both."""
    with pytest.raises(autopar.RankError) as err:
        autopar.spawn(_fail_on_stage_0, 2, timeout_s=600)
    msg = str(err.value)
    assert "rank 0 of 2 failed: ActionError: rank 0 (pp=0, dp=0, tp=0) failed running F0.2" in msg
    assert "[F0.2]" in msg and "did not finish" not in msg


def _failing_step_then_another(family: str, config: dict, failing_rank: int, bad_microbatch: int):
    """One good step, a step that fails on ``failing_rank``, and one more step: what each raised, and
    how long each took."""
    engine = _failing_on(_marked_program(family, **config).materialize(), failing_rank)
    engine.failure_timeout_s = 30.0  # a guard: the failure reaches every rank long before
    engine.train_step(*_marked_batch(None))
    start = time.monotonic()
    try:
        engine.train_step(*_marked_batch(bad_microbatch))
        failed = None
    except ActionError as e:
        failed = (str(e), e.rank, e.root_rank, type(e.__cause__).__name__)
    failed_after = time.monotonic() - start
    start = time.monotonic()
    try:
        engine.train_step(*_marked_batch(None))
        refused = None
    except EngineFailedError as e:
        refused = (str(e), e.root.rank)
    refused_after = time.monotonic() - start
    also_refused = []  # the evaluation step and the collectives outside the schedule
    for name, call in [("eval_step", lambda: engine.eval_step(*_marked_batch(None))),
                       ("clip_grad_norm_", lambda: engine.clip_grad_norm_(1.0)),
                       ("full_state_dict", engine.full_state_dict)]:
        try:
            call()
        except EngineFailedError as e:
            also_refused.append(name if f"so {name} is refused" in str(e) else str(e))
    return failed, failed_after, refused, refused_after, also_refused


def _assert_every_rank_raised(results, root: str, coords: list[str]):
    """Every rank raised ``root`` (the failing rank's headline and the original error), said where
    it saw it, and refused the next step at once with the root cause."""
    root_rank = int(root.split()[1])
    for rank, (failed, failed_after, refused, refused_after, also_refused) in enumerate(results):
        assert failed is not None, f"rank {rank} finished the failing step"
        msg, raised_on, named_root, cause = failed
        assert raised_on == rank and named_root == root_rank, (rank, failed)
        assert msg.startswith(root), (rank, msg)
        assert f"IndexError: token id {MARK} marks this microbatch as failing" in msg.splitlines()[0], (rank, msg)
        if rank == root_rank:
            assert cause == "IndexError" and "seen from" not in msg
        else:  # where this rank was when it saw it
            assert f"\nseen from rank {rank} ({coords[rank]}) " in msg, (rank, msg)
        assert failed_after < 15, (rank, failed_after)  # a hang guard: no rank waits for a timeout
        assert refused is not None, f"rank {rank} ran a step after the failure"
        text, refused_root = refused
        assert refused_root == root_rank
        assert text.startswith(f"this engine failed at step 2 (train_step) on rank {rank} ({coords[rank]}): "
                               f"{root}"), (rank, text)
        assert "its state is inconsistent" in text and "restart the job" in text
        assert refused_after < 5, (rank, refused_after)
        assert also_refused == ["eval_step", "clip_grad_norm_", "full_state_dict"], (rank, also_refused)


@pytest.mark.multiprocess
def test_a_failure_on_the_last_stage_reaches_the_first():
    """pp=2: stage 1 fails in F1.1 while stage 0 waits for the gradients of its microbatch 1."""
    results = spawn_ranks(_failing_step_then_another, 2, "gpt", {"pp": 2}, 1, 1, timeout_s=120)
    _assert_every_rank_raised(results, "rank 1 (pp=1, dp=0, tp=0) failed running F1.1 (stage 1, step ",
                              ["pp=0, dp=0, tp=0", "pp=1, dp=0, tp=0"])
    seen = results[0][0][0].splitlines()[1]
    # stage 0 meets the failure over the gradients stage 1 never sent: waiting for them in B0.1, or,
    # when stage 1 closed its connections first, posting the run that receives them
    waiting = seen.startswith("seen from rank 0 (pp=0, dp=0, tp=0) while running B0.1 (stage 0, step ")
    assert (waiting and "waiting for RB0.1" in seen) or (
        seen.startswith("seen from rank 0 (pp=0, dp=0, tp=0) while running ") and " RB0.1<1 (stage 0, " in seen), seen


@pytest.mark.multiprocess
def test_a_failure_on_one_tensor_parallel_rank_reaches_every_rank():
    """tp=2 x pp=2 (a Llama): rank 1 (stage 0, tp rank 1) fails in F0.1; its tp peer waits in a
    collective of F0.1, stage 1 for activations that never come."""
    results = spawn_ranks(_failing_step_then_another, 4, "llama", {"tp": 2, "pp": 2}, 1, 1, timeout_s=180)
    _assert_every_rank_raised(results, "rank 1 (pp=0, dp=0, tp=1) failed running F0.1 (stage 0, step ",
                              ["pp=0, dp=0, tp=0", "pp=0, dp=0, tp=1", "pp=1, dp=0, tp=0", "pp=1, dp=0, tp=1"])


class _HangsOnMark(_RaisesOnMark):
    """A chunk graph that works for ``HANG_S`` seconds, communicating nothing, on ``MARK``."""

    def __call__(self, *args):
        if any(isinstance(a, torch.Tensor) and a.dtype == torch.int64 and bool((a == MARK).any()) for a in args):
            time.sleep(HANG_S)
        return self.run(*args)


HANG_S = 8.0


def _hanging_step():
    engine = _marked_program("gpt", pp=2).materialize()
    if engine.mesh.rank == 1:
        engine.runnables = {c: _HangsOnMark(run) for c, run in engine.runnables.items()}
    engine.failure_timeout_s = 1.5
    engine.train_step(*_marked_batch(None))
    start = time.monotonic()
    try:
        engine.train_step(*_marked_batch(1))
        return None, time.monotonic() - start
    except ActionError as e:
        return str(e).splitlines()[0], time.monotonic() - start


@pytest.mark.multiprocess
def test_a_rank_that_stops_communicating_fails_the_step_after_the_timeout():
    """Stage 1 works 8 s in F1.1 without a word while stage 0 waits for its gradients: after
    ``failure_timeout_s`` (1.5 s) without progress the step fails with a TimeoutError on both ranks,
    stage 0 long before the 8 s are over."""
    (first0, after0), (first1, after1) = spawn_ranks(_hanging_step, 2, timeout_s=120)
    for first in (first0, first1):
        assert first is not None and "TimeoutError: no progress for " in first, first
        assert "(engine.failure_timeout_s = 1.5 s)" in first
    assert after0 < HANG_S - 2, after0  # the waiting rank did not wait for the hang to end
