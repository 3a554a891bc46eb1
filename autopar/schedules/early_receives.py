"""``receives_early``: each receive of a lowered schedule posted as early as the exchanges allow.

``lower`` puts a receive in the gap its stage is in when the producer
finishes (in a dry run with the lowering's costs), which is usually the gap
right before the consumer. A transfer starts only once both sides have posted
(gloo sends the data when the receiver asks for it: measured on two local
ranks, a 1 MiB message sent 30 ms earlier took 1.8 ms to arrive after a late
receive and 0.03 ms after an early one), so a message whose send went out
during the compute before that gap travels after the compute, while the
consumer waits. Posted earlier, the receive is in flight during that compute
and the message lands in its buffer.

How early is safe is decided under the strictest way of running a schedule,
``batched`` exchanges (``simulator.Sends``; NCCL's coalesced batches): a run
of sends and receives is one batch that its stage posts and then waits for
whole, so a batch finishes only once every partner has posted its side. A
receive may join batch ``k`` of its stage when the post of its partner's send
does not depend, through the stages' orders and their exchanges, on the end of
batch ``k`` or anything after it; else it would wait for itself. Each event's
dependencies on a stage are a prefix of that stage's order, so one vector
clock per event (the latest event of each stage it depends on), from one sweep
over the lowered schedule, answers this for every receive at once.

Two moves can together close a cycle (in 1F1B, stage 0's receive of a
gradient and stage 1's receive of an activation, each moved before the send
the other waits for). A second sweep runs the moved schedule; where it stops,
in batches that wait for each other, the waiting moves of the batch on the
lowest stage go back to where ``lower`` put them (a later gap of a stage that
has not reached it, so nothing swept is touched) and the sweep goes on. The
later stages keep their early receives: their producers run ahead of them in
the forward. The result is validated (``validate``) like any lowered schedule.

Early receives pay where each receive is waited for alone (gloo: the
runtime waits for a receive's own works at its consumer). Under batched
exchanges an early receive holds its whole batch until the partner sends.
"""

from __future__ import annotations

import dataclasses

import numpy as np

import autopar.schedules.validation as validation
from autopar.schedules.actions import Action, Key
from autopar.schedules.dependencies import partner
from autopar.schedules.errors import ScheduleError
from autopar.schedules.schedule import Schedule

__all__ = ["receives_early"]

Gaps = dict[int, list[list[Action]]]
"""Stage -> its exchanges cut into gaps: gap j holds the sends and receives posted right before its
j-th compute action (the last gap: after its last one)."""


def receives_early(schedule: Schedule) -> Schedule:
    """``schedule`` (lowered) with every receive moved to the earliest batch of its stage it can join
    without a deadlock under batched exchanges; validated. A single stage's schedule (nothing to
    receive) is returned as it is."""
    if schedule.p == 1:
        return schedule
    if not schedule.is_lowered:
        raise ScheduleError(f"schedule {schedule.name!r} has no sends or receives: lower it first")
    gaps, compute = _gaps(schedule)
    home = {a.key: (s, j) for s, stage in gaps.items() for j, gap in enumerate(stage) for a in gap}
    receives = [a for stage in gaps.values() for gap in stage for a in gap if a.is_recv]
    posts = _Sweep(schedule, gaps, home, {}).run()
    moved = {}
    for a in receives:
        s, j = home[a.key]
        k = _earliest_gap(posts, home[partner(schedule, a)[0]], s)
        if k < j:
            moved[a.key] = k
    placed = {s: [[] for _ in stage] for s, stage in gaps.items()}
    for a in (a for stage in gaps.values() for gap in stage for a in gap):  # sends first in a gap
        s, j = home[a.key]
        placed[s][moved.get(a.key, j)].append(a)
    _Sweep(schedule, placed, home, moved).run()
    actions = {s: _flatten(placed[s], compute[s]) for s in schedule.actions}
    early = dataclasses.replace(schedule, actions=actions)
    validation.validate(early)
    return early


def _gaps(schedule: Schedule) -> tuple[Gaps, dict[int, list[Action]]]:
    """Each stage's exchanges by gap, and its compute actions in order."""
    gaps, compute = {}, {}
    for s, acts in schedule.actions.items():
        stage, work = [[]], []
        for a in acts:
            if a.is_comm:
                stage[-1].append(a)
            else:
                work.append(a)
                stage.append([])
        gaps[s], compute[s] = stage, work
    return gaps, compute


