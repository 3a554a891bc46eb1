"""The structural rules of a schedule, one check each; a broken rule raises
:class:`ScheduleError` with the grid around the failing actions marked.

``simulator.py`` runs the first four before timing a schedule;
``validation.validate`` runs all of them and then a dry run (no deadlock).
"""

from __future__ import annotations

from autopar.core.config import SCHEDULE_NAMES, SPLIT_BACKWARD_SCHEDULES
from autopar.schedules.actions import Action, Key, Kind, Loc
from autopar.schedules.dependencies import partner, partner_key, producers
from autopar.schedules.in_flight import in_flight_counts
from autopar.schedules.schedule import Schedule, schedule_error

__all__ = ["check_placement", "check_split", "check_coverage", "check_matching", "check_order", "check_in_flight"]


def check_placement(schedule: Schedule) -> None:
    """Chunk and microbatch in range, on the chunk's stage; comm peers point at the neighbour."""
    last = schedule.num_chunks - 1
    stages = schedule.chunk_stages
    for s, acts in schedule.actions.items():
        for t, a in enumerate(acts):
            if a.chunk > last or a.microbatch >= schedule.m:
                raise schedule_error(
                    schedule,
                    f"{a} is out of range: chunks are 0..{last}, microbatches 0..{schedule.m - 1}",
                    [(s, t)],
                )
            if stages[a.chunk] != s:  # an Action's chunk is never negative
                home = stages[a.chunk]
                raise schedule_error(
                    schedule,
                    f"{a} is on stage {s}, but chunk {a.chunk} lives on stage {home}",
                    [(s, t)],
                )
            if a.peer is not None:  # a send or receive
                _check_peer(schedule, a, (s, t))


def _check_peer(schedule: Schedule, action: Action, loc: Loc) -> None:
    (_, chunk, _), stage = partner(schedule, action)
    if not 0 <= chunk < schedule.num_chunks:
        raise schedule_error(schedule, f"{action} has no neighbour chunk {chunk} to talk to", [loc])
    if stage == loc[0]:
        raise schedule_error(
            schedule, f"{action} is not needed: chunk {chunk} lives on the same stage", [loc]
        )
    if action.peer != stage:
        raise schedule_error(
            schedule,
            f"{action} names peer {action.peer}, but chunk {chunk} lives on stage {stage}",
            [loc],
        )


_BACKWARD = (Kind.B, Kind.W, Kind.SEND_B, Kind.RECV_B)
_UNSPLIT_NAMES = tuple(n for n in SCHEDULE_NAMES if n not in SPLIT_BACKWARD_SCHEDULES)


def check_split(schedule: Schedule) -> None:
    """A named schedule that runs whole backwards (GPipe, 1F1B, interleaved) has no W; the
    zero-bubble ones have a W for every B, which :func:`check_coverage` asserts."""
    if schedule.name not in _UNSPLIT_NAMES or schedule.forward_only:
        return
    for s, acts in schedule.actions.items():
        for t, a in enumerate(acts):
            if a.kind is Kind.W:
                raise schedule_error(
                    schedule,
                    f"{a} on stage {s}: {schedule.name} does not split its backwards (each B "
                    f"computes input and weight gradients), so it has no W actions; remove them, or use "
                    f"a schedule that splits every backward ({', '.join(SPLIT_BACKWARD_SCHEDULES)})",
                    [(s, t)],
                )


def check_coverage(schedule: Schedule, where: dict[Key, Loc]) -> None:
    """Every (chunk, microbatch) has one F and one B, and one W if the schedule splits its
    backwards; a forward-only schedule has one F each and no backward action at all (no B,
    W, SB or RB)."""
    if schedule.forward_only:
        _check_no_backward(schedule)
    kinds = (Kind.F, Kind.B, Kind.W) if schedule.splits_backward else (Kind.F, Kind.B)
    for kind in (Kind.F,) if schedule.forward_only else kinds:
        for c in range(schedule.num_chunks):
            for i in range(schedule.m):
                if (kind, c, i) not in where:
                    raise schedule_error(
                        schedule,
                        f"missing {kind.value}{c}.{i} (on stage {schedule.stage_of(c)})"
                        + (" : a schedule with W actions splits every backward, so each B needs its W "
                           "before the step ends" if kind is Kind.W else ""),
                        [],
                    )


