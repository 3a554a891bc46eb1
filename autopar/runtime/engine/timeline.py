"""Measured timelines: every action a rank ran, step by step, as a Chrome/Perfetto trace.

``engine.train_step`` records (action, start, end) for each compute action and
each batch of point-to-point operations, and a ``wait`` event when an F or B
waited for a tensor it receives (named like the simulator's, ``RF2.0``); the
F or B itself starts when the tensor is there. The engine keeps the last
training steps in a :class:`StepHistory`.

``write_chrome_trace`` writes events as the Trace Event JSON that
chrome://tracing and ui.perfetto.dev open: one row per rank, forward and
backward named like the schedule (``F2.0``, ``B2.0``; a zero-bubble schedule's
weight gradients ``W2.0``). A trace the engine
writes (``engine.write_trace(path, steps=k)``) holds ``k`` steps of every
rank on one clock (each rank's ``perf_counter`` shifted to rank 0's, the
offset measured right after barriers: :func:`clock_offset`), every event
tagged with its step (``args.step``), and a top-level ``"autopar"`` object
(:func:`trace_metadata`): the schedule every rank ran (its grid text), p, v,
m, the stage of each chunk (``chunk_stages``: ``c % p``, or ZB-V's V), the
mesh and the bytes of each stage-to-stage message, so
``autopar simulate --measured`` can simulate the same step and lay the
prediction beside the measurement. ``Event`` is the one event record of
``autopar.schedules`` (the simulator's), re-exported here for the engine.
"""

from __future__ import annotations

import contextlib
import json
import os
import statistics
import time
from collections import deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from autopar.runtime.engine.errors import EngineUsageError
from autopar.schedules import Event
from autopar.schedules.trace_format import TRACE_FORMAT

if TYPE_CHECKING:
    from autopar.compiler.program import Program
    from autopar.core.mesh import Mesh

__all__ = ["Event", "StepTimeline", "StepHistory", "gather_events", "gather_objects", "clock_offset",
           "trace_metadata", "chrome_trace", "write_chrome_trace", "aligned_steps"]


@dataclass(frozen=True)
class StepTimeline:
    """One training step of one rank: its events, times in seconds since ``origin``."""

    step: int
    """Which training step of the engine (0 = its first)."""
    origin: float
    """``time.perf_counter()`` on this rank when the step's first action started."""
    events: tuple[Event, ...]


class StepHistory:
    """The timelines of a rank's last ``keep`` training steps (older ones are dropped)."""

    def __init__(self, keep: int = 32) -> None:
        if keep < 1:
            raise EngineUsageError(f"a step history keeps at least one step, got keep={keep}")
        self._steps: deque[StepTimeline] = deque(maxlen=keep)
        self.recorded = 0
        """Steps recorded so far (kept or dropped)."""

    def add(self, origin: float, events: Iterable[Event]) -> None:
        """Record the next step's events (times since ``origin``)."""
        self._steps.append(StepTimeline(self.recorded, origin, tuple(events)))
        self.recorded += 1

    def last(self, steps: int | None = None) -> list[StepTimeline]:
        """The last ``steps`` kept steps, oldest first (all kept ones for None)."""
        kept = list(self._steps)
        return kept if steps is None else kept[max(len(kept) - steps, 0):]

    def __len__(self) -> int:
        return len(self._steps)


def gather_objects(obj: Any) -> list[Any]:
    """Every rank's ``obj``, in rank order (a collective when a process group exists)."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return [obj]
    out: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


def gather_events(events: list[Event]) -> list[Event]:
    """All ranks' events on every rank (a collective when a process group exists)."""
    return [e for part in gather_objects(list(events)) for e in (part or [])]


def clock_offset(device: torch.device, rounds: int = 5) -> float:
    """This rank's ``time.perf_counter()`` minus rank 0's, in seconds (0 without a process group).

    Collective. Each round every rank leaves a barrier, reads its clock, and
    rank 0's reading is broadcast; the median over ``rounds`` keeps one slow
    wake-up from skewing it. Error: how unevenly ranks leave a barrier (tens of
    microseconds on one host), small against the actions it aligns.
    """
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return 0.0
    diffs = []
    for _ in range(rounds):
        dist.barrier()
        mine = time.perf_counter()
        ref = torch.tensor([mine], dtype=torch.float64, device=device)
        dist.broadcast(ref, src=0)
        diffs.append(mine - float(ref.item()))
    return statistics.median(diffs)


