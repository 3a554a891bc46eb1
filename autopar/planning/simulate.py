"""Event simulation of a pipeline schedule with real per-action costs.

``autopar.schedules`` generates the schedule (plain data: per stage, the
ordered F/B actions) and lowers it (adds the sends and receives autopar's
runtime posts); this module runs either in time.

``simulate_lowered`` runs a *lowered* schedule as the runtime does: a stage
executes its list in order; a run of consecutive sends/receives is one batched
exchange that the stage posts and then waits on until every partner has posted
its side; each send/receive pair then takes the ``comm`` time of its message
(pairs of one exchange in parallel). With ``comm = 0`` this is exactly
``schedules.dry_run`` (tested). ``autopar simulate`` draws this one.

``simulate`` runs the compute-only schedule with *eager* sends, the model the
planner ranks layouts with (it reproduces the paper's Megatron-LM numbers):

- F(c, i) needs F(c-1, i); B(c, i) needs F(c, i) and B(c+1, i). A compute
  action starts at ``max(stage free, input ready)`` and lasts ``cost_f`` /
  ``cost_b`` of the action (per-chunk costs: the embedding rides on chunk 0,
  the LM head and loss on the last chunk).
- When a result is needed on another stage, the producing stage sends it
  right after computing it and is blocked for ``comm`` seconds (Megatron-LM's
  point-to-point calls are synchronous: nothing overlaps them); the consumer
  can use it at ``end + comm``. Sends are eager (a send does not wait for the
  receiver to post), so a valid schedule never deadlocks here.

With ``comm = 0`` the step time equals ``schedules.dry_run``'s makespan, and
with uniform costs the bubble is ``(p-1)/(v m)`` (tests check both).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from autopar.schedules import Action, Kind, Schedule, generate, lower

if TYPE_CHECKING:  # cost imports this module lazily; no import cycle at run time
    from autopar.planning.cost import Cluster, Estimate, Layout, ModelSpec

__all__ = ["Event", "SimResult", "simulate", "simulate_lowered", "simulate_layout_costs",
           "simulate_layout_lowered", "simulate_estimate", "runtime_schedule"]

Cost = float | Callable[[Action], float]


@dataclass(frozen=True)
class Event:
    """One action of one stage in time."""

    stage: int
    kind: str
    """``F``, ``B``, ``comm`` (a blocking send, or the transfers of an exchange) or
    ``wait`` (an exchange posted, waiting for a partner to post its side)."""
    chunk: int
    microbatch: int
    start: float
    end: float
    sends: str = ""
    """For ``comm``: ``F`` or ``B``, the kind of result sent."""
    peer: int = -1
    """For ``comm``: the stage it goes to."""
    text: str = ""
    """For an exchange of a lowered schedule: its actions, e.g. ``SF0.1>1 RB2.0<1``."""

    @property
    def label(self) -> str:
        """``F2.0``, ``B2.0``, ``SF2.0>3`` for a send of F2.0's output to stage 3, or an
        exchange's actions."""
        if self.text:
            return self.text
        if self.kind == "comm":
            return f"S{self.sends}{self.chunk}.{self.microbatch}>{self.peer}"
        return f"{self.kind}{self.chunk}.{self.microbatch}"