def _check_no_backward(schedule: Schedule) -> None:
    for s, acts in schedule.actions.items():
        for t, a in enumerate(acts):
            if a.kind in _BACKWARD:
                raise schedule_error(
                    schedule,
                    f"{a} on stage {s}: a forward-only schedule runs no backward (no B, W, SB or RB actions)",
                    [(s, t)],
                )


def check_matching(schedule: Schedule, where: dict[Key, Loc]) -> None:
    """Every send has exactly one receive and vice versa (duplicates are caught by ``index``)."""
    for s, acts in schedule.actions.items():
        for t, a in enumerate(acts):
            if a.peer is None:  # compute
                continue
            key = partner_key(a)
            if key not in where:
                other = "receive" if a.is_send else "send"
                expected = Action(key[0], key[1], key[2], s)
                message = (f"{a} on stage {s} has no matching {other} {expected} on stage "
                           f"{schedule.stage_of(key[1])}")
                raise schedule_error(schedule, message, [(s, t)])


def check_order(schedule: Schedule, where: dict[Key, Loc]) -> None:
    """Each action comes after what it needs on its own stage.

    F before its B, B before its W; a local producer before its consumer; in a lowered schedule
    also every remote producer's receive before the consumer and every send
    after the compute it ships.
    """
    lowered = schedule.is_lowered
    for s, acts in schedule.actions.items():
        for t, a in enumerate(acts):
            for need in _local_needs(schedule, a, s, lowered):
                loc = where.get(need)
                if loc is None:
                    raise schedule_error(
                        schedule,
                        f"{a} on stage {s} needs {_text(need)} before it, and there is none",
                        [(s, t)],
                    )
                if loc[1] > t:
                    raise schedule_error(
                        schedule,
                        f"{a} on stage {s} runs before {_text(need)}, which it needs",
                        [(s, t), loc],
                    )


def _text(key: Key) -> str:
    """An action's text from its key: ``F2.0``."""
    return f"{key[0].value}{key[1]}.{key[2]}"


def _local_needs(schedule: Schedule, action: Action, stage: int, lowered: bool) -> list[Key]:
    """Keys of the actions on ``stage`` that must precede ``action``."""
    if action.peer is not None:  # a send needs the compute it ships; a receive, nothing local
        kind = action.kind
        if kind is Kind.SEND_F or kind is Kind.SEND_B:
            return [(Kind.F if kind is Kind.SEND_F else Kind.B, action.chunk, action.microbatch)]
        return []
    needs: list[Key] = []
    for key in producers(schedule, action):
        if schedule.stage_of(key[1]) == stage:
            needs.append(key)
        elif lowered:
            recv = Kind.RECV_F if action.kind is Kind.F else Kind.RECV_B
            needs.append((recv, action.chunk, action.microbatch))
    return needs


def check_in_flight(schedule: Schedule) -> None:
    """No stage ever holds more activations than :meth:`Schedule.in_flight_bound`, counting a
    (chunk, microbatch) from its F until its B, or its W in a schedule that splits backwards (a
    forward-only schedule holds none: its forwards keep nothing for a backward)."""
    if schedule.forward_only:
        return
    until = Kind.W if schedule.splits_backward else Kind.B
    for s, acts in schedule.actions.items():
        bound = schedule.in_flight_bound(s)
        for t, held in enumerate(in_flight_counts(acts, until)):
            if held > bound:
                raise schedule_error(
                    schedule,
                    f"stage {s} holds {held} activations after {acts[t]}, "
                    f"above the {schedule.name} bound of {bound}",
                    [(s, t)],
                )
