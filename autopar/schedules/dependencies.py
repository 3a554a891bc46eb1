"""Who needs whom in a schedule: the producers of an F, B or W, the partner of a send or
receive, and where each action sits.

    F(c, i)  needs  F(c-1, i)                      (c > 0)
    B(c, i)  needs  F(c, i)  and  B(c+1, i)        (the last chunk's B needs only its F)
    W(c, i)  needs  B(c, i)                        (on its own stage: W sends nothing)

In a schedule that splits its backwards, B(c+1, i) is the input gradient only,
which is all B(c, i) needs: the gradient of chunk c's output.
    SF c.i  <->  RF c+1.i        SB c.i  <->  RB c-1.i
"""

from __future__ import annotations

from autopar.schedules.actions import Action, Key, Kind, Loc
from autopar.schedules.errors import ScheduleError
from autopar.schedules.schedule import Schedule, schedule_error

__all__ = ["producers", "partner", "partner_key", "index", "result_sent", "PARTNER"]

PARTNER: dict[Kind, tuple[Kind, int]] = {
    Kind.SEND_F: (Kind.RECV_F, +1),
    Kind.RECV_F: (Kind.SEND_F, -1),
    Kind.SEND_B: (Kind.RECV_B, -1),
    Kind.RECV_B: (Kind.SEND_B, +1),
}
"""kind -> (partner kind, chunk offset of the partner); SF c <-> RF c+1, SB c <-> RB c-1."""


def producers(schedule: Schedule, action: Action) -> list[Key]:
    """Compute actions whose results ``action`` (F, B or W) consumes."""
    c, i = action.chunk, action.microbatch
    if action.kind is Kind.F:
        return [(Kind.F, c - 1, i)] if c > 0 else []
    if action.kind is Kind.W:
        return [(Kind.B, c, i)]
    deps: list[Key] = [(Kind.F, c, i)]
    if c < schedule.num_chunks - 1:
        deps.append((Kind.B, c + 1, i))
    return deps


def partner(schedule: Schedule, action: Action) -> tuple[Key, int]:
    """The matching action of a send/receive and the stage it must be on."""
    key = partner_key(action)
    return key, schedule.stage_of(key[1])


def partner_key(action: Action) -> Key:
    """The key of the matching action of a send/receive (``partner`` without its stage)."""
    kind, offset = PARTNER[action.kind]
    return kind, action.chunk + offset, action.microbatch


def result_sent(action: Action) -> Action:
    """The compute action whose result a send or receive carries: ``SF c.i`` and
    ``RF c+1.i`` carry F(c, i)'s output, ``SB c.i`` and ``RB c-1.i`` B(c, i)'s input gradient."""
    if action.kind is Kind.SEND_F or action.kind is Kind.SEND_B:
        return Action(Kind.F if action.kind is Kind.SEND_F else Kind.B, action.chunk, action.microbatch)
    if action.kind is Kind.RECV_F:
        return Action(Kind.F, action.chunk - 1, action.microbatch)
    if action.kind is Kind.RECV_B:
        return Action(Kind.B, action.chunk + 1, action.microbatch)
    raise ScheduleError(f"{action} is not a send or receive")


def index(schedule: Schedule) -> dict[Key, Loc]:
    """Where each action sits; raises on duplicates."""
    where = {(a.kind, a.chunk, a.microbatch): (s, t)
             for s, acts in schedule.actions.items() for t, a in enumerate(acts)}
    if len(where) < sum(len(acts) for acts in schedule.actions.values()):
        _raise_first_repeat(schedule)
    return where


def _raise_first_repeat(schedule: Schedule) -> None:
    """Raise for the first action, in stage order, that appears twice, naming both places."""
    seen: dict[Key, Loc] = {}
    for s, acts in schedule.actions.items():
        for t, a in enumerate(acts):
            key = (a.kind, a.chunk, a.microbatch)  # a.key, without a property call per action
            if key in seen:
                raise schedule_error(
                    schedule,
                    f"{a.kind.value}{a.chunk}.{a.microbatch} appears twice",
                    [seen[key], (s, t)],
                )
            seen[key] = (s, t)