def trace_metadata(program: Program, mesh: Mesh) -> dict[str, Any]:
    """What a reader needs to simulate the traced step: the schedule's grid, p, v, m, each
    chunk's stage, the mesh, each rank's stage and the bytes one rank sends per stage-to-stage
    message (``forward``: chunk c's outputs, ``backward``: the gradients of chunk c's inputs;
    only where the neighbour chunk is on another stage: ZB-V's turn sends nothing)."""
    sched, shape = program.schedule, mesh.shape
    tp = shape.tp

    def sent(boundaries, grads: bool) -> int:
        total = 0
        for b in boundaries:
            if grads and not b.requires_grad:
                continue
            split = program.config.scatter_gather and tp > 1 and b.replicated and b.numel % tp == 0
            total += b.nbytes // tp if split else b.nbytes
        return total

    chunks, stage = program.split.chunks, sched.stage_of
    last = len(chunks) - 1

    def crosses(c: int, to: int) -> bool:  # a message goes: the neighbour chunk sits on another stage
        return 0 <= to <= last and stage(c) != stage(to)

    return {
        "format": TRACE_FORMAT, "schedule": sched.name, "p": sched.p, "v": sched.v, "m": sched.m,
        "grid": sched.format_grid(), "chunk_stages": list(sched.chunk_stages),
        "tp": tp, "dp": shape.dp, "pp": shape.pp, "world": shape.world, **({"cp": shape.cp} if shape.cp > 1 else {}),
        "stage_of_rank": [shape.coords(r)[0] for r in range(shape.world)],
        "message_bytes": {"forward": {str(c.index): sent(c.outputs, False) for c in chunks
                                      if c.outputs and crosses(c.index, c.index + 1)},
                          "backward": {str(c.index): sent(c.inputs, True) for c in chunks
                                       if crosses(c.index, c.index - 1)}},
        "clock": "seconds; each rank's perf_counter shifted to rank 0's (offsets measured after barriers)",
    }


_COLORS = {"F": "good", "B": "terrible", "W": "yellow", "comm": "grey", "wait": "grey"}
"""Trace viewer colour names per event kind (forward, backward or input gradient, weight gradient,
a batch of sends/receives, a wait for a received tensor)."""


def chrome_trace(events: Sequence[Event], *, steps: Sequence[int] | None = None,
                 process_names: dict[int, str] | None = None, metadata: dict | None = None) -> dict:
    """Events as a Trace Event Format object (microseconds): one process row per ``e.rank``,
    named ``rank N`` or by ``process_names``; ``steps[i]`` (if given) is event i's step, in its
    ``args``; ``metadata`` becomes the top-level ``"autopar"`` object."""
    names = process_names or {}
    trace: list[dict] = []
    for order, rank in enumerate(sorted({e.rank for e in events} | set(names))):
        trace.append({"name": "process_name", "ph": "M", "pid": rank,
                      "args": {"name": names.get(rank, f"rank {rank}")}})
        trace.append({"name": "process_sort_index", "ph": "M", "pid": rank, "args": {"sort_index": order}})
    unknown = sorted({e.kind for e in events} - set(_COLORS))
    if unknown:
        raise EngineUsageError(f"events of unknown kind {unknown} (known: {', '.join(_COLORS)}): an event is an F, B "
                               f"or W action, a batch of sends/receives ('comm') or a wait for a received tensor")
    for i, e in enumerate(events):
        item = {"name": e.name, "cat": e.kind, "ph": "X", "pid": e.rank, "tid": 0,
                "ts": float(e.start) * 1e6, "dur": max(float(e.end - e.start), 0.0) * 1e6,
                "cname": _COLORS[e.kind]}
        if steps is not None:
            item["args"] = {"step": steps[i]}
        trace.append(item)
    out: dict[str, Any] = {"traceEvents": trace, "displayTimeUnit": "ms"}
    if metadata is not None:
        out["autopar"] = metadata
    return out


def write_chrome_trace(events: Sequence[Event], path: str, **kwargs: Any) -> None:
    """Write ``chrome_trace(events, **kwargs)`` as JSON: measured events, or a simulated
    step's (``[e for evs in sim.events.values() for e in evs]``, times in its costs' units).

    The trace is built whole, written to a temporary file beside ``path`` and renamed onto it:
    a failure leaves no file, or the one that was there, never an empty or partial trace."""
    text = json.dumps(chrome_trace(events, **kwargs))
    tmp = f"{path}.{os.getpid()}.tmp"
    try:
        with open(tmp, "w", encoding="utf-8") as f:
            f.write(text)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.remove(tmp)
        raise


def aligned_steps(per_rank: Sequence[tuple[int, float, list[StepTimeline]]]) -> tuple[list[Event], list[int]]:
    """(events, their steps) of ``(rank, clock offset, timelines)`` per rank on rank 0's clock,
    seconds since the earliest step start; a step recorded by only some ranks is left out."""
    common = set.intersection(*({t.step for t in tls} for _, _, tls in per_rank)) if per_rank else set()
    starts = [t.origin - off for _, off, tls in per_rank for t in tls if t.step in common]
    zero = min(starts, default=0.0)
    events, steps = [], []
    for _, off, tls in per_rank:
        for t in tls:
            if t.step not in common:
                continue
            shift = t.origin - off - zero
            for e in t.events:
                events.append(replace(e, start=e.start + shift, end=e.end + shift))
                steps.append(t.step)
    return events, steps
