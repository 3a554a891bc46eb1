"""The ``Schedule`` type: per stage, the ordered list of actions of one pipeline step.

Dependencies, for chunk ``c`` and microbatch ``i`` (``L = p*v - 1`` is the
last chunk, which holds the loss)::

    F(c, i)  needs  F(c-1, i)                      (c > 0)
    B(c, i)  needs  F(c, i)  and  B(c+1, i)        (B(L, i) needs only F(L, i))
    W(c, i)  needs  B(c, i)                        (schedules that split backwards)

A schedule *splits its backwards* (the zero-bubble schedules) when it has W
actions: then B is the input gradient only and W the weight gradient, and
every B has its W, on the same stage, before the step's end (the optimizer
update). A schedule splits every backward or none.

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
from functools import cached_property

from autopar.core.config import SPLIT_BACKWARD_SCHEDULES, size_errors
from autopar.schedules.actions import Action, Kind, Loc
from autopar.schedules.grid import FORWARD_ONLY, format_grid, read_grid, wrap_grid
from autopar.schedules.in_flight import in_flight_bound
from autopar.schedules.chunk_placement import Placement, stage_of_chunk
from autopar.schedules.errors import ScheduleError

__all__ = ["Schedule", "schedule_error", "parse_grid"]


@dataclass(frozen=True)
class Schedule:
    """Per-stage action lists of one pipeline step over ``m`` microbatches.

    ``str(schedule)`` is the rank x time grid (:meth:`format_grid`);
    :func:`parse_grid` reads it back.
    """

    name: str
    """One word: one of ``SCHEDULE_NAMES`` ('gpipe', '1f1b', 'interleaved', 'zb-h1', 'zbv') or any custom name."""
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
    placement: Placement = Placement.INTERLEAVED
    """Where each chunk lives (``placement.py``): interleaved ``c % p``, or V (ZB-V)."""

    def __post_init__(self) -> None:
        if self.placement not in tuple(Placement):
            raise ScheduleError(f"unknown chunk placement {self.placement!r}; "
                             f"known: {', '.join(str(x) for x in Placement)}")
        object.__setattr__(self, "placement", Placement(self.placement))
        errs = size_errors(p=self.p, v=self.v, m=self.m)
        if errs:
            raise ScheduleError("; ".join(errs))
        if not self.name or any(ch.isspace() for ch in self.name):
            raise ScheduleError(f"a schedule name must be one non-empty word, got {self.name!r}")
        if set(self.actions) != set(range(self.p)):
            raise ScheduleError(
                f"a schedule for p={self.p} needs action lists for stages 0..{self.p - 1}, "
                f"got stages {sorted(self.actions)}"
            )

    @property
    def num_chunks(self) -> int:
        """``p * v``."""
        return self.p * self.v

    @cached_property
    def chunk_stages(self) -> tuple[int, ...]:
        """The stage of each chunk ``0 .. p*v-1`` under :attr:`placement`."""
        return tuple(stage_of_chunk(self.placement, self.p, c) for c in range(self.num_chunks))

    def stage_of(self, chunk: int) -> int:
        """The stage chunk ``chunk`` lives on (``c % p`` interleaved; the V's for ZB-V)."""
        stages = self.chunk_stages
        if 0 <= chunk < len(stages):
            return stages[chunk]
        return stage_of_chunk(self.placement, self.p, chunk)  # out of range: checks report it

    def chunks_of(self, stage: int) -> tuple[int, ...]:
        """The chunks ``stage`` holds, in model order."""
        return tuple(c for c, s in enumerate(self.chunk_stages) if s == stage)

    @cached_property
    def splits_backward(self) -> bool:
        """True when the backward is split into B (input gradient) and W (weight gradient):
        the schedule is a zero-bubble one ('zb-h1', 'zbv') or has W actions."""
        return self.name in SPLIT_BACKWARD_SCHEDULES or any(a.kind is Kind.W for acts in self.actions.values() for a in acts)

    @property
    def is_lowered(self) -> bool:
        """True when the schedule carries explicit sends and receives."""
        return any(a.is_comm for acts in self.actions.values() for a in acts)

    def in_flight_bound(self, stage: int) -> int:
        """Most (chunk, microbatch) activations ``stage`` may hold: F done and the backward
        not yet done (its B, or its W in a schedule that splits backwards).

        For the named schedules this is ``min(w_r + 1, v*m)`` with ``w_r`` =
        :func:`~autopar.schedules.num_warmup` (a stage runs its warm-up
        forwards, then one more forward before its first backward); that is
        ``v*m`` for GPipe, ``min(p - r, m)`` for 1F1B and
        ``min(2(p-r-1) + (v-1)p + 1, v*m)`` for interleaved 1F1B. ZB-H1 holds
        ``min(p, m)`` on every stage (1F1B's ``p - r`` until B, plus up to ``r``
        waiting for their W), ZB-V ``min(m + r + 1, 2p)`` half-size chunk activations
        (see :func:`~autopar.schedules.in_flight.in_flight_bound`). Custom
        schedules are bounded only by ``v*m``; a forward-only schedule holds none.
        """
        if self.forward_only:
            return 0
        return in_flight_bound(self.name, self.p, self.v, self.m, stage)

    def wrapped(self, width: int = 100) -> str:
        """The grid cut into blocks of steps no wider than ``width`` (a terminal's), one under another."""
        return wrap_grid(self._header(), self.actions, width)

    def _header(self) -> str:
        header = f"{self.name} p={self.p} v={self.v} m={self.m}"
        if self.placement is not Placement.INTERLEAVED:
            header += f" placement={self.placement}"
        return header + (f" {FORWARD_ONLY}" if self.forward_only else "")

    def format_grid(self, marks: Iterable[Loc] = (), columns: tuple[int, int] | None = None) -> str:
        """Rank x time grid: one row per stage, column t = the stage's t-th action.

        Marked actions print as ``[F2.0]``. ``columns=(lo, hi)`` clips the
        grid to steps ``lo .. hi-1`` (shown with ``...``; a clipped grid does
        not parse back).
        """
        return format_grid(self._header(), self.actions, marks, columns)

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
