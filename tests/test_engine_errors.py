"""An action that fails inside the engine says where: the rank, its (pp, dp, tp)
coordinates, the action, and the schedule grid with the action marked.

The failure is deterministic: a token id beyond the vocabulary in one
microbatch makes the embedding raise (on the CPU) in that microbatch's forward.
"""

import pytest
import torch

import autopar
from autopar.reference.models import ModelConfig, build
from autopar.runtime.engine import ActionError

VOCAB, ROWS, SEQ, M = 256, 2, 16, 3


def _program(**config):
    torch.manual_seed(0)
    model = build("gpt", ModelConfig(vocab_size=VOCAB))
    x = torch.randint(0, VOCAB, (ROWS, SEQ))
    return autopar.parallelize(model, microbatches=M, example_inputs=(x,), example_targets=x, **config)


def _batch(bad_microbatch: int | None):
    """A global batch of M microbatches; ``bad_microbatch`` holds a token id the embedding rejects."""
    x = torch.randint(0, VOCAB, (ROWS * M, SEQ), generator=torch.Generator().manual_seed(1))
    y = x.clone()
    if bad_microbatch is not None:
        x[bad_microbatch * ROWS, 3] = VOCAB + 7
    return x, y


def test_failing_forward_names_rank_action_and_marks_the_grid():
    engine = _program(tp=1).materialize()
    assert engine.train_step(*_batch(None)) > 0  # the same engine steps on a good batch

    with pytest.raises(ActionError) as err:
        engine.train_step(*_batch(1))
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

    # nothing of the failed step stays behind: the next good step runs and matches a fresh engine's
    loss = engine.train_step(*_batch(None))
    assert loss == pytest.approx(_program(tp=1).materialize().train_step(*_batch(None)), rel=1e-6)


def test_engine_device_and_batch_on_it():
    engine = _program(tp=1).materialize()
    assert engine.device == torch.device("cpu")
    assert all(p.device == engine.device for p in engine.parameters())
    engine.train_step(*_batch(None))
    assert all(p.grad.device == engine.device for p in engine.parameters())


def _fail_on_stage_0():
    engine = _program(tp=1, pp=2).materialize()
    engine.train_step(*_batch(2))  # stage 0 embeds the inputs; stage 1 reads only the targets
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
