"""The measured trace's own object: its key, version and fields, for its writer and its reader.

A trace the runtime writes (``autopar/runtime/engine/timeline.py``, ``engine.write_trace``) is
Trace Event JSON with one object of its own beside ``traceEvents``, under ``METADATA_KEY``: what a
reader needs to simulate the traced step again (``autopar/planning/measured/``). Both sides take
the version from here, so a change of the object's fields changes ``TRACE_FORMAT`` once and a
reader refuses a file of another version instead of misreading it.
"""

from __future__ import annotations

__all__ = ["TRACE_FORMAT", "METADATA_KEY", "METADATA_FIELDS", "STEP_ARG"]

TRACE_FORMAT = 1
"""Version of the trace's ``"autopar"`` object (readers refuse others)."""

METADATA_KEY = "autopar"
"""The top-level key of the object in the trace's JSON."""

STEP_ARG = "step"
"""The key, in each event's ``args``, of the training step the event belongs to."""

METADATA_FIELDS: dict[str, str] = {
    "format": "TRACE_FORMAT",
    "schedule": "the schedule's name",
    "p": "pipeline stages",
    "v": "model chunks per stage",
    "m": "microbatches per step",
    "grid": "the lowered schedule every rank ran, as its grid text",
    "chunk_stages": "each chunk's stage (c % p, or ZB-V's V)",
    "tp": "tensor-parallel degree",
    "dp": "data-parallel degree",
    "pp": "pipeline-parallel degree",
    "world": "ranks in all",
    "stage_of_rank": "each global rank's pipeline stage",
    "message_bytes": "'forward' / 'backward' -> chunk -> bytes one rank sends per stage-to-stage message",
    "clock": "what the times are: each rank's perf_counter shifted to rank 0's",
    "steps": "the training steps the trace holds",
}
"""Each field of the object and what it holds."""
