"""``validate``: every rule a schedule must keep, and freedom from deadlock."""

from __future__ import annotations

from autopar.schedules.checks import (
    check_coverage,
    check_in_flight,
    check_matching,
    check_order,
    check_placement,
    check_split,
)
from autopar.schedules.dependencies import index
from autopar.schedules.schedule import Schedule
from autopar.schedules.simulator import check_deadlock

__all__ = ["validate"]


def validate(schedule: Schedule) -> None:
    """Check a schedule; raise :class:`ScheduleError` (a ValueError) with the grid marked.

    Asserts, in order: every action is on its chunk's stage (by the
    schedule's placement) with in-range indices and (for sends/receives) the
    right peer; a named schedule that runs whole backwards has no W; each
    (chunk, microbatch) has exactly one F and one B, and one W if the schedule
    splits its backwards (a forward-only schedule: one F, and no B, W, SB or
    RB anywhere); each send has exactly one matching receive; on every stage
    an action follows what it needs locally (F before its B, B before its W,
    local producers, and in a lowered schedule the receive of each remote
    input and the compute before each send); per stage r the in-flight count
    (F until B, or until W) never exceeds :meth:`Schedule.in_flight_bound`;
    and a dry run with
    ``batched`` sends (a send blocks until its receive is posted) finishes:
    no deadlock.
    """
    check_placement(schedule)
    check_split(schedule)
    where = index(schedule)
    check_coverage(schedule, where)
    check_matching(schedule, where)
    check_order(schedule, where)
    check_in_flight(schedule)
    check_deadlock(schedule, where)