@dataclass(frozen=True)
class SimResult:
    """Timeline of one step."""

    schedule: Schedule
    events: dict[int, list[Event]]
    """Stage -> its events in execution order."""
    step_time: float
    """When the last action ends."""
    busy: dict[int, float]
    """Stage -> compute seconds."""
    comm: dict[int, float]
    """Stage -> seconds of message transfer it was blocked on (not waiting for a peer)."""

    @property
    def lowered(self) -> bool:
        """True when the schedule ran with its explicit exchanges (``simulate_lowered``)."""
        return self.schedule.is_lowered

    @property
    def idle(self) -> dict[int, float]:
        """Stage -> seconds neither computing nor transferring (waiting on a partner included)."""
        return {s: self.step_time - self.busy[s] - self.comm[s] for s in self.busy}

    @property
    def bubble_per_stage(self) -> dict[int, float]:
        """Stage -> idle / compute."""
        return {s: self.idle[s] / self.busy[s] for s in self.busy}

    @property
    def peak_in_flight(self) -> dict[int, int]:
        """Stage -> most (chunk, microbatch) activations held at once."""
        out = {}
        for s, evs in self.events.items():
            held = peak = 0
            for e in evs:
                held += 1 if e.kind == "F" else -1 if e.kind == "B" else 0
                peak = max(peak, held)
            out[s] = peak
        return out

    @property
    def bubble(self) -> float:
        """The largest per-stage bubble fraction; (p-1)/(v m) for uniform costs."""
        return max(self.bubble_per_stage.values())


def _as_cost(c: Cost) -> Callable[[Action], float]:
    return c if callable(c) else (lambda _a, c=c: c)


def simulate(schedule: Schedule, cost_f: Cost = 1.0, cost_b: Cost = 2.0, comm: Cost = 0.0) -> SimResult:
    """Run ``schedule`` with the given costs (seconds, or functions of the Action).

    ``comm`` is the time of one stage-to-stage message, a number or a function
    of the compute Action whose result is sent. Raises ``RuntimeError`` if the
    schedule cannot finish (an action waits for one that never runs).
    """
    f, b, cm = _as_cost(cost_f), _as_cost(cost_b), _as_cost(comm)
    p, last = schedule.p, schedule.num_chunks - 1
    acts = {s: [a for a in lst if a.is_compute] for s, lst in schedule.actions.items()}
    # key -> (stage, when it finished, when its result reached the consumer's stage)
    ready: dict[tuple[Kind, int, int], tuple[int, float, float]] = {}
    pc = dict.fromkeys(acts, 0)
    free = dict.fromkeys(acts, 0.0)
    busy = dict.fromkeys(acts, 0.0)
    transfer = dict.fromkeys(acts, 0.0)
    events: dict[int, list[Event]] = {s: [] for s in acts}

    KF = Kind.F

    def step(s: int) -> bool:
        a = acts[s][pc[s]]
        c, i = a.chunk, a.microbatch
        fwd = a.kind is KF
        if fwd:
            needs = ((KF, c - 1, i),) if c > 0 else ()
        else:
            needs = ((KF, c, i), (Kind.B, c + 1, i)) if c < last else ((KF, c, i),)
        t0 = free[s]
        for key in needs:
            got = ready.get(key)
            if got is None:
                return False
            src, done, arrived = got
            t0 = max(t0, done if src == s else arrived)
        dur = f(a) if fwd else b(a)
        t1 = t0 + dur
        busy[s] += dur
        code = "F" if fwd else "B"
        events[s].append(Event(s, code, c, i, t0, t1))
        target = c + 1 if fwd else c - 1
        sent = t1
        if 0 <= target <= last and target % p != s:
            x = cm(a)
            sent = t1 + x
            if x > 0:
                transfer[s] += x
                events[s].append(Event(s, "comm", c, i, t1, sent, code, target % p))
        ready[(a.kind, c, i)] = (s, t1, sent)
        free[s] = sent
        pc[s] += 1
        return True

    _run_until_done(acts, pc, step, f"schedule {schedule.name} p={p} v={schedule.v} m={schedule.m} cannot finish",
                    "wait for inputs that never come")
    makespan = max((free[s] for s in acts), default=0.0)
    return SimResult(schedule, events, makespan, busy, transfer)


def _run_until_done(actions: dict[int, list[Action]], pc: dict[int, int], step: Callable[[int], bool],
                    what: str, why: str = "") -> None:
    """Advance every stage with ``step`` (False: blocked) until all finish; raise naming the stuck actions."""
    progress = True
    while progress:
        progress = False
        for s in actions:
            while pc[s] < len(actions[s]) and step(s):
                progress = True
    stuck = [s for s in actions if pc[s] < len(actions[s])]
    if stuck:
        where = ", ".join(f"stage {s} at {actions[s][pc[s]]}" for s in stuck)
        raise RuntimeError(f"{what}: {where}" + (f" {why}" if why else ""))


