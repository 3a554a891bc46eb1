"""Whether a training step's numbers are finite, where they are not, and what the engine does then.

A step is *non-finite* when a microbatch's loss on a last-stage rank, or the
global 2-norm of the gradients, is NaN or infinite. Both are told apart without
extra communication while the numbers are finite:

- the step's loss is reduced over the stages and replicas anyway
  (``engine._reduce_loss``): a non-finite microbatch loss, weighted into it,
  makes it non-finite on every rank. Only then one all-reduce (MIN over the
  world) names the first (rank, microbatch) whose loss is not finite
  (``locate_loss``);
- the gradient norm is the one ``clip_grad_norm_`` computes
  (``GradientSync.global_norm``: the same value on every rank); a loop that
  does not clip has it computed when the optimizer is stepped. Only when it is
  not finite one ``all_gather_object`` names the first rank holding
  non-finite gradients of its own (with a distributed optimizer, the replica
  they came from, not the one owning their reduced range) and its parameters
  (``locate_grads``).

A microbatch that counts no target (its mean 0/0, its weight 0) is not a bad
number, nor a global batch that counts none: their loss is NaN by definition
and their gradients zero (``loss_weights.py``).

``StepHealth`` is the verdict (``engine.last_step``). ``StepChecks`` keeps an
engine's verdicts and applies the policy once per training step: a finite step
is stepped; a non-finite one is skipped (the optimizer and the LR scheduler not
stepped, the gradients dropped, a warning logged on rank 0 with the step,
microbatch, stage and rank), and the ``limit``-th non-finite step in a row
(``engine.max_nonfinite_steps``) raises ``NonFiniteError`` on every rank instead.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import torch
import torch.distributed as dist

from autopar.core.log import get_logger
from autopar.runtime.engine.errors import EngineUsageError, NonFiniteError

__all__ = ["StepHealth", "StepChecks", "locate_loss", "locate_grads", "DEFAULT_MAX_NONFINITE_STEPS"]

DEFAULT_MAX_NONFINITE_STEPS = 3
"""``engine.max_nonfinite_steps`` unless set: the third non-finite step in a row stops the run."""

_log = get_logger(__name__)
_KINDS = (float("nan"), float("inf"), float("-inf"))
"""The non-finite values, by the code ``locate_loss`` sends for each."""


@dataclass(frozen=True)
class StepHealth:
    """Whether one training step's loss and gradient norm were finite, and where they were not."""

    step: int
    """The training step: ``train_step`` calls of this engine counted from 1 (from a loaded
    checkpoint's step on after ``engine.load``)."""
    finite: bool
    """Every microbatch loss and the gradient norm finite (as far as checked: the gradient norm is
    known once clipped or once the optimizer was stepped)."""
    what: str | None = None
    """``"loss"`` or ``"grad norm"``: what was not finite (None when finite)."""
    microbatch: int | None = None
    """The first microbatch (of its replica's step) whose loss was not finite."""
    stage: int | None = None
    """The pipeline stage of ``rank``."""
    rank: int | None = None
    """The first global rank holding the non-finite loss, or a non-finite gradient."""
    value: float | None = None
    """The non-finite value: the microbatch's loss, or the gradient norm."""
    params: tuple[str, ...] = ()
    """``"grad norm"``: the parameters whose gradient on ``rank`` holds a NaN or an infinity."""
    grad_norm: float | None = None
    """The gradients' global 2-norm, once computed for this step."""

    def describe(self) -> str:
        """One line: the step, what was not finite and where."""
        if self.finite:
            return f"step {self.step}: finite"
        where = f" on stage {self.stage} (rank {self.rank})" if self.rank is not None else ""
        if self.what == "loss":
            micro = f" of microbatch {self.microbatch}" if self.microbatch is not None else ""
            return f"step {self.step}: the loss{micro} is {self.value}{where}"
        shown = ", ".join(self.params[:4]) + (f" and {len(self.params) - 4} more" if len(self.params) > 4 else "")
        held = f"; non-finite gradients{where}: {shown}" if self.params else where
        return f"step {self.step}: the gradient norm is {self.value}{held}"


