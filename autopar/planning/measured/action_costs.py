"""Per-action costs measured on a machine, from a run's events: the simulator's inputs.

A measured step (``autopar.runtime.engine.timeline``: each rank's F, B, W (the weight
gradients of a zero-bubble schedule), batches of sends/receives, and ``wait``
events where an F or B waited for a tensor it receives) becomes what
``autopar.schedules.simulate(..., sends='posted')`` takes: the cost of every
F, B and W per chunk and the transfer time of every stage-to-stage message,
medians over microbatches, ranks and steps.

What an F, B or W costs. The simulator posts a batch of sends/receives in no
time and starts the next action at once; on a real rank posting takes time
(the handlers, ``batch_isend_irecv``). So an action costs its *occupancy*:
from its start (after any wait for its input) to the start of the next F,
B, W or wait on its rank, the batch it posts after it included. A batch
before a rank's first action (stage 1's first receive) is not charged: its
rank waits for that input anyway. The simulator takes a split backward as
the whole backward and its W part (B lasts the difference), so
:meth:`ActionCosts.cost_b` of a chunk with measured W is B + W.

Which stage a message comes from. A receive on chunk ``c`` comes from the
stage that holds chunk ``c - 1`` (a forward's input) or ``c + 1`` (a
backward's gradient), as the schedule places chunks (``chunk_stages``:
``c % p``, or ZB-V's V, where chunks ``c`` and ``2p - 1 - c`` share a stage).

What a transfer costs. A receive's wait mixes two things: the peer being
late (its send not posted yet) and the message in flight. With every rank
on one clock, each received tensor has ``posted`` (the later of its send's
and its receive's batch end: both sides there), ``asked`` (its consumer
started waiting) and ``arrived`` (the wait ended). The peer's lateness is
``posted - asked`` where positive; ``arrived - posted`` is the transfer time,
but only for a consumer that actually blocked (the wait lasted over
``BLOCKED_S``): a tensor already there when asked arrived at some unknown
instant before ``asked`` and gives only an upper bound. The transfer cost of
a message is the median over blocked samples of its chunk and direction;
without any, over all blocked samples of the run; without any at all, the
smallest upper bound (no consumer was ever kept waiting by a transfer, so
none is charged more than the least slack observed).
"""

from __future__ import annotations

import statistics
from collections import defaultdict
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass

from autopar.core.mesh import MeshShape
from autopar.planning.errors import MissingCostError, PlanError
from autopar.schedules import Action, Event, Kind, Schedule, Sends, SimResult, simulate

__all__ = ["BLOCKED_S", "COMPUTE_KINDS", "Step", "Received", "received_messages", "transfer_pairs",
           "compute_samples", "ActionCosts", "action_costs"]

BLOCKED_S = 50e-6
"""A consumer whose wait lasted longer than this blocked on its message (a wait for a tensor
already received returns in a few microseconds)."""

Step = Mapping[int, Sequence[Event]]
"""One measured step: global rank -> its events, on one clock."""

CostKey = tuple[str, int]
"""(``"F"``, ``"B"`` or ``"W"``, chunk)."""
ActionKey = tuple[str, int, int]
"""(``"F"``, ``"B"`` or ``"W"``, chunk, microbatch)."""
COMPUTE_KINDS = ("F", "B", "W")
"""The compute actions of a step: forward, backward (or input gradient), weight gradient."""


@dataclass(frozen=True)
class Received:
    """One tensor a rank received, timed on the run's clock."""

    rank: int
    name: str
    """The receive as the consumer's wait names it: ``RF2.0``, ``RB1.3``."""
    produced: CostKey
    """The F or B whose result travelled: ``("F", 1)`` for ``RF2.0``, ``("B", 2)`` for ``RB1.3``."""
    microbatch: int
    posted: float
    """Both sides posted: the later end of the send's batch and of the receive's batch."""
    asked: float
    """The consumer started waiting for it."""
    arrived: float
    """The wait ended."""

    @property
    def blocked(self) -> bool:
        """The consumer waited for the tensor (so ``arrived`` is its arrival)."""
        return self.arrived - self.asked > BLOCKED_S

    @property
    def peer_late(self) -> float:
        """Time the consumer waited for the peer to post its side."""
        return max(0.0, min(self.posted, self.arrived) - self.asked)

    @property
    def in_flight(self) -> float:
        """Time the consumer waited with both sides posted: the transfer it saw."""
        return max(0.0, self.arrived - max(self.asked, self.posted))

    @property
    def since_posted(self) -> float:
        """``arrived - posted``: the transfer time if ``blocked``, else an upper bound of it."""
        return max(0.0, (self.arrived if self.blocked else self.asked) - self.posted)


def _batch_ends(events: Iterable[Event]) -> dict[str, float]:
    """Action text (``SF0.1>1``) -> end of the batch of sends/receives that posted it."""
    return {token: e.end for e in events if e.kind == "comm" for token in e.name.split()}


