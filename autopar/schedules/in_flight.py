"""Activations a stage holds at once: the named schedules' warm-up and bound, and a schedule's real peak.

A stage holds one activation per (chunk, microbatch) whose forward has run
and whose backward has not. In a schedule that splits its backwards (ZB-H1,
ZB-V) the backward ends at W: B frees what only the input gradient needed, but
W still needs each layer's input and output gradient, so a microbatch counts
as held from its F until its W. That count is conservative (a microbatch
between its B and its W holds less than a whole activation); the count until
B alone is ``in_flight_counts(actions, until=Kind.B)``. The named schedules
bound the count through their warm-up (the forwards a stage runs before its
first backward).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from autopar.core.config import SCHEDULE_NAMES
from autopar.schedules.actions import Action, Kind
from autopar.schedules.errors import ScheduleError

__all__ = ["num_warmup", "in_flight_bound", "in_flight_counts", "peak_in_flight"]


def num_warmup(name: str, p: int, v: int, m: int, stage: int) -> int:
    """Forwards stage ``r`` runs before its steady state (the paper's warm-up).

    - gpipe: ``v m`` (every forward comes first)
    - 1f1b and zb-h1: ``min(p - r - 1, m)``
    - interleaved: ``min(2 (p - r - 1) + (v - 1) p, v m)``
    - zbv: ``min(2p - 1 - r, m) + r``: the forwards of the stage's first chunk
      (``2(p - r) - 1``, then ``r`` more paired with the second chunk's ``r``; at
      most ``m``), then one more of the second chunk, whose first backward follows
      at once (the V's turn); ``2p - 1`` once ``m >= 2p - 1``

    The steady state then opens with one more forward, so the first backward
    on stage ``r`` follows ``min(w_r + 1, v m)`` forwards.
    """
    if not 0 <= stage < p:
        raise ScheduleError(f"stage must be in 0..{p - 1}, got {stage}")
    if name == "gpipe":
        return v * m
    if name in ("1f1b", "zb-h1"):
        return min(p - stage - 1, m)
    if name == "interleaved":
        return min(2 * (p - stage - 1) + (v - 1) * p, v * m)
    if name == "zbv":
        return min(2 * p - 1 - stage, m) + stage
    raise ScheduleError(f"unknown schedule {name!r}; known: {', '.join(SCHEDULE_NAMES)}")


def in_flight_bound(name: str, p: int, v: int, m: int, stage: int) -> int:
    """Most activations ``stage`` of schedule ``name`` may hold (F run, backward not done).

    ``min(w_r + 1, v m)`` for GPipe, 1F1B and interleaved 1F1B (``w_r`` =
    :func:`num_warmup`). The zero-bubble schedules count a microbatch until its W:

    - zb-h1: ``min(p, m)`` on every stage: 1F1B's ``p - r`` between F and B, plus
      up to ``r`` whose W stage ``r`` delays to fill its cool-down. The peak over
      stages equals 1F1B's (stage 0's ``p``); until B alone, each stage holds
      1F1B's ``min(p - r, m)``.
    - zbv: ``min(w_r + 1, 2p)`` chunk activations (``min(m + r + 1, 2p)``), each
      half a stage's: at most ``p`` stages' worth, 1F1B's stage-0 peak, on every
      stage. The count until B is the same: ZB-V delays no W past the next B
      until its cool-down.

    ``v m`` for any other (custom) name.
    """
    total = v * m
    if name not in SCHEDULE_NAMES:
        return total
    if name == "zb-h1":
        return min(p, m)
    if name == "zbv":
        return min(num_warmup(name, p, v, m, stage) + 1, 2 * p)
    return min(num_warmup(name, p, v, m, stage) + 1, total)


def in_flight_counts(actions: Sequence[Action], until: Kind | None = None) -> list[int]:
    """Number of activations held after each action of one stage's list.

    A (chunk, microbatch) counts from its F until ``until`` (B or W); by default
    until W if the list has W actions (a split backward), else until B.
    """
    if until is None:
        until = Kind.W if any(a.kind is Kind.W for a in actions) else Kind.B
    held, counts = 0, []
    for a in actions:
        if a.kind is Kind.F:
            held += 1
        elif a.kind is until:
            held -= 1
        counts.append(held)
    return counts


def peak_in_flight(schedule, until: Kind | None = None) -> dict[int, int]:
    """Per stage of a ``Schedule``, the most (chunk, microbatch) activations held at once
    (F run, backward not yet: until B, or until W in a schedule that splits backwards;
    ``until`` chooses); none for a forward-only schedule (its forwards keep nothing)."""
    actions: Mapping[int, Sequence[Action]] = schedule.actions
    if schedule.forward_only:
        return dict.fromkeys(actions, 0)
    if until is None:
        until = Kind.W if schedule.splits_backward else Kind.B
    return {s: max(in_flight_counts(acts, until), default=0) for s, acts in actions.items()}