def locate_loss(losses: dict[int, torch.Tensor], m: int, device: torch.device) -> tuple[int, int, float] | None:
    """(rank, microbatch, value) of the first microbatch loss that is not finite on any rank, in
    (rank, microbatch) order; None when every one is. ``losses``: this rank's microbatch -> its
    loss (a last-stage rank's; empty elsewhere). Collective: one all-reduce over the world."""
    rank = dist.get_rank() if dist.is_initialized() else 0
    world = dist.get_world_size() if dist.is_initialized() else 1
    none = world * m * len(_KINDS)
    key = none
    order = sorted(losses)
    values = torch.stack([losses[i].double() for i in order]).tolist() if order else []  # one transfer
    for micro, value in zip(order, values):
        if not math.isfinite(value):
            kind = 0 if math.isnan(value) else (1 if value > 0 else 2)
            key = (rank * m + micro) * len(_KINDS) + kind
            break
    found = torch.tensor([key], dtype=torch.int64, device=device)
    if world > 1:
        dist.all_reduce(found, op=dist.ReduceOp.MIN)
    key = int(found)
    if key == none:
        return None
    at, kind = divmod(key, len(_KINDS))
    return at // m, at % m, _KINDS[kind]


def locate_grads(nonfinite_here: tuple[list[str], list[str]]) -> tuple[int, tuple[str, ...]] | None:
    """(rank, its parameters) of the first rank whose own gradients hold a non-finite value (else the
    first whose reduced ones do: the reduction itself overflowed); None when no rank's do.
    ``nonfinite_here``: this rank's such parameters, (own, reduced) (``GradientSync.nonfinite_grads``).
    Collective: one all_gather_object over the world."""
    if dist.is_initialized() and dist.get_world_size() > 1:
        found: list = [None] * dist.get_world_size()
        dist.all_gather_object(found, nonfinite_here)
    else:
        found = [nonfinite_here]
    for which in (0, 1):
        for rank, names in enumerate(found):
            if names[which]:
                return rank, tuple(names[which])
    return None


