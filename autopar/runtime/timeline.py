"""Measured timelines: every action a rank ran in a step, as a Chrome/Perfetto trace.

``engine.train_step`` records (action, start, end) for each compute action and
each batch of point-to-point operations. ``write_chrome_trace`` writes the
events of all ranks (gathered to one) as the Trace Event JSON that
chrome://tracing and ui.perfetto.dev open: one row per rank, forward and
backward named like the schedule (``F2.0``, ``B2.0``), so a measured step can
be laid beside ``autopar simulate``'s predicted one. ``Event`` is the one event
record of ``autopar.schedules`` (the simulator's), re-exported here for the engine.
"""

from __future__ import annotations

import json

import torch.distributed as dist

from autopar.schedules import Event

__all__ = ["Event", "gather_events", "write_chrome_trace"]


def gather_events(events: list[Event]) -> list[Event]:
    """All ranks' events on every rank (a collective when a process group exists)."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return list(events)
    out: list[list[Event] | None] = [None] * dist.get_world_size()
    dist.all_gather_object(out, list(events))
    return [e for part in out for e in (part or [])]


_COLORS = {"F": "good", "B": "terrible", "comm": "grey", "wait": "grey"}


def write_chrome_trace(events: list[Event], path: str) -> None:
    """Write events as Trace Event Format JSON (microseconds); measured ones, or a simulated
    step's (``[e for evs in sim.events.values() for e in evs]``, times in its costs' units)."""
    trace = []
    for rank in sorted({e.rank for e in events}):
        trace.append({"name": "process_name", "ph": "M", "pid": rank, "args": {"name": f"rank {rank}"}})
    for e in events:
        trace.append({"name": e.name, "cat": e.kind, "ph": "X", "pid": e.rank, "tid": 0,
                      "ts": float(e.start) * 1e6, "dur": max(float(e.end - e.start), 0.0) * 1e6,
                      "cname": _COLORS[e.kind]})
    with open(path, "w") as f:
        json.dump({"traceEvents": trace, "displayTimeUnit": "ms"}, f)
