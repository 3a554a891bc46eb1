"""``gc_paused``: Python's cyclic garbage collector held off while a step builds many objects that live on.

A collection of the oldest generation walks every object the process holds,
and it is triggered by how many objects have survived since the last one. A
step that allocates hundreds of thousands of objects that outlive it (a
lowered schedule's actions and indexes, the chunk graphs of a pipeline split)
next to a heap of fx graphs and fake tensors pays for walks of that whole
heap, often more than the step's own work, and they find nothing to free.
Such a step leaves no cyclic garbage of its own: what it builds lives on,
and its temporaries are freed by reference counting as before.
"""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Iterator

__all__ = ["gc_paused"]


@contextlib.contextmanager
def gc_paused() -> Iterator[None]:
    """The cyclic collector off inside the block, and back as it was after (on unless it was off)."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()
