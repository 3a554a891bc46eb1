"""Activations a stage holds at once: the named schedules' warm-up and bound, and a schedule's real peak.

A stage holds one activation per (chunk, microbatch) whose forward has run
and whose backward has not. The named schedules bound that count through
their warm-up (the forwards a stage runs before its first backward).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from autopar.core.config import SCHEDULE_NAMES
from autopar.schedules.actions import Action, Kind

__all__ = ["num_warmup", "in_flight_bound", "in_flight_counts", "peak_in_flight"]


def num_warmup(name: str, p: int, v: int, m: int, stage: int) -> int:
    """Forwards stage ``r`` runs before its steady state (the paper's warm-up).

    - gpipe: ``v m`` (every forward comes first)
    - 1f1b: ``min(p - r - 1, m)``
    - interleaved: ``min(2 (p - r - 1) + (v - 1) p, v m)``

    The steady state then opens with one more forward, so the first backward
    on stage ``r`` follows ``min(w_r + 1, v m)`` forwards.
    """
    if not 0 <= stage < p:
        raise ValueError(f"stage must be in 0..{p - 1}, got {stage}")
    if name == "gpipe":
        return v * m
    if name == "1f1b":
        return min(p - stage - 1, m)
    if name == "interleaved":
        return min(2 * (p - stage - 1) + (v - 1) * p, v * m)
    raise ValueError(f"unknown schedule {name!r}; known: {', '.join(SCHEDULE_NAMES)}")


def in_flight_bound(name: str, p: int, v: int, m: int, stage: int) -> int:
    """Most activations ``stage`` of schedule ``name`` may hold: ``min(w_r + 1, v m)``
    for the named schedules (``w_r`` = :func:`num_warmup`), ``v m`` for any other."""
    total = v * m
    if name not in SCHEDULE_NAMES:
        return total
    return min(num_warmup(name, p, v, m, stage) + 1, total)


def in_flight_counts(actions: Sequence[Action]) -> list[int]:
    """Number of activations held after each action of one stage's list."""
    held, counts = 0, []
    for a in actions:
        if a.kind is Kind.F:
            held += 1
        elif a.kind is Kind.B:
            held -= 1
        counts.append(held)
    return counts


def peak_in_flight(schedule) -> dict[int, int]:
    """Per stage of a ``Schedule``, the most (chunk, microbatch) activations held at once
    (F run, B not yet); none for a forward-only schedule (its forwards keep nothing)."""
    actions: Mapping[int, Sequence[Action]] = schedule.actions
    if schedule.forward_only:
        return dict.fromkeys(actions, 0)
    return {s: max(in_flight_counts(acts), default=0) for s, acts in actions.items()}
