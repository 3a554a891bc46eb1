"""``gc_paused``: Python's cyclic garbage collector held off while a step builds many small objects.

A collection of the oldest generation walks every object the process holds,
and it is triggered by how many objects have survived since the last one. A
step that allocates hundreds of thousands of tuples and records that live on
(a lowered schedule of 3,072 ranks' actions and its indexes) next to a heap
of fx graphs and fake tensors pays for several walks of that whole heap,
often more than the step's own work. Such a step makes no reference cycles,
so holding the collector off frees nothing later than it would have been:
its objects are freed by reference counting as before.
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
