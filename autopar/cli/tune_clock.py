"""How long a rank spends in the data-parallel gradient reduction, for ``autopar tune``'s measurements of
the runtime (``cli/tune_runtime.py``, ``cli/tune_layers.py``)."""

from __future__ import annotations

import contextlib
import time

__all__ = ["gradient_sync_clock"]


@contextlib.contextmanager
def gradient_sync_clock():
    """While in the block, the seconds this process spends in the data-parallel gradient reduction
    (``GradientSync.start`` and ``end_step``, the class patched) add up on the one-element list it
    yields, which the caller resets."""
    from autopar.runtime.optim.gradient_sync import GradientSync  # noqa: PLC0415  (loads torch)

    spent = [0.0]
    start, end = GradientSync.start, GradientSync.end_step

    def timed(method):
        def run(*args, **kwargs):
            t0 = time.perf_counter()
            try:
                return method(*args, **kwargs)
            finally:
                spent[0] += time.perf_counter() - t0
        return run

    GradientSync.start, GradientSync.end_step = timed(start), timed(end)
    try:
        yield spent
    finally:
        GradientSync.start, GradientSync.end_step = start, end
