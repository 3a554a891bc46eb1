"""The schedule simulator: a schedule and the cost of each action in, a timeline out.

Every stage runs its action list in order, each action as early as what it
needs allows: an F or B lasts ``cost_f(action)`` / ``cost_b(action)`` and
starts when its stage is free and its inputs have arrived. ``cost_b`` is the
whole backward; in a schedule that splits its backwards (W actions) a W lasts
``cost_w(action)`` and its B the rest, ``cost_b - cost_w`` (by default half
each: with F = 1 and backward = 2, F = B = W = 1 as in Qi et al.). A W waits
for its B only and sends nothing. What differs
between a dry run, autopar's runtime and Megatron-LM is how a stage's sends
behave; that is the parameter ``sends`` (:class:`Sends`):

``batched`` (:func:`dry_run`, :func:`~autopar.schedules.validate`)
    A maximal run of sends/receives is one batch (``batch_isend_irecv``) that
    the stage posts and then waits on whole. A send/receive pair completes the
    moment both sides are posted (transfers take no time), so a send blocks
    until its receive is posted, as with NCCL; a stage that can never post
    its side is a deadlock. In a compute-only schedule an F or B waits for its
    producers directly.
``posted`` (autopar's runtime, a lowered schedule)
    Sends and receives are posted without blocking when the stage reaches
    them (sends are waited for only at the end of the step); a message arrives
    ``comm(a)`` after both sides are posted (``a``: the F or B whose result
    travels). An F or B that needs a received tensor waits for its arrival:
    a ``wait`` event while the partner has not posted, a ``comm`` event while
    the message travels.
``eager`` (the planner's model of Megatron-LM 2021, a compute-only schedule)
    The producer sends its result right after computing it and is blocked
    for ``comm(a)`` (synchronous point-to-point: nothing overlaps it); the
    consumer can use it at ``end + comm``. A send never waits for its
    receiver, so a valid schedule never deadlocks.

Without transfer time the three agree: a compute-only schedule's step is
the same in each, and a lowered schedule run ``posted`` reaches its
compute-only form's dry run (tested). With uniform costs ``t_f, t_b`` 1F1B
takes ``(m + p - 1)(t_f + t_b)``, a bubble of ``(p-1)/m``; interleaved
1F1B's is ``(p-1)/(v m)``; ZB-H1's idle time is ``(p-1)(t_f + t_b - 2 t_w)``
(``t_b`` the whole backward, ``t_w <= t_f``) and ZB-V's ``(p-1) t_f``
(per-chunk costs, F = B = W) once ``m >= (3p - 1) / 2``. Integer or :class:`~fractions.Fraction` costs give
exact times and (through :class:`DryRun`) exact bubbles.

Stages run until blocked on another stage and are woken when it moves (a
work list), so a run costs time linear in the schedule's length.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from enum import Enum
from fractions import Fraction

from autopar.schedules.actions import Action, Key, Kind, Loc, Time
from autopar.schedules.checks import check_coverage, check_matching, check_placement
from autopar.schedules.dependencies import index, partner_key, producers
from autopar.schedules.events import Event
from autopar.schedules.in_flight import peak_in_flight
from autopar.schedules.errors import ScheduleError
from autopar.schedules.schedule import Schedule, schedule_error

__all__ = ["Sends", "Cost", "SimResult", "simulate", "simulate_checked", "DryRun", "dry_run", "check_deadlock"]

Cost = Time | Callable[[Action], Time]
"""A duration for every action, or a function of the action (e.g. per-chunk costs)."""
_ComputeCosts = tuple[Callable[[Action], Time], Callable[[Action], Time], Callable[[Action], Time]]
"""(forward, whole backward, weight-gradient part) durations of an action."""


class Sends(str, Enum):
    """How a stage's sends behave (see the module's docstring)."""

    BATCHED = "batched"
    """Each run of sends/receives is one batch, waited for whole; transfers take no time."""
    POSTED = "posted"
    """Non-blocking sends and receives; only the consumer of a received tensor waits for it."""
    EAGER = "eager"
    """Implicit sends right after the compute, blocking the sender for the transfer."""

    def __str__(self) -> str:
        return self.value


@dataclass(frozen=True)
class SimResult:
    """The timeline of one simulated step."""

    schedule: Schedule
    sends: Sends
    """How the sends behaved."""
    events: dict[int, list[Event]]
    """Stage -> its events in execution order."""
    start: dict[int, list[Time]]
    """Stage -> start time of each of its actions (same order as the schedule); a batch of
    sends/receives starts when it is posted."""
    end: dict[int, list[Time]]
    """Stage -> end time of each action (an F or B's end excludes an eager send after it)."""
    step_time: Time
    """When the last action ends."""
    busy: dict[int, Time]
    """Stage -> compute time."""
    comm: dict[int, Time]
    """Stage -> time it spent transferring (a blocking send, or waiting for a message in transit)."""

    @property
    def lowered(self) -> bool:
        """True when the schedule ran with its explicit sends and receives."""
        return self.schedule.is_lowered

    @property
    def idle(self) -> dict[int, Time]:
        """Stage -> time neither computing nor transferring (waiting on a partner included)."""
        return {s: self.step_time - self.busy[s] - self.comm[s] for s in self.busy}

    @property
    def bubble_per_stage(self) -> dict[int, Time]:
        """Stage -> idle / compute."""
        return {s: self.idle[s] / self.busy[s] for s in self.busy}

    @property
    def bubble(self) -> Time:
        """The largest per-stage bubble fraction; (p-1)/(v m) for uniform costs."""
        return max(self.bubble_per_stage.values())

    @property
    def peak_in_flight(self) -> dict[int, int]:
        """Stage -> most (chunk, microbatch) activations held at once."""
        return peak_in_flight(self.schedule)


def _as_cost(cost: Cost) -> Callable[[Action], Time]:
    return cost if callable(cost) else (lambda _a: cost)


def _half(x: Time) -> Time:
    """``x / 2``, exact for ints (an int when even, else a Fraction)."""
    if isinstance(x, int):
        return x // 2 if x % 2 == 0 else Fraction(x, 2)
    return x / 2


def compute_costs(cost_f: Cost, cost_b: Cost, cost_w: Cost | None) -> _ComputeCosts:
    """(forward, whole backward, weight-gradient part) as functions of the action;
    ``cost_w`` None: half the backward (the paper's T_B = T_W)."""
    backward = _as_cost(cost_b)
    weight = (lambda a: _half(backward(a))) if cost_w is None else _as_cost(cost_w)
    return _as_cost(cost_f), backward, weight


def simulate(schedule: Schedule, cost_f: Cost = 1, cost_b: Cost = 2, comm: Cost = 0, *,
             sends: Sends | str, cost_w: Cost | None = None) -> SimResult:
    """Run ``schedule`` with sends that behave as ``sends`` says; the timeline of the step.

    ``cost_f`` / ``cost_b``: the duration of every F / whole backward, or a
    function of the action. ``cost_w``: the weight-gradient part of a
    backward, used by a schedule that splits its backwards (W lasts ``cost_w``,
    B ``cost_b - cost_w``; None: half the backward each); a schedule without W
    ignores it. ``comm``: the transfer time of one stage-to-stage message, or a
    function of the F or B whose result it carries (``batched`` sends take no
    time). ``eager`` needs a compute-only schedule, ``posted`` a lowered one
    (for p > 1). Raises :class:`ScheduleError` (a ValueError) if the schedule
    misplaces or misses actions, has an unmatched send or receive, or
    deadlocks.
    """
    sends = Sends(sends)
    if sends is Sends.EAGER and schedule.is_lowered:
        raise ScheduleError(f"schedule {schedule.name!r} is lowered: eager sends are implicit, so give its "
                         "compute-only form, or use sends='posted' to run its sends and receives")
    if sends is Sends.POSTED and not schedule.is_lowered and schedule.p > 1:
        raise ScheduleError(f"schedule {schedule.name!r} has no sends/receives: lower it first, "
                         "or use sends='eager'")
    if sends is Sends.BATCHED and (callable(comm) or comm != 0):
        raise ScheduleError("batched exchanges take no transfer time (a dry run); "
                         "use sends='posted' or 'eager' to time transfers")
    return simulate_checked(schedule, _checked_index(schedule), cost_f, cost_b, comm, sends, cost_w)


def _checked_index(schedule: Schedule) -> dict[Key, Loc]:
    """The placement, coverage and matching checks a simulation needs; the schedule's ``index``."""
    check_placement(schedule)
    where = index(schedule)
    check_coverage(schedule, where)
    check_matching(schedule, where)
    return where


def simulate_checked(schedule: Schedule, where: dict[Key, Loc], cost_f: Cost, cost_b: Cost, comm: Cost,
                     sends: Sends, cost_w: Cost | None = None) -> SimResult:
    """:func:`simulate` for a schedule that already passed the placement, coverage and
    matching checks; ``where`` is its ``dependencies.index``."""
    costs = compute_costs(cost_f, cost_b, cost_w)
    return _Run(schedule, costs, _as_cost(comm), sends, where).result()


def check_deadlock(schedule: Schedule, where: dict[Key, Loc]) -> None:
    """A ``batched`` dry run of a schedule that passed the placement, coverage and matching checks
    (``where``: its ``dependencies.index``) finishes; a deadlock raises :class:`ScheduleError`
    naming what each blocked stage waits for."""
    _Run(schedule, None, _as_cost(0), Sends.BATCHED, where).run()


def _untimed(_s: int, _u: int) -> tuple[Time, Time, Time]:
    """The step of an untimed run: no start, end or free time."""
    return 0, 0, 0


def _units(actions: list[Action]) -> list[tuple[int, int]]:
    """Split a stage's list into units: one compute action, or a maximal run of sends/receives."""
    units, t, n = [], 0, len(actions)
    while t < n:
        end = t + 1
        if actions[t].peer is not None:  # a send or receive (``Action.is_comm``)
            while end < n and actions[end].peer is not None:
                end += 1
        units.append((t, end))
        t = end
    return units


_Need = tuple[int, int, Loc]
"""(stage, pc, where): a unit may run once that stage's pc >= pc. A producer must be done
(pc past its unit), a partner's send or receive only posted (pc at its unit)."""


class _Run:
    """One simulation. Each stage's list is cut into units (one F or B, or a batch of
    sends/receives); ``needs[s][u]`` says which units of other stages unit ``u`` of stage
    ``s`` waits for, and the step method of the ``sends`` mode times a unit once they ran."""

    def __init__(self, schedule: Schedule, costs: _ComputeCosts | None, comm: Callable[[Action], Time],
                 sends: Sends, where: dict[Key, Loc], events: bool = True) -> None:
        self.schedule, self.comm, self.sends, self.where = schedule, comm, sends, where
        self.timed = costs is not None
        """False: only whether every stage reaches its end (a stage waits for what another stage has
        posted or done, never for a time, so a deadlock does not depend on the durations)."""
        self.record = events and self.timed
        """Keep each stage's events; off only for a ``batched`` run, a dry run needing the times alone (the
        ``posted`` and ``eager`` steps always keep theirs)."""
        self.posted = sends is Sends.POSTED
        self.units = {s: _units(acts) for s, acts in schedule.actions.items()}
        self.unit_of = {s: [u for u, (a, b) in enumerate(us) for _ in range(a, b)] for s, us in self.units.items()}
        """Stage -> the unit of each of its actions."""
        # posted: (stage, unit) of an F or B that consumes a received tensor -> (the unit of its
        # receive, stage and unit of the matching send, the F or B whose result travels)
        self.received: dict[tuple[int, int], tuple[int, int, int, Action]] = {}
        self.needs = {s: [self._needs(s, a, b) for a, b in us] for s, us in self.units.items()}
        # per unit: its first action, and for an F or B its duration and event kind
        self.first = {s: [schedule.actions[s][a] for a, _ in us] for s, us in self.units.items()} if self.timed else {}
        split = schedule.splits_backward
        self.work = {s: [_work(x, costs, split) for x in xs] for s, xs in self.first.items()}
        stages = list(schedule.actions)
        self.pc = dict.fromkeys(stages, 0)
        self.free: dict[int, Time] = dict.fromkeys(stages, 0)
        self.unit_start: dict[int, list[Time]] = {s: [0] * len(us) for s, us in self.units.items()}
        self.unit_end: dict[int, list[Time]] = {s: [0] * len(us) for s, us in self.units.items()}
        self.sent: dict[int, list[Time]] = {s: [0] * len(us) for s, us in self.units.items()}
        """eager: when each unit's result reached the consumer's stage."""
        self.busy: dict[int, Time] = dict.fromkeys(stages, 0)
        self.transfer: dict[int, Time] = dict.fromkeys(stages, 0)
        self.events: dict[int, list[Event]] = {s: [] for s in stages}

    # ------------------------------------------------------------------ needs

    def _needs(self, s: int, a: int, b: int) -> list[_Need]:
        acts, stage_of, unit_of = self.schedule.actions[s], self.schedule.stage_of, self.unit_of
        if acts[a].is_comm:
            if self.posted:
                return []  # posting never waits
            locs = [self.where[partner_key(x)] for x in acts[a:b]]
            return [(loc[0], unit_of[loc[0]][loc[1]], loc) for loc in locs]
        action = acts[a]
        keys = producers(self.schedule, action)
        if not self.posted:
            locs = [self.where[k] for k in keys]
            return [(loc[0], unit_of[loc[0]][loc[1]] + 1, loc) for loc in locs]  # each done: ``_done``
        needs = [self._done(self.where[k]) for k in keys if stage_of(k[1]) == s]
        remote = [k for k in keys if stage_of(k[1]) != s]
        if remote:
            recv_key = (Kind.RECV_F if action.kind is Kind.F else Kind.RECV_B, action.chunk, action.microbatch)
            recv = self.where.get(recv_key)
            if recv is None:
                raise schedule_error(self.schedule, f"{action} on stage {s} needs {recv_key[0].value}"
                                     f"{action.chunk}.{action.microbatch} before it, and there is none", [(s, a)])
            send = self.where[partner_key(self.schedule.actions[s][recv[1]])]
            self.received[(s, unit_of[s][a])] = (unit_of[s][recv[1]], send[0], unit_of[send[0]][send[1]],
                                                 Action(*remote[0]))
            needs += [self._done(recv), (send[0], unit_of[send[0]][send[1]], send)]
        return needs

    def _done(self, loc: Loc) -> _Need:
        return (loc[0], self.unit_of[loc[0]][loc[1]] + 1, loc)

    def blockers(self, s: int) -> list[_Need]:
        """The needs that keep stage ``s`` from running its current unit."""
        return [n for n in self.needs[s][self.pc[s]] if self.pc[n[0]] < n[1]]

    # ------------------------------------------------------------------ timing, one unit per mode
    # A step method times unit u of stage s (its needs have run; the stage is free at
    # ``self.free[s]``), records its events, and returns (start, end, when the stage is free).

    def _compute(self, s: int, u: int, start: Time) -> Time:
        """Run the F, B or W of unit ``u`` from ``start``; its end."""
        dur, kind = self.work[s][u]
        end = start + dur
        self.busy[s] += dur
        if self.record:
            self.events[s].append(Event(s, kind, str(self.first[s][u]), start, end))
        return end

    def _step_batched(self, s: int, u: int) -> tuple[Time, Time, Time]:
        """An F or B starts when its producers have ended; a batch of sends/receives waits
        until every partner has posted its side."""
        t0 = self.free[s]
        needs = self.needs[s][u]
        if self.work[s][u] is None:
            t1 = max([t0] + [self.unit_start[ns][npc] for ns, npc, _ in needs])
            if t1 > t0 and self.record:
                a, b = self.units[s][u]
                self.events[s].append(Event(s, "wait", " ".join(map(str, self.schedule.actions[s][a:b])), t0, t1))
            return t0, t1, t1
        start = max([t0] + [self.unit_end[ns][npc - 1] for ns, npc, _ in needs])
        end = self._compute(s, u, start)
        return start, end, end

    def _step_posted(self, s: int, u: int) -> tuple[Time, Time, Time]:
        """A batch of sends/receives is posted and the stage goes on; an F or B that consumes
        a received tensor waits for its arrival, ``comm`` after both sides were posted."""
        t0 = self.free[s]
        if self.work[s][u] is None:
            return t0, t0, t0
        start = t0
        got = self.received.get((s, u))
        if got is not None:
            recv_u, send_s, send_u, produced = got
            met = max(self.unit_start[send_s][send_u], self.unit_start[s][recv_u])
            ready = met + self.comm(produced)
            if ready > t0:
                name = ("RF" if self.work[s][u][1] == "F" else "RB") + str(self.first[s][u])[1:]
                if met > t0:
                    self.events[s].append(Event(s, "wait", name, t0, met))
                if ready > max(t0, met):
                    self.events[s].append(Event(s, "comm", name, max(t0, met), ready))
                    self.transfer[s] += ready - max(t0, met)
                start = ready
        end = self._compute(s, u, start)
        return start, end, end

    def _step_eager(self, s: int, u: int) -> tuple[Time, Time, Time]:
        """An F or B starts when its inputs arrived (a producer's end on its own stage, the end
        of its send on another); the stage then sends the result, blocked for ``comm``."""
        start = self.free[s]
        for ns, npc, _ in self.needs[s][u]:
            start = max(start, self.unit_end[ns][npc - 1] if ns == s else self.sent[ns][npc - 1])
        end = self._compute(s, u, start)
        action = self.first[s][u]
        fwd = action.kind is Kind.F
        target = action.chunk + 1 if fwd else action.chunk - 1
        sent = end
        if action.kind is not Kind.W and 0 <= target < self.schedule.num_chunks \
                and self.schedule.stage_of(target) != s:
            x = self.comm(action)
            sent = end + x
            if x > 0:
                self.transfer[s] += x
                name = f"{'SF' if fwd else 'SB'}{action.chunk}.{action.microbatch}>{self.schedule.stage_of(target)}"
                self.events[s].append(Event(s, "comm", name, end, sent))
        self.sent[s][u] = sent
        return start, end, sent

    # ------------------------------------------------------------------ run

    def result(self) -> SimResult:
        """Run every stage to its end (``run``); the timeline."""
        start, end = self.times()
        return SimResult(self.schedule, self.sends, self.events, start, end, max(self.free.values(), default=0),
                         self.busy, self.transfer)

    def times(self) -> tuple[dict[int, list[Time]], dict[int, list[Time]]]:
        """Run every stage to its end (``run``); per stage, the start and end of each action."""
        self.run()
        return self._per_action(self.unit_start), self._per_action(self.unit_end)

    def run(self) -> None:
        """Run every stage to its end; raise ScheduleError on a deadlock.

        A stage runs until its current unit waits for another stage, and is put back on
        the work list when that stage moves."""
        pc, free = self.pc, self.free
        # a local: a bound method kept on self is a cycle
        step = {Sends.BATCHED: self._step_batched, Sends.POSTED: self._step_posted,
                Sends.EAGER: self._step_eager}[self.sends] if self.timed else _untimed
        waiting: dict[int, list[int]] = {s: [] for s in self.schedule.actions}
        ready = list(self.schedule.actions)
        while ready:
            s = ready.pop()
            needs, n_units = self.needs[s], len(self.units[s])
            unit_start, unit_end = self.unit_start[s], self.unit_end[s]
            while (u := pc[s]) < n_units:
                blocker = -1
                for ns, npc, _ in needs[u]:
                    if pc[ns] < npc:
                        blocker = ns
                        break
                if blocker >= 0:
                    waiting[blocker].append(s)
                    break
                unit_start[u], unit_end[u], free[s] = step(s, u)
                pc[s] = u + 1
                if u + 1 < n_units:
                    unit_start[u + 1] = free[s]  # posted now, if it is a batch of sends/receives
                if waiting[s]:
                    ready += waiting[s]
                    waiting[s] = []
        stuck = [s for s in self.schedule.actions if pc[s] < len(self.units[s])]
        if stuck:
            raise self.deadlock(stuck)

    def _per_action(self, per_unit: dict[int, list[Time]]) -> dict[int, list[Time]]:
        """Per stage, the time of each action's unit (a batch of sends/receives shares one)."""
        out = {}
        for s, us in self.units.items():
            if len(us) == len(self.schedule.actions[s]):  # one action per unit
                out[s] = list(per_unit[s])
            else:
                out[s] = [per_unit[s][u] for u, (a, b) in enumerate(us) for _ in range(a, b)]
        return out

    def deadlock(self, stuck: list[int]) -> ScheduleError:
        """Explain what each blocked stage waits for."""
        lines, marks = [], []
        acts_of = self.schedule.actions
        for s in stuck:
            a, b = self.units[s][self.pc[s]]
            marks += [(s, t) for t in range(a, b)]
            finish, posted = [], []
            for _, npc, (ws, wt) in self.blockers(s):
                text = f"{acts_of[ws][wt]} (stage {ws} step {wt})"
                (finish if npc > self.unit_of[ws][wt] else posted).append(text)
            waits = " and ".join(f"{', '.join(items)} to {verb}"
                                 for items, verb in ((finish, "finish"), (posted, "be posted")) if items)
            if acts_of[s][a].is_compute:
                lines.append(f"  stage {s} waits at {acts_of[s][a]} for {waits}")
            else:
                lines.append(f"  stage {s} waits in exchange [{' '.join(map(str, acts_of[s][a:b]))}] for {waits}")
        return schedule_error(self.schedule, "deadlock: no stage can make progress\n" + "\n".join(lines), marks)


_KIND_TEXT = {k: k.value for k in Kind}
"""A kind's text code (``Kind.value`` without an enum property call per action)."""


def _work(action: Action, costs: _ComputeCosts, split: bool) -> tuple[Time, str] | None:
    """(duration, event kind) of an F, B or W; None for a send or receive (the event's name is the
    action's text).

    ``split``: the schedule splits its backwards, so a B is the backward less its W."""
    if action.peer is not None:  # a send or receive (``Action.is_comm``)
        return None
    cost_f, cost_b, cost_w = costs
    if action.kind is Kind.F:
        duration = cost_f(action)
    elif action.kind is Kind.W:
        duration = cost_w(action)
    else:
        duration = cost_b(action) - cost_w(action) if split else cost_b(action)
    if duration < 0:
        raise ScheduleError(f"{action} would last {duration}: the weight-gradient cost {cost_w(action)} exceeds the "
                         f"whole backward's {cost_b(action)}; give cost_w <= cost_b")
    return duration, _KIND_TEXT[action.kind]


# ---------------------------------------------------------------------------- dry run


@dataclass(frozen=True)
class DryRun:
    """Timing of one step: per stage, start and end of every action (same order as the schedule)."""

    start: dict[int, list[Time]]
    """Stage -> start time of each action."""
    end: dict[int, list[Time]]
    """Stage -> end time of each action."""
    busy: dict[int, Time]
    """Stage -> total compute time."""
    makespan: Time
    """Time at which the last action ends."""

    @property
    def bubble(self) -> dict[int, Time]:
        """Per stage, bubble time over ideal compute time: ``(makespan - busy) / busy``."""
        return {s: _ratio(self.makespan - b, b) for s, b in self.busy.items()}

    @property
    def bubble_fraction(self) -> Time:
        """The largest per-stage bubble (all stages agree under uniform costs)."""
        return max(self.bubble.values())


def _ratio(num: Time, den: Time) -> Time:
    """``num / den``, exact (a Fraction) when both are ints or Fractions."""
    if isinstance(num, int | Fraction) and isinstance(den, int | Fraction):
        return Fraction(num) / den
    return num / den


def dry_run(schedule: Schedule, cost_f: Cost = 1.0, cost_b: Cost = 2.0, cost_w: Cost | None = None) -> DryRun:
    """:func:`simulate` with ``batched`` sends and instant transfers, per action.

    ``cost_f`` / ``cost_b``: a duration for every F / whole backward, or a
    function of the action (e.g. per-chunk costs); ``cost_w``: the W part of
    a split backward (None: half of it), as in :func:`simulate`. A batched exchange waits for its peers; a
    compute-only schedule waits directly for its producers. The bubble of a
    stage is its idle time over its compute time, ``(makespan - busy) /
    busy`` (the paper's bubble time over ideal time); integer or
    :class:`~fractions.Fraction` costs give exact Fraction bubbles.
    Raises :class:`ScheduleError` if the schedule misplaces or misses
    actions, has an unmatched send or receive, or deadlocks (an action placed
    before what it needs on its own stage shows as a deadlock);
    :func:`~autopar.schedules.validate` checks the rest.
    """
    costs = compute_costs(cost_f, cost_b, cost_w)
    start, end = _Run(schedule, costs, _as_cost(0), Sends.BATCHED, _checked_index(schedule), events=False).times()
    busy = {
        s: sum((end[s][t] - start[s][t] for t, a in enumerate(acts) if a.is_compute), start=0)
        for s, acts in schedule.actions.items()
    }
    makespan = max((e for ends in end.values() for e in ends), default=0)
    return DryRun(start, end, busy, makespan)