def received_messages(step: Step, shape: MeshShape, chunk_stages: Sequence[int]) -> list[Received]:
    """Every tensor received in ``step`` that a consumer waited for (a ``wait`` event), matched
    with its send on the peer rank (same data-parallel and tensor-parallel coordinates).
    ``chunk_stages[c]``: the stage holding chunk ``c`` (``Schedule.chunk_stages``)."""
    chunk_stages = _check_stages(chunk_stages, shape)
    ends = {rank: _batch_ends(evs) for rank, evs in step.items()}
    out = []
    for rank, events in step.items():
        stage = shape.coords(rank)[0]
        for e in events:
            if e.kind != "wait":
                continue
            fwd = e.name.startswith("RF")
            chunk, micro = (int(x) for x in e.name[2:].split("."))
            src_chunk = chunk - 1 if fwd else chunk + 1
            if not 0 <= src_chunk < len(chunk_stages):
                raise PlanError(f"rank {rank} waited for {e.name}, from chunk {src_chunk}, but the schedule has "
                                f"chunks 0..{len(chunk_stages) - 1}: the events are of another schedule")
            src_stage = chunk_stages[src_chunk]
            peer = rank + (src_stage - stage) * shape.tp * shape.dp
            send = f"{'SF' if fwd else 'SB'}{src_chunk}.{micro}>{stage}"
            recv = f"{e.name}<{src_stage}"
            if send not in ends.get(peer, {}) or recv not in ends[rank]:
                raise PlanError(f"rank {rank} waited for {e.name}, but the step has no batch posting {recv} "
                                f"on rank {rank} and {send} on rank {peer}: the events are not one whole step")
            posted = max(ends[peer][send], ends[rank][recv])
            out.append(Received(rank, e.name, ("F" if fwd else "B", src_chunk), micro, posted, e.start, e.end))
    return out


def _check_stages(chunk_stages: Sequence[int], shape: MeshShape) -> tuple[int, ...]:
    stages = tuple(int(s) for s in chunk_stages)
    bad = [c for c, s in enumerate(stages) if not 0 <= s < shape.pp]
    if not stages or bad:
        raise PlanError(f"chunk placement {list(stages)} does not fit pp={shape.pp} (chunks {bad} outside "
                        f"stages 0..{shape.pp - 1}): pass the schedule's chunk_stages")
    return stages


def transfer_pairs(steps: Iterable[Step], shape: MeshShape, chunk_stages: Sequence[int]) -> dict[CostKey, set]:
    """(kind, chunk) of each travelling result -> the (sending stage, receiving stage) pairs its
    messages took in ``steps``: what ``received_messages`` matched, for checking a placement."""
    pairs: dict[CostKey, set] = defaultdict(set)
    for step in steps:
        for r in received_messages(step, shape, chunk_stages):
            pairs[r.produced].add((chunk_stages[r.produced[1]], shape.coords(r.rank)[0]))
    return dict(pairs)


def compute_samples(events: Sequence[Event]) -> dict[ActionKey, float]:
    """(kind, chunk, microbatch) -> occupancy of each F, B or W of one rank's step: from its
    start to the start of the rank's next F, B, W or wait (the batch posted in between
    included), or to the end of the rank's last event."""
    ordered = sorted(events, key=lambda e: e.start)
    samples: dict[ActionKey, float] = {}
    last_end = max((e.end for e in ordered), default=0.0)
    for i, e in enumerate(ordered):
        if e.kind not in COMPUTE_KINDS:
            continue
        following = next((x.start for x in ordered[i + 1:] if x.kind != "comm"), last_end)
        action = Action.parse(e.name)
        samples[(e.kind, action.chunk, action.microbatch)] = following - e.start
    return samples