class StepChecks:
    """One engine's verdicts on its training steps, and the skip policy.

    The engine calls ``after_loss`` at the end of each ``train_step``, ``after_norm`` when
    ``clip_grad_norm_`` computed the norm, and ``settle`` before an optimizer steps (from
    ``engine.optimizer_step`` or a distributed optimizer's ``step()``): the policy runs once per
    training step, however many of them ask. ``grads``: the engine's ``GradientSync``;
    ``mesh``: its mesh (a rank's stage); ``device``: where the locating all-reduce runs.
    """

    def __init__(self, grads, mesh, device: torch.device, tp_rank: int) -> None:
        self.grads = grads
        self.mesh = mesh
        self.device = device
        self.tp_rank = tp_rank
        self.limit = DEFAULT_MAX_NONFINITE_STEPS
        """``engine.max_nonfinite_steps``: the non-finite steps in a row that stop the run."""
        self.last: StepHealth | None = None
        """``engine.last_step``."""
        self.step = 0
        """Training steps run (from a loaded checkpoint's step on): ``StepHealth.step``."""
        self.in_row: list[StepHealth] = []
        """The non-finite steps since the last finite one."""
        self.skipped = 0
        """Steps skipped so far."""
        self._bad_loss: StepHealth | None = None
        """The first non-finite loss since the optimizer was last stepped (or skipped)."""
        self._norm_checked: StepHealth | None = None
        """This training step's gradient norm, once computed (``clip_grad_norm_`` or ``settle``)."""
        self._settled: tuple[int, bool] | None = None
        """(training step, whether the optimizer steps after it), once decided."""

    def loaded(self, step: int) -> None:
        """A checkpoint of ``step`` was loaded: steps count on from it, nothing pending."""
        self.step, self._bad_loss, self._norm_checked, self._settled = step, None, None, None

    def after_loss(self, losses: dict[int, torch.Tensor], m: int, loss: float, counted: int | None) -> None:
        """A training step ended with ``loss`` (the same on every rank): ``last`` is finite, or names the
        first non-finite microbatch loss (``locate_loss``, only then). ``losses``: this rank's microbatch
        losses; ``counted``: the global batch's counted targets (0: its loss is NaN by definition)."""
        self.step += 1
        self._norm_checked = None
        health = StepHealth(self.step, True)
        if not math.isfinite(loss) and counted != 0:
            found = locate_loss(losses, m, self.device)
            rank, micro, value = found if found is not None else (None, None, loss)
            health = StepHealth(self.step, False, "loss", micro, self._stage(rank), rank, value)
            self._bad_loss = self._bad_loss or health
        self.last = health

    def after_norm(self, norm: float) -> None:
        """This step's gradient norm into ``last``: where the non-finite gradients are when it is not
        finite (``locate_grads``, only then and only after a finite loss)."""
        health = dataclasses.replace(self.last or StepHealth(self.step, True), grad_norm=norm)
        if not math.isfinite(norm) and health.finite:
            found = locate_grads(self.grads.nonfinite_grads())
            rank, params = found if found is not None else (None, ())
            health = dataclasses.replace(health, finite=False, what="grad norm", stage=self._stage(rank), rank=rank,
                                         value=norm, params=params)
        self.last = self._norm_checked = health

    def settle(self) -> bool:
        """Whether the optimizer steps after this training step: the policy (``apply``) run once per
        step on the first non-finite loss since the last optimizer step, else on the gradient norm
        (computed here unless ``clip_grad_norm_`` did). Collective."""
        if self._settled is not None and self._settled[0] == self.step:
            return self._settled[1]
        health = self._bad_loss
        if health is None:
            if self._norm_checked is None:
                self.after_norm(self.grads.global_norm(self.tp_rank, self.mesh.pp_rank))
            health = self._norm_checked
        self._bad_loss = None
        self._settled = (self.step, False)  # stays False if the policy raises
        self._settled = (self.step, self.apply(health))
        return self._settled[1]

    def apply(self, health: StepHealth) -> bool:
        """Whether to step the optimizer after ``health``'s step. A non-finite step is logged and
        skipped (False), or raises ``NonFiniteError`` when it is the ``limit``-th in a row."""
        limit = self.limit
        if isinstance(limit, bool) or not isinstance(limit, int) or limit < 1:
            raise EngineUsageError(f"engine.max_nonfinite_steps must be a positive int (the non-finite steps in a "
                                   f"row that stop the run; 1: the first one does), got {limit!r}")
        if health.finite:
            self.in_row = []
            return True
        self.in_row.append(health)
        if len(self.in_row) >= limit:
            before = "".join(f"\n  skipped {h.describe()}" for h in self.in_row[:-1])
            raise NonFiniteError(
                f"{health.describe()}: the {_ordinal(len(self.in_row))} non-finite step in a row "
                f"(engine.max_nonfinite_steps = {limit}), so the run stops{before}\n"
                f"The weights are those of the last finite step (a skipped step changes nothing). Fix: look at "
                f"the data of these steps, lower the learning rate or clip the gradients, then resume from the "
                f"last checkpoint (a checkpoint is never written with non-finite weights)", health)
        self.skipped += 1
        if not dist.is_initialized() or dist.get_rank() == 0:
            _log.warning("skipped %s: the optimizer was not stepped, the gradients dropped (%d non-finite step(s) "
                         "in a row; %d stop the run: engine.max_nonfinite_steps)",
                         health.describe(), len(self.in_row), limit)
        return False

    def _stage(self, rank: int | None) -> int | None:
        return None if rank is None else self.mesh.shape.coords(rank)[0]


def _ordinal(n: int) -> str:
    """``1st``, ``2nd``, ``3rd``, ``4th``, ..., ``11th``, ``21st``."""
    suffix = "th" if n % 100 in (11, 12, 13) else {1: "st", 2: "nd", 3: "rd"}.get(n % 10, "th")
    return f"{n}{suffix}"
