"""The ``Schedule`` type: per stage, the ordered list of actions of one pipeline step.

Dependencies, for chunk ``c`` and microbatch ``i`` (``L = p*v - 1`` is the
last chunk, which holds the loss)::

    F(c, i)  needs  F(c-1, i)                      (c > 0)
    B(c, i)  needs  F(c, i)  and  B(c+1, i)        (B(L, i) needs only F(L, i))

A schedule from a generator (``generators.py``) has compute actions only;
``lowering.py`` adds the point-to-point communication; ``validation.py``
checks one; ``simulator.py`` times one. A *forward-only* schedule (evaluation,
``generators.forward_only``) has the F actions (and their sends and receives)
and no backward; it keeps no activation for one. Nothing here touches
torch.distributed: the runtime only interprets these lists.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from autopar.core.config import size_errors
from autopar.schedules.actions import Action, Loc
from autopar.schedules.grid import FORWARD_ONLY, format_grid, read_grid
from autopar.schedules.in_flight import in_flight_bound

__all__ = ["Schedule", "ScheduleError", "schedule_error", "parse_grid"]


class ScheduleError(ValueError):
    """A schedule failed validation; the message shows the grid with the failing actions marked."""

    def __init__(self, message: str, marks: Sequence[Loc] = ()) -> None:
        super().__init__(message)
        self.marks: tuple[Loc, ...] = tuple(marks)
        """(stage, index) of each marked action."""


@dataclass(frozen=True)
class Schedule:
    """Per-stage action lists of one pipeline step over ``m`` microbatches.

    ``str(schedule)`` is the rank x time grid (:meth:`format_grid`);
    :func:`parse_grid` reads it back.
    """

    name: str
    """One word: 'gpipe', '1f1b', 'interleaved' or any custom name."""
    p: int
    """Pipeline stages."""
    v: int
    """Virtual chunks per stage (p*v chunks in all)."""
    m: int
    """Microbatches per step."""
    actions: dict[int, list[Action]] = field(repr=False)
    """Stage -> the actions it runs, in order."""
    forward_only: bool = False
    """True for an evaluation schedule: one F per (chunk, microbatch), no B, nothing kept for a backward."""

    def __post_init__(self) -> None:
        errs = size_errors(p=self.p, v=self.v, m=self.m)
        if errs:
            raise ValueError("; ".join(errs))
        if not self.name or any(ch.isspace() for ch in self.name):
            raise ValueError(f"a schedule name must be one non-empty word, got {self.name!r}")
        if set(self.actions) != set(range(self.p)):
            raise ValueError(
                f"a schedule for p={self.p} needs action lists for stages 0..{self.p - 1}, "
                f"got stages {sorted(self.actions)}"
            )

    @property
    def num_chunks(self) -> int:
        """``p * v``."""
        return self.p * self.v

    def stage_of(self, chunk: int) -> int:
        """Interleaved placement: chunk ``c`` lives on stage ``c % p``."""
        return chunk % self.p

    @property
    def is_lowered(self) -> bool:
        """True when the schedule carries explicit sends and receives."""
        return any(a.is_comm for acts in self.actions.values() for a in acts)

    def in_flight_bound(self, stage: int) -> int:
        """Most (chunk, microbatch) activations ``stage`` may hold (F done, B not yet).

        For the named schedules this is ``min(w_r + 1, v*m)`` with ``w_r`` =
        :func:`~autopar.schedules.num_warmup` (a stage runs its warm-up
        forwards, then one more forward before its first backward); that is
        ``v*m`` for GPipe, ``min(p - r, m)`` for 1F1B and
        ``min(2(p-r-1) + (v-1)p + 1, v*m)`` for interleaved 1F1B. Custom
        schedules are bounded only by ``v*m``; a forward-only schedule holds none.
        """
        if self.forward_only:
            return 0
        return in_flight_bound(self.name, self.p, self.v, self.m, stage)

    def format_grid(self, marks: Iterable[Loc] = (), columns: tuple[int, int] | None = None) -> str:
        """Rank x time grid: one row per stage, column t = the stage's t-th action.

        Marked actions print as ``[F2.0]``. ``columns=(lo, hi)`` clips the
        grid to steps ``lo .. hi-1`` (shown with ``...``; a clipped grid does
        not parse back).
        """
        header = f"{self.name} p={self.p} v={self.v} m={self.m}" + (f" {FORWARD_ONLY}" if self.forward_only else "")
        return format_grid(header, self.actions, marks, columns)

    def __str__(self) -> str:
        return self.format_grid()


def parse_grid(text: str) -> Schedule:
    """Inverse of :meth:`Schedule.format_grid` (unclipped); marks ``[..]`` are ignored."""
    return Schedule(*read_grid(text))


def schedule_error(schedule: Schedule, message: str, marks: Sequence[Loc]) -> ScheduleError:
    """A ScheduleError whose message ends with the grid around the marked actions."""
    if marks:
        steps = [t for _, t in marks]
        columns = (min(steps) - 8, max(steps) + 9)
        where = ", ".join(f"stage {s} step {t}" for s, t in marks)
        grid = schedule.format_grid(marks, columns)
        message = f"{message}\n(marked: {where})\n{grid}"
    else:
        message = f"{message}\n{schedule.format_grid()}"
    return ScheduleError(message, marks)