@dataclass(frozen=True)
class ActionCosts:
    """Measured seconds per action: what ``simulate(schedule, costs.cost_f, costs.cost_b,
    costs.comm, sends='posted', cost_w=costs.cost_w)`` takes (:meth:`simulate`). Keys are
    (kind, chunk) for medians over microbatches, or (kind, chunk, microbatch) for each action's
    own time (``per_microbatch``)."""

    compute: dict[tuple, float]
    """(``"F"``/``"B"``/``"W"``, chunk[, microbatch]) -> occupancy (median, or mean: ``action_costs``);
    ``"B"`` is the input-gradient part alone where the backward is split (W measured apart)."""
    transfer: dict[tuple, float]
    """(kind, chunk[, microbatch]) of the F or B whose result travels -> its transfer seconds."""
    transfer_default: float
    """Transfer seconds of a message no consumer waited for in the trace (none was received
    apart from its batch, as under NCCL, where a batch is waited for whole)."""
    blocked: int
    """Received tensors whose consumer blocked: the samples of the transfer times."""
    received: int
    """Received tensors in all."""
    per_microbatch: bool = False
    """Each action's own cost (a replay of the measured step), not the median of its chunk's."""

    def _key(self, kind: str, a: Action) -> tuple:
        return (kind, a.chunk, a.microbatch) if self.per_microbatch else (kind, a.chunk)

    def _compute(self, kind: str, a: Action) -> float:
        key = self._key(kind, a)
        if key not in self.compute:
            have = ", ".join(f"{k[0]}{'.'.join(map(str, k[1:]))}" for k in sorted(self.compute))
            raise MissingCostError(f"no measured time for {kind}{'.'.join(map(str, key[1:]))} (measured: {have}): "
                                   f"the trace is of another schedule or layout")
        return self.compute[key]

    def cost_f(self, a: Action) -> float:
        """Seconds of the forward ``a``."""
        return self._compute("F", a)

    def cost_b(self, a: Action) -> float:
        """Seconds of the whole backward of ``a``'s chunk and microbatch: its B, plus its W where
        the backward was split (the simulator's ``cost_b``; B then lasts ``cost_b - cost_w``)."""
        return self._compute("B", a) + (self._compute("W", a) if self.splits_backward else 0.0)

    def cost_w(self, a: Action) -> float:
        """Seconds of the weight-gradient action ``a`` (a W of a zero-bubble schedule)."""
        return self._compute("W", a)

    @property
    def splits_backward(self) -> bool:
        """Whether the measured step ran W actions (a zero-bubble schedule)."""
        return any(k[0] == "W" for k in self.compute)

    def simulate(self, schedule: Schedule) -> SimResult:
        """``schedule`` simulated with these costs, sends posted as the runtime posts them."""
        if schedule.splits_backward != self.splits_backward:
            raise PlanError(f"schedule {schedule.name!r} {'splits' if schedule.splits_backward else 'does not split'}"
                            f" its backwards but the measured step {'has' if self.splits_backward else 'has no'} "
                            f"W actions: the trace is of another schedule")
        return simulate(schedule, self.cost_f, self.cost_b, self.comm, sends=Sends.POSTED,
                        cost_w=self.cost_w if self.splits_backward else None)

    def comm(self, produced: Action) -> float:
        """Seconds of the transfer of ``produced``'s result (an F's output or a B's input gradient)."""
        kind = "F" if produced.kind is Kind.F else "B"
        return self.transfer.get(self._key(kind, produced), self.transfer_default)


def action_costs(steps: Sequence[Step], shape: MeshShape, chunk_stages: Sequence[int], per_microbatch: bool = False,
                 average: Callable[[list[float]], float] = statistics.median) -> ActionCosts:
    """Per-action costs over ``steps``: every rank's F, B and W pooled per chunk and kind (and
    microbatch, for ``per_microbatch``), ``average`` of the samples: the median for a typical
    step; the mean keeps a step's total compute (a rank descheduled inside one action counts)
    when costs are taken from the very step they predict. Transfers as the module's docstring
    says; ``chunk_stages[c]`` is the stage of chunk ``c`` (``Schedule.chunk_stages``)."""
    if not steps:
        raise PlanError("no measured steps to take costs from: record at least two training steps "
                        "(the first is a warm-up) and write them, engine.write_trace(path, steps=k)")
    samples: dict[tuple, list[float]] = defaultdict(list)
    received: list[Received] = []
    for step in steps:
        for events in step.values():
            for key, value in compute_samples(events).items():
                samples[key if per_microbatch else key[:2]].append(value)
        received += received_messages(step, shape, chunk_stages)
    compute = {key: average(values) for key, values in samples.items()}
    transfer, default = _transfers(received, per_microbatch)
    return ActionCosts(compute, transfer, default, sum(r.blocked for r in received), len(received), per_microbatch)


def _transfers(received: Sequence[Received], per_microbatch: bool) -> tuple[dict[tuple, float], float]:
    """(kind, chunk[, microbatch]) of each travelling result -> its transfer seconds, and the
    seconds of one without blocked samples (the module's docstring). A message of its own
    (``per_microbatch``) that did not block costs the estimate, capped by its own upper bound."""
    blocked = [r.since_posted for r in received if r.blocked]
    bounds = [r.since_posted for r in received if not r.blocked]
    fallback = statistics.median(blocked) if blocked else min(bounds, default=0.0)
    by_key: dict[tuple, list[float]] = {}
    for r in received:
        values = by_key.setdefault(r.produced, [])
        if r.blocked:
            values.append(r.since_posted)
    transfer = {key: statistics.median(v) if v else fallback for key, v in by_key.items()}
    if not per_microbatch:
        return transfer, fallback
    own: dict[tuple, list[float]] = defaultdict(list)
    for r in received:
        own[(*r.produced, r.microbatch)].append(r.since_posted if r.blocked
                                                else min(r.since_posted, transfer[r.produced]))
    return {key: statistics.median(v) for key, v in own.items()}, fallback