_PARTNER_OF = {  # kind -> (partner kind, chunk offset, compute action whose result travels)
    Kind.SEND_F: (Kind.RECV_F, +1, (Kind.F, 0)),
    Kind.RECV_F: (Kind.SEND_F, -1, (Kind.F, -1)),
    Kind.SEND_B: (Kind.RECV_B, -1, (Kind.B, 0)),
    Kind.RECV_B: (Kind.SEND_B, +1, (Kind.B, +1)),
}


def simulate_lowered(schedule: Schedule, cost_f: Cost = 1.0, cost_b: Cost = 2.0, comm: Cost = 0.0) -> SimResult:
    """Run a lowered schedule (``schedules.lower``) as autopar's runtime does.

    Each stage runs its actions in order. Sends and receives are posted
    without blocking when the stage reaches them (the runtime's
    ``batch_isend_irecv``; sends are waited for only at the end of the step);
    a message arrives ``comm(a)`` after both its send and its receive are
    posted (``a``: the F or B whose result travels). An F or B that needs a
    received tensor waits for its arrival: that time is a ``comm`` event when
    the message was in transit, a ``wait`` event when the partner had not yet
    sent it. With ``comm = 0`` the step equals ``schedules.dry_run``'s
    makespan of the compute-only schedule. Raises ``RuntimeError`` on a
    deadlock.
    """
    if not schedule.is_lowered and schedule.p > 1:
        raise ValueError(f"schedule {schedule.name!r} has no sends/receives: lower it first, "
                         "or use simulate() for eager sends")
    f, b, cm = _as_cost(cost_f), _as_cost(cost_b), _as_cost(comm)
    stages = list(schedule.actions)
    posted: dict[tuple[Kind, int, int], float] = {}
    pc = dict.fromkeys(stages, 0)
    free = dict.fromkeys(stages, 0.0)
    busy = dict.fromkeys(stages, 0.0)
    transfer = dict.fromkeys(stages, 0.0)
    events: dict[int, list[Event]] = {s_: [] for s_ in stages}
    received = {s_: {a.key for a in acts if a.is_recv} for s_, acts in schedule.actions.items()}

    def arrival(recv_key: tuple[Kind, int, int]) -> tuple[float, float] | None:
        """(when the later of send/receive was posted, when the data arrives), None if unknown yet."""
        kind, chunk, mb = recv_key
        pk, off, (ck, coff) = _PARTNER_OF[kind]
        send_key = (pk, chunk + off, mb)
        if send_key not in posted or recv_key not in posted:
            return None
        met = max(posted[send_key], posted[recv_key])
        return met, met + cm(Action(ck, chunk + coff, mb))

    def step(s_: int) -> bool:
        a = schedule.actions[s_][pc[s_]]
        t0 = free[s_]
        if a.is_comm:
            posted[a.key] = t0
            pc[s_] += 1
            return True
        need = (Kind.RECV_F if a.kind is Kind.F else Kind.RECV_B, a.chunk, a.microbatch)
        start = t0
        if need in received[s_]:
            got = arrival(need)
            if got is None:
                return False
            met, ready = got
            if ready > t0:
                text = str(Action(need[0], a.chunk, a.microbatch, 0)).split("<")[0]
                if met > t0:
                    events[s_].append(Event(s_, "wait", a.chunk, a.microbatch, t0, met, text=text))
                if ready > max(t0, met):
                    events[s_].append(Event(s_, "comm", a.chunk, a.microbatch, max(t0, met), ready, text=text))
                    transfer[s_] += ready - max(t0, met)
                start = ready
        fwd = a.kind is Kind.F
        dur = f(a) if fwd else b(a)
        events[s_].append(Event(s_, "F" if fwd else "B", a.chunk, a.microbatch, start, start + dur))
        busy[s_] += dur
        free[s_] = start + dur
        pc[s_] += 1
        return True

    _run_until_done(schedule.actions, pc, step,
                    f"lowered schedule {schedule.name} p={schedule.p} v={schedule.v} m={schedule.m} deadlocks")
    makespan = max((free[s_] for s_ in stages), default=0.0)
    return SimResult(schedule, events, makespan, busy, transfer)


