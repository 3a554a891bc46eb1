"""``lower``: add the sends and receives that carry every cross-stage dependency."""

from __future__ import annotations

import dataclasses
from bisect import bisect_left

import autopar.schedules.validation as validation
from autopar.schedules.actions import Action, Key, Kind, Loc
from autopar.schedules.dependencies import index, producers
from autopar.schedules.errors import ScheduleError
from autopar.schedules.schedule import Schedule
from autopar.schedules.simulator import Cost, dry_run

__all__ = ["lower"]


def lower(schedule: Schedule, cost_f: Cost = 1, cost_b: Cost | None = None, cost_w: Cost | None = None, *,
          check: bool = True) -> Schedule:
    """Add the sends and receives that carry every cross-stage dependency.

    A forward-only schedule gets its SF and RF actions the same way (it has no
    B to send gradients for). A W needs only its own stage's B: no message.

    Sends: right after the compute that produced the tensor (``SF c.i >
    s(c+1)`` after ``F(c, i)``, ``SB c.i > s(c-1)`` after ``B(c, i)``, where
    ``s`` is the schedule's placement). A neighbour on the same stage (when
    ``p == 1``, or at the turn of ZB-V's V) needs no message.

    Receives: the runtime posts a run of consecutive sends/receives as one
    batched exchange, so a receive goes into the gap (between two compute
    actions) its stage is in when the producer finishes, in a dry run of the
    compute-only schedule with the given costs: the first gap ``j`` with
    ``start(j) >= T``, ``T`` the producer's end. That is never after the gap
    just before the consumer (where it lands in most cases); when it is
    earlier, the tensor waits in a buffer, as in Megatron-LM's lock-step
    exchanges (interleaved 1F1B, GPipe with ``m > p`` chunks).

    With ``t_f = t_b`` (the default costs) every producer of the three
    generators finishes on a gap of its receiver, and the lowered schedule
    times exactly like the compute-only one. Where the receiver is busy at
    ``T`` and each batch is waited for whole (``dry_run``, ``batched`` sends),
    the sender waits: with ``t_b = 2 t_f`` GPipe and 1F1B still keep their
    timing, but interleaved 1F1B loses bubble (p=2, v=2, m=4: 7/24 instead of
    1/8), the price of waiting on each exchange at once. (autopar's runtime
    does not wait for its sends, ``posted`` sends, and keeps the bubble.)

    ``cost_b`` (whole backward) and ``cost_w`` (its W part) as in the
    simulator; the default ``cost_b`` makes every compute action cost
    ``cost_f`` (F = B = W when split), with which the zero-bubble schedules
    also keep their compute-only timing (tested). The result is validated, unless ``check`` is False
    (a caller that validates what it keeps itself, as the compiler does).
    """
    if schedule.is_lowered:
        raise ScheduleError(
            f"schedule {schedule.name!r} is already lowered (it has sends and receives)"
        )
    if cost_b is None:
        cost_b = _unit_backward(schedule, cost_f)
    run = dry_run(schedule, cost_f, cost_b, cost_w)
    where = index(schedule)
    slots = {s: [[] for _ in range(len(acts) + 1)] for s, acts in schedule.actions.items()}
    for s, acts in schedule.actions.items():
        for t, a in enumerate(acts):
            slots[s][t + 1] += _sends(schedule, s, a)
    for s, acts in schedule.actions.items():
        for t, a in enumerate(acts):
            for recv, (ps, pt) in _receives(schedule, s, a, where):
                ready = run.end[ps][pt]
                slots[s][bisect_left(run.start[s], ready, hi=t)].append(recv)
    actions = {s: _interleave_slots(slots[s], acts) for s, acts in schedule.actions.items()}
    lowered = dataclasses.replace(schedule, actions=actions)
    if check:
        validation.validate(lowered)
    return lowered


def _unit_backward(schedule: Schedule, cost_f: Cost) -> Cost:
    """The whole backward's cost that makes B (and W) cost as much as F."""
    if not schedule.splits_backward:
        return cost_f
    return (lambda a: 2 * cost_f(a)) if callable(cost_f) else 2 * cost_f


def _sends(schedule: Schedule, stage: int, action: Action) -> list[Action]:
    """The send shipping ``action``'s result to a neighbour on another stage, if any (a W has none)."""
    if action.kind is Kind.W:
        return []
    target = action.chunk + 1 if action.kind is Kind.F else action.chunk - 1
    if not 0 <= target < schedule.num_chunks or schedule.stage_of(target) == stage:
        return []
    kind = Kind.SEND_F if action.kind is Kind.F else Kind.SEND_B
    return [Action(kind, action.chunk, action.microbatch, schedule.stage_of(target))]


def _receives(
    schedule: Schedule, stage: int, action: Action, where: dict[Key, Loc]
) -> list[tuple[Action, Loc]]:
    """The receive ``action`` needs from another stage, if any, with its producer's location
    (a W's producer, its B, is always local)."""
    kind = Kind.RECV_F if action.kind is Kind.F else Kind.RECV_B
    return [
        (Action(kind, action.chunk, action.microbatch, schedule.stage_of(key[1])), where[key])
        for key in producers(schedule, action)
        if schedule.stage_of(key[1]) != stage
    ]


def _interleave_slots(slots: list[list[Action]], compute: list[Action]) -> list[Action]:
    """``slots[0], compute[0], slots[1], compute[1], .., slots[n]`` flattened."""
    out = list(slots[0])
    for a, gap in zip(compute, slots[1:], strict=True):
        out += [a, *gap]
    return out