def _flatten(gaps: list[list[Action]], compute: list[Action]) -> list[Action]:
    out = list(gaps[0])
    for a, gap in zip(compute, gaps[1:], strict=True):
        out += [a, *gap]
    return out


def _earliest_gap(posts: dict[int, list[np.ndarray]], send: tuple[int, int], stage: int) -> int:
    """The first gap of ``stage`` a receive of the send in gap ``send`` = (its stage, its gap) can join:
    after the latest event of ``stage`` that the send's post depends on, or in that event's own gap
    when it is the gap's post (the send it needs then goes out in the same batch as the receive)."""
    latest = int(posts[send[0]][send[1]][stage])
    if latest < 0:
        return 0
    j, event = divmod(latest, 3)
    return j if event == 0 else j + 1


class _Sweep:
    """The schedule run under batched exchanges, recording each gap's post as a vector clock.

    Events of a stage, in its order: gap j posted (``3j``), gap j's batch finished (``3j + 1``),
    compute j (``3j + 2``). A clock holds, per stage, the latest of its events the event depends on
    (-1: none). When every stage waits, the waiting moved receives (``moved``: key -> its gap) of the
    lowest such stage go back to their gap in ``home``; with none to move back, the schedule
    deadlocks as it was lowered."""

    def __init__(self, schedule: Schedule, gaps: Gaps, home: dict[Key, tuple[int, int]],
                 moved: dict[Key, int]) -> None:
        self.schedule, self.gaps, self.home, self.moved = schedule, gaps, home, moved
        self.where = {a.key: (s, j) for s, stage in gaps.items() for j, gap in enumerate(stage) for a in gap}
        self.order = {a.key: t for acts in schedule.actions.values() for t, a in enumerate(acts)}
        """Each action's place in its stage's lowered list: a receive moved back goes to its place."""
        self.posts: dict[int, list[np.ndarray]] = {s: [] for s in gaps}
        self.done: dict[int, np.ndarray | None] = {s: np.full(len(gaps), -1, dtype=np.int64) for s in gaps}
        """Stage -> the clock after its last posted gap finished and the compute after it ran; None
        while that gap's batch waits for a partner."""

    def run(self) -> dict[int, list[np.ndarray]]:
        """Stage -> the clock of each gap's post."""
        while True:
            progress = True
            while progress:
                progress = any([self._advance(s) for s in self.gaps])
            waiting = sorted(s for s in self.gaps if self.done[s] is None)
            if not waiting:
                return self.posts
            self._move_back(waiting)

    def _advance(self, s: int) -> bool:
        """Run stage ``s`` until it waits or ends; whether it got anywhere."""
        stage, moved = self.gaps[s], False
        while True:
            j = len(self.posts[s])
            if self.done[s] is None:  # gap j - 1 posted: it finishes once every partner has posted
                partners = self._partners(s, j - 1)
                if any(len(self.posts[q]) <= k for q, k in partners):
                    return moved
                clock = self.posts[s][j - 1].copy()
                for q, k in partners:
                    np.maximum(clock, self.posts[q][k], out=clock)
                clock[s] = 3 * (j - 1) + 2  # the compute after the gap follows its end
                self.done[s], moved = clock, True
            if j == len(stage):
                return moved
            clock = self.done[s].copy()
            clock[s] = 3 * j
            self.posts[s].append(clock)
            self.done[s], moved = None, True

    def _partners(self, s: int, j: int) -> list[tuple[int, int]]:
        return [self.where[partner(self.schedule, a)[0]] for a in self.gaps[s][j]]

    def _move_back(self, waiting: list[int]) -> None:
        for s in waiting:
            j = len(self.posts[s]) - 1
            back = [a for a in self.gaps[s][j]
                    if a.key in self.moved and not self._posted(partner(self.schedule, a)[0])]
            if back:
                for a in back:
                    home = self.home[a.key][1]
                    self.gaps[s][j].remove(a)
                    self.gaps[s][home] = sorted([*self.gaps[s][home], a], key=lambda x: self.order[x.key])
                    self.where[a.key] = (s, home)
                    del self.moved[a.key]
                return
        raise ScheduleError(f"schedule {self.schedule.name!r} deadlocks under batched exchanges: stages "
                            f"{waiting} wait for each other (validate it)")

    def _posted(self, key: Key) -> bool:
        q, k = self.where[key]
        return len(self.posts[q]) > k