def runtime_schedule(name: str, p: int, v: int, m: int) -> Schedule:
    """The schedule autopar's runtime interprets: ``lower(generate(name, p, v, m))``
    (lowered with its default, equal F and B costs, as ``autopar.parallelize`` does)."""
    return lower(generate(name, p, v, m))


def _chunk_costs(p: int, v: int, t_f: float, t_b: float, first_extra: tuple[float, float],
                 last_extra: tuple[float, float]) -> tuple[Callable[[Action], float], Callable[[Action], float]]:
    last = p * v - 1

    def cf(a: Action) -> float:
        return t_f + (first_extra[0] if a.chunk == 0 else 0.0) + (last_extra[0] if a.chunk == last else 0.0)

    def cb(a: Action) -> float:
        return t_b + (first_extra[1] if a.chunk == 0 else 0.0) + (last_extra[1] if a.chunk == last else 0.0)

    return cf, cb


def simulate_layout_lowered(name: str, p: int, v: int, m: int, t_f: float, t_b: float, comm: float,
                            first_extra: tuple[float, float] = (0.0, 0.0),
                            last_extra: tuple[float, float] = (0.0, 0.0)) -> SimResult:
    """Like ``simulate_layout_costs``, but running ``runtime_schedule(name, p, v, m)``
    (the lowered schedule autopar's runtime executes) with ``simulate_lowered``."""
    cf, cb = _chunk_costs(p, v, t_f, t_b, first_extra, last_extra)
    return simulate_lowered(runtime_schedule(name, p, v, m), cf, cb, comm)


def simulate_layout_costs(name: str, p: int, v: int, m: int, t_f: float, t_b: float, comm: float,
                          first_extra: tuple[float, float] = (0.0, 0.0),
                          last_extra: tuple[float, float] = (0.0, 0.0)) -> SimResult:
    """Simulate schedule ``name`` with uniform chunk costs (``t_f``, ``t_b``), the
    embedding's (forward, backward) added to chunk 0 and the LM head's to the
    last chunk, and ``comm`` seconds per stage-to-stage message."""
    cf, cb = _chunk_costs(p, v, t_f, t_b, first_extra, last_extra)
    return simulate(generate(name, p, v, m), cf, cb, comm)


def simulate_estimate(spec: ModelSpec, cluster: Cluster, layout: Layout) -> tuple[Estimate, SimResult]:
    """(Estimate with the simulated pipeline, its SimResult) for one layout.

    For p = 1 there is no pipeline to simulate; the result is a one-stage run. A
    pipeline over ``cost.SIMULATION_LIMIT`` actions is simulated here all the same
    (the Estimate keeps its closed-form pipeline time).
    """
    from autopar.planning.cost import estimate  # noqa: PLC0415  (cost imports this module lazily)

    est = estimate(spec, cluster, layout, simulate=True)
    if est.sim is not None:
        return est, est.sim
    lay = est.layout
    if lay.p > 1:  # over SIMULATION_LIMIT for the planner, but asked for explicitly
        sim = simulate_layout_costs(lay.schedule, lay.p, lay.v, est.m, est.t_chunk_f, est.t_chunk_b, est.t_p2p,
                                    (est.t_emb_f, est.t_emb_b), (est.t_head_f, est.t_head_b))
        return est, sim
    sim = simulate_layout_costs("1f1b", 1, 1, est.m, est.t_chunk_f, est.t_chunk_b, 0.0,
                                (est.t_emb_f, est.t_emb_b), (est.t_head_f, est.t_head_b))
    return est, sim
