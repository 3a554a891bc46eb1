"""The engine's errors: a failing action, a request the engine refuses, a failure while it runs.

``ActionError`` wraps whatever an action of the schedule raised, with the rank,
its coordinates and the schedule grid around the action; ``EngineUsageError``
and ``EngineRuntimeError`` are the engine's own refusals (a bad argument or
setup, a call out of its order); ``NonFiniteError`` stops a run whose steps kept
producing non-finite numbers (``step_health.py``). The batch's refusals are
``BatchError`` (``batch_checks.py``), a failed engine's ``EngineFailedError``
(``failure_board.py``).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING

from autopar.core.errors import AutoparError

if TYPE_CHECKING:
    from autopar.schedules import Action

__all__ = ["ActionError", "EngineUsageError", "EngineRuntimeError", "NonFiniteError"]


class EngineUsageError(AutoparError, ValueError):
    """The engine was asked for something it cannot do as asked (parameters on several devices, an
    argument out of range): the message says what and the fix."""


class EngineRuntimeError(AutoparError, RuntimeError):
    """A call the engine's state does not allow now (a weight backward without its backward, a peer
    that failed while building the engines)."""


class NonFiniteError(AutoparError, FloatingPointError):
    """``engine.max_nonfinite_steps`` training steps in a row had a non-finite loss or gradient norm:
    the run stops. Raised on every rank; ``health`` is the last step's ``StepHealth`` (the step, what
    was not finite, the microbatch, stage and rank)."""

    def __init__(self, message: str, health=None) -> None:
        super().__init__(message)
        self.health = health
        """The ``StepHealth`` of the step that stopped the run."""

    def __reduce__(self):
        return type(self), (str(self), self.health)


class ActionError(AutoparError, RuntimeError):
    """An action of this rank's schedule raised; ``__cause__`` is the original exception.

    The message names the rank, its (pp, dp, tp) coordinates and the action(s),
    and ends with the schedule grid around them, marked ``[..]``. With peers, the
    message starts with the root cause (the first failure any rank published:
    ``root``) and, on the other ranks, says where this rank saw it.
    """

    def __init__(self, message: str, rank: int, coords: tuple[int, int, int],
                 actions: Iterable["Action"], marks: Iterable[tuple[int, int]], root=None) -> None:
        super().__init__(message)
        self.rank = rank
        self.coords = coords
        """(pp, dp, tp) of the rank."""
        self.actions = tuple(actions)
        """The failing action, or the run of sends/receives that was being posted (empty: the
        failure came outside the schedule's actions, or a peer's was seen at the step's end)."""
        self.marks = tuple(marks)
        """(stage, index in the stage's action list) of each failing action."""
        self.root = root
        """The root cause: the failure published first (a ``failures.Failure``; this rank's own when it
        is the root); None without peers."""

    @property
    def root_rank(self) -> int:
        """The rank that failed first (this one without peers)."""
        return self.rank if self.root is None else self.root.rank

    def __reduce__(self):
        return type(self), (str(self), self.rank, self.coords, self.actions, self.marks, self.root)
