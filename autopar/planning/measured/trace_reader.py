"""Reading a measured trace: the run a trace written by ``engine.write_trace(path, steps=k)`` holds.

The trace (``autopar/runtime/engine/timeline.py``) holds every rank's events of ``k``
training steps on one clock, each tagged with its step, and in its own object
(``autopar.schedules.trace_format``) the schedule the ranks ran (its grid), p, v, m,
each chunk's stage, the mesh and the bytes of each stage-to-stage message.
``read_trace`` gives them back as a ``MeasuredRun``, and refuses, saying why, a file
that is not such a trace or whose object contradicts itself.
"""

from __future__ import annotations

import json
from collections import defaultdict
from dataclasses import dataclass

from autopar.core.mesh import MeshShape
from autopar.planning.errors import PlanError
from autopar.schedules import Event, Schedule, parse_grid
from autopar.schedules.trace_format import METADATA_KEY, STEP_ARG, TRACE_FORMAT

__all__ = ["MeasuredRun", "read_trace"]


@dataclass(frozen=True)
class MeasuredRun:
    """A trace's steps and what is needed to simulate them."""

    schedule: Schedule
    """The lowered schedule every rank ran."""
    shape: MeshShape
    steps: dict[int, dict[int, list[Event]]]
    """Training step -> global rank -> its events in time order (seconds, one clock)."""
    message_bytes: dict[str, dict[int, int]]
    """``forward`` / ``backward`` -> chunk -> bytes one rank sends per message (0 where unknown)."""


def read_trace(path: str) -> MeasuredRun:
    """The run a trace written by ``engine.write_trace(path, steps=k)`` holds; a clear error
    for a file that is not one."""
    try:
        with open(path, encoding="utf-8") as fh:
            trace = json.load(fh)
    except (OSError, json.JSONDecodeError) as e:
        raise PlanError(f"cannot read the trace {path}: {e}") from e
    meta = trace.get(METADATA_KEY) if isinstance(trace, dict) else None
    if not isinstance(meta, dict) or meta.get("format") != TRACE_FORMAT:
        found = "none" if not isinstance(meta, dict) else f"format {meta.get('format')!r}"
        raise PlanError(f"{path} has no \"{METADATA_KEY}\" object of format {TRACE_FORMAT} ({found}): write the trace "
                        f"with engine.write_trace(path, steps=k) after k training steps")
    shape = MeshShape(tp=meta["tp"], pp=meta["pp"], dp=meta["dp"])
    steps: dict[int, dict[int, list[Event]]] = defaultdict(lambda: defaultdict(list))
    for item in trace.get("traceEvents", []):
        if item.get("ph") != "X" or STEP_ARG not in item.get("args", {}):
            continue
        start = item["ts"] / 1e6
        event = Event(item["pid"], item["cat"], item["name"], start, start + item["dur"] / 1e6)
        steps[item["args"][STEP_ARG]][item["pid"]].append(event)
    ordered = {k: {r: sorted(evs, key=lambda e: e.start) for r, evs in sorted(steps[k].items())}
               for k in sorted(steps)}
    sizes = {d: {int(c): n for c, n in meta.get("message_bytes", {}).get(d, {}).items()}
             for d in ("forward", "backward")}
    schedule = parse_grid(meta["grid"])
    recorded = meta.get("chunk_stages")
    if recorded is not None and tuple(recorded) != schedule.chunk_stages:
        raise PlanError(f"{path}: its chunk placement {recorded} is not its schedule's ({schedule.name}, "
                        f"{schedule.placement} placement: {list(schedule.chunk_stages)}): the file was edited or "
                        f"written by another version; write the trace again with engine.write_trace")
    if shape.pp != schedule.p:
        raise PlanError(f"{path}: the mesh has pp={shape.pp} but the schedule {schedule.name} p={schedule.p}")
    return MeasuredRun(schedule, shape, ordered, sizes)
