"""Event simulation of a pipeline schedule with real per-action costs.

``autopar.schedules`` generates the schedule (plain data: per stage, the
ordered F/B actions); this module runs it in time. Each stage executes its
list in order, each action as early as its inputs allow:

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

from autopar.schedules import Action, Kind, Schedule, generate

if TYPE_CHECKING:  # cost imports this module lazily; no import cycle at run time
    from autopar.cost import Cluster, Estimate, Layout, ModelSpec

__all__ = ["Event", "SimResult", "simulate", "simulate_layout_costs", "simulate_estimate"]

Cost = float | Callable[[Action], float]


@dataclass(frozen=True)
class Event:
    """One action of one stage in time."""

    stage: int
    kind: str
    """``F``, ``B`` or ``comm`` (the blocking send of the preceding F or B's result)."""
    chunk: int
    microbatch: int
    start: float
    end: float
    sends: str = ""
    """For ``comm``: ``F`` or ``B``, the kind of result sent."""
    peer: int = -1
    """For ``comm``: the stage it goes to."""

    @property
    def label(self) -> str:
        """``F2.0``, ``B2.0``, or ``SF2.0>3`` for a send of F2.0's output to stage 3."""
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
    def idle(self) -> dict[int, float]:
        """Stage -> seconds neither computing nor transferring."""
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

    progress = True
    while progress:
        progress = False
        for s in acts:
            while pc[s] < len(acts[s]) and step(s):
                progress = True
    stuck = [s for s in acts if pc[s] < len(acts[s])]
    if stuck:
        where = ", ".join(f"stage {s} at {acts[s][pc[s]]}" for s in stuck)
        raise RuntimeError(f"schedule {schedule.name} p={p} v={schedule.v} m={schedule.m} cannot finish: "
                           f"{where} wait for inputs that never come")
    makespan = max((free[s] for s in acts), default=0.0)
    return SimResult(schedule, events, makespan, busy, transfer)


def simulate_layout_costs(name: str, p: int, v: int, m: int, t_f: float, t_b: float, comm: float,
                          first_extra: tuple[float, float] = (0.0, 0.0),
                          last_extra: tuple[float, float] = (0.0, 0.0)) -> SimResult:
    """Simulate schedule ``name`` with uniform chunk costs (``t_f``, ``t_b``), the
    embedding's (forward, backward) added to chunk 0 and the LM head's to the
    last chunk, and ``comm`` seconds per stage-to-stage message."""
    sched = generate(name, p, v, m)
    last = p * v - 1

    def cf(a: Action) -> float:
        return t_f + (first_extra[0] if a.chunk == 0 else 0.0) + (last_extra[0] if a.chunk == last else 0.0)

    def cb(a: Action) -> float:
        return t_b + (first_extra[1] if a.chunk == 0 else 0.0) + (last_extra[1] if a.chunk == last else 0.0)

    return simulate(sched, cf, cb, comm)


def simulate_estimate(spec: ModelSpec, cluster: Cluster, layout: Layout) -> tuple[Estimate, SimResult]:
    """(Estimate with the simulated pipeline, its SimResult) for one layout.

    For p = 1 there is no pipeline to simulate; the result is a one-stage run.
    """
    from autopar.cost import estimate  # noqa: PLC0415  (cost imports this module lazily)

    est = estimate(spec, cluster, layout, simulate=True)
    if est.sim is not None:
        return est, est.sim
    lay = est.layout
    sim = simulate_layout_costs(lay.schedule, 1, 1, est.m, est.t_chunk_f, est.t_chunk_b, 0.0,
                                (est.t_emb_f, est.t_emb_b), (est.t_head_f, est.t_head_b))
    return est, sim
