"""Bad numbers on gloo ranks: a non-finite step is found, named, skipped, and never applied.

A small residual regressor (two blocks and a head; float inputs, ``F.mse_loss``)
trains 4 steps with AdamW and an LR schedule through ``engine.optimizer_step``.
Step 2 is poisoned in one of two ways: NaN targets in its microbatch 1 (a
NaN loss on the last stage), or a backward hook that fills one parameter's
gradient with infinities (a finite loss, an infinite gradient norm). The checks:

- ``engine.last_step`` names what was not finite, the microbatch, the stage
  and the rank, on every rank; rank 0 logs the skip;
- the weights after the 4 steps equal, bit for bit, those of a run on the same
  batches with step 2 left out (the optimizer's moments, step count and the
  learning rate untouched by the skipped step);
- three poisoned steps in a row raise ``NonFiniteError`` on every rank with
  the step, the microbatch and the stage, the first two logged as skipped;
- the distributed optimizer's own ``step()`` skips the same way: its master
  weights and AdamW state after a run with an infinite gradient on one replica
  equal a run without that step, bit for bit.

Bitwise equality holds because the skipped step changes nothing: the runs
compared perform the same floating-point operations on the same values.
"""

import logging

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from families import TinyRegressor
from helpers import assert_bitwise_equal, on_rank0, parallelize_on, spawn_ranks

from autopar import AutoparError
from autopar.runtime.engine.errors import NonFiniteError

pytestmark = pytest.mark.multiprocess

WIDTH, ROWS, M, STEPS, POISONED = 8, 4, 2, 4, 1
"""Global batches of ROWS rows in M microbatches; step index POISONED (the engine's step 2) is the bad one."""
HOOKED = "blocks.0.fc.weight"
"""The parameter whose gradient the hook fills with infinities (on stage 0)."""


def _Regressor() -> nn.Module:
    return TinyRegressor(WIDTH)


def _batches(rows: int = ROWS) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(3)
    return [(torch.randn(rows, WIDTH, generator=g), torch.randn(rows, 4, generator=g)) for _ in range(STEPS)]


def _program(rows: int = ROWS, **layout):
    torch.manual_seed(0)
    data = [((x,), (y,)) for x, y in _batches(rows)]
    return parallelize_on(_Regressor(), data, rows // (layout.get("dp", 1) * M), microbatches=M, loss_fn=F.mse_loss,
                          **layout)


def _nan_in_microbatch_1(y: torch.Tensor) -> torch.Tensor:
    y = y.clone()
    y[y.shape[0] // M:] = float("nan")  # the second microbatch's targets (dp = 1)
    return y


class _Records(logging.Handler):
    """The messages logged in this process (on the root logger: autopar's own stderr handler stays quiet)."""

    def __init__(self):
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def _run(program, poison: str | None, steps: list[int], clip: float | None = None) -> dict:
    """A fresh engine trained on the batches at ``steps`` (indices of ``_batches``) with AdamW and a
    schedule through ``optimizer_step``; at POISONED, ``poison`` ("loss", "grad" or None)."""
    engine = program.materialize()
    optimizer = torch.optim.AdamW(engine.parameters(), lr=1e-2, weight_decay=0.1)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0 / (1 + s))
    hooked = dict(engine.named_local_parameters()).get(HOOKED)
    poisoning = [False]
    if hooked is not None:
        hooked.register_hook(lambda g: torch.full_like(g, float("inf")) if poisoning[0] else g)
    healths, stepped, batches = [], [], _batches()
    for i in steps:
        x, y = batches[i]
        poisoning[0] = poison == "grad" and i == POISONED
        engine.train_step(x, _nan_in_microbatch_1(y) if poison == "loss" and i == POISONED else y)
        if clip is not None:
            engine.clip_grad_norm_(clip)
        stepped.append(engine.optimizer_step(optimizer, scheduler))
        healths.append(engine.last_step)
    return {"weights": on_rank0(engine.full_state_dict()), "healths": healths, "stepped": stepped,
            "lr": scheduler.get_last_lr(), "skipped": engine.step_checks.skipped}


def _pipeline_runs(program) -> dict:
    torch.set_num_threads(1)
    records = _Records()
    logging.getLogger().addHandler(records)
    out = {"reference": _run(program, None, [0, 2, 3]),
           "loss": _run(program, "loss", [0, 1, 2, 3]),
           # clipping at a norm never reached: the norm comes from clip_grad_norm_, nothing is scaled
           "grad": _run(program, "grad", [0, 1, 2, 3], clip=1e9)}
    engine = program.materialize()
    optimizer = torch.optim.SGD(engine.parameters(), lr=1e-2)
    x, y = _batches()[0]
    try:
        for _ in range(3):
            engine.train_step(x, _nan_in_microbatch_1(y))
            engine.optimizer_step(optimizer)
        out["stopped"] = None
    except NonFiniteError as e:
        out["stopped"] = (str(e), e.health, isinstance(e, AutoparError))
    out["logged"] = records.messages
    return out


@pytest.fixture(scope="module")
def pipeline():
    """tp=1 x pp=2 x dp=1, two microbatches: every run on both ranks."""
    program = _program(pp=2)  # compile once here: the ranks inherit it
    return spawn_ranks(_pipeline_runs, 2, program)


def test_nan_loss_names_the_microbatch_and_stage_and_is_skipped(pipeline):
    for rank, r in enumerate(pipeline):
        health = r["loss"]["healths"][POISONED]
        assert (health.step, health.finite, health.what) == (2, False, "loss"), (rank, health)
        assert (health.microbatch, health.stage, health.rank) == (1, 1, 1), (rank, health)
        assert health.value != health.value  # NaN
        assert r["loss"]["stepped"] == [True, False, True, True]
        assert all(h.finite for i, h in enumerate(r["loss"]["healths"]) if i != POISONED)
        assert r["loss"]["skipped"] == 1
    logged = pipeline[0]["logged"]
    assert any(m.startswith("[rank 0] skipped step 2: the loss of microbatch 1 is nan on stage 1 (rank 1)")
               for m in logged), logged
    assert pipeline[1]["logged"] == []  # rank 0 logs for all


def test_weights_after_a_skipped_step_equal_the_run_without_it(pipeline):
    reference = pipeline[0]["reference"]
    for poison in ("loss", "grad"):
        assert_bitwise_equal(pipeline[0][poison]["weights"], reference["weights"], f"{poison} poisoned")
        assert pipeline[0][poison]["lr"] == reference["lr"]  # the scheduler did not step either


def test_infinite_gradient_names_the_stage_rank_and_parameter(pipeline):
    for rank, r in enumerate(pipeline):
        health = r["grad"]["healths"][POISONED]
        assert (health.finite, health.what, health.stage, health.rank) == (False, "grad norm", 0, 0), (rank, health)
        assert health.params == (HOOKED,) and health.value == float("inf") and health.microbatch is None
        finite = r["grad"]["healths"][0]
        assert finite.finite and 0 < finite.grad_norm < float("inf")
    assert any(f"step 2: the gradient norm is inf; non-finite gradients on stage 0 (rank 0): {HOOKED}" in m
               for m in pipeline[0]["logged"])


def test_three_non_finite_steps_in_a_row_stop_the_run_on_every_rank(pipeline):
    for rank, r in enumerate(pipeline):
        assert r["stopped"] is not None, rank
        message, health, is_autopar = r["stopped"]
        assert is_autopar and health.step == 3 and (health.microbatch, health.stage) == (1, 1)
        assert message.startswith("step 3: the loss of microbatch 1 is nan on stage 1 (rank 1): the 3rd non-finite "
                                  "step in a row (engine.max_nonfinite_steps = 3)"), message
        assert "skipped step 1: the loss of microbatch 1" in message and "skipped step 2:" in message


def _distributed_optimizer_runs(program) -> dict:
    """dp = 2: AdamW sharded over the replicas, stepped by its own ``step()``; the infinite gradient
    on replica 1 only."""
    torch.set_num_threads(1)
    out = {}
    for label, steps in (("reference", [0, 2]), ("poisoned", [0, 1, 2])):
        engine = program.materialize()
        optimizer = engine.distributed_optimizer(torch.optim.AdamW, lr=1e-2, weight_decay=0.1)
        poisoning = [False]
        if engine.dp_rank == 1:
            hooked = dict(engine.named_local_parameters())[HOOKED]
            hooked.register_hook(lambda g: torch.full_like(g, float("inf")) if poisoning[0] else g)
        batches, healths = _batches(ROWS * 2), []
        for i in steps:
            poisoning[0] = i == POISONED
            engine.train_step(*batches[i])
            optimizer.step()  # not engine.optimizer_step: the distributed optimizer skips by itself
            optimizer.zero_grad()
            healths.append(engine.last_step)
        state = optimizer.state_dict()
        out[label] = {"weights": engine.full_state_dict(), "master": state["master"], "healths": healths,
                      "moments": {k: v for i, s in state["inner"]["state"].items() for k, v in
                                  ((f"{i}.{name}", t) for name, t in s.items())}}
    return out


def test_distributed_optimizer_skips_a_non_finite_step_leaving_masters_and_state_untouched():
    program = _program(ROWS * 2, dp=2)
    for rank, r in enumerate(spawn_ranks(_distributed_optimizer_runs, 2, program)):
        poisoned, reference = r["poisoned"], r["reference"]
        health = poisoned["healths"][POISONED]
        assert (health.finite, health.what, health.rank) == (False, "grad norm", 1), (rank, health)
        assert_bitwise_equal(poisoned["weights"], reference["weights"], f"rank {rank} weights")
        assert_bitwise_equal(dict(enumerate(poisoned["master"])), dict(enumerate(reference["master"])),
                             f"rank {rank} master copies")
        assert_bitwise_equal(poisoned["moments"], reference["moments"], f"rank {rank} AdamW state (step included)")
