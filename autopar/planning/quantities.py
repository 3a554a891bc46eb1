"""Quantities in words at any scale: a plan for 1000 GPUs speaks of seconds, TFLOP/s and billions of
parameters, one for two CPU ranks (a profile ``autopar tune`` measured) of milliseconds, GFLOP/s and
thousands. Each figure is written with three significant digits and the prefix that keeps it between
1 and 1000 (1024 for bytes), so neither reads as 0."""

from __future__ import annotations

import math

__all__ = ["si", "seconds", "rate", "count", "nbytes", "binary_unit"]

Scale = tuple[tuple[float, str], ...]
"""(units per step, its prefix), largest first; the last is the smallest a value is written in."""

_SI: Scale = ((1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k"), (1.0, ""), (1e-3, "m"), (1e-6, "u"), (1e-9, "n"))
_COUNTS: Scale = ((1e12, "T"), (1e9, "B"), (1e6, "M"), (1e3, "k"), (1.0, ""))
_BINARY: Scale = ((2.0**40, "TiB"), (2.0**30, "GiB"), (2.0**20, "MiB"), (2.0**10, "KiB"), (1.0, "B"))


def _step(value: float, scale: Scale) -> tuple[float, str]:
    """The step of ``scale`` ``value`` is written in: the largest it reaches (rounding up from 0.9995)."""
    return next(((s, p) for s, p in scale if abs(value) >= s * 0.9995), scale[-1])


def _digits(x: float, digits: int) -> str:
    """``x`` to ``digits`` significant digits, whole where rounding reaches another power of ten (999.9 ->
    1000, not 1e+03)."""
    text = f"{x:.{digits}g}"
    return f"{x:.0f}" if "e" in text else text


def si(value: float, unit: str, digits: int = 3) -> str:
    """``value`` of ``unit`` with the prefix that keeps it in [1, 1000): ``si(2.3e-3, "s")`` -> ``2.3 ms``,
    ``si(2.2e11, "FLOP/s")`` -> ``220 GFLOP/s``; 0 and non-finite values as they are."""
    if value == 0 or not math.isfinite(value):
        return f"{value:g} {unit}"
    step, prefix = _step(value, _SI)
    return f"{_digits(value / step, digits)} {prefix}{unit}"


def seconds(value: float, digits: int = 3) -> str:
    """A time: ``0.0312`` -> ``31.2 ms``, ``12.5`` -> ``12.5 s``."""
    return si(value, "s", digits)


def rate(value: float, unit: str, digits: int = 3) -> str:
    """A throughput or bandwidth in ``unit`` per second: ``rate(8e8, "B")`` -> ``800 MB/s``."""
    return si(value, f"{unit}/s", digits)


def count(value: float, digits: int = 3) -> str:
    """A count such as parameters, as model sizes are written: ``4.7e5`` -> ``470k``, ``1.7e9`` -> ``1.7B``."""
    step, suffix = _step(value, _COUNTS)
    return f"{_digits(value / step, digits)}{suffix}"


def binary_unit(value: float) -> tuple[float, str]:
    """(bytes per unit, its name) of the binary unit ``value`` bytes are written in: (2**30, "GiB") from
    1 GiB up, and so on down to bytes."""
    return _step(value, _BINARY)


def nbytes(value: float, digits: int = 3) -> str:
    """Bytes of memory in binary units, as memory is sized: ``2.5 * 2**30`` -> ``2.5 GiB``, ``19e6`` ->
    ``18.1 MiB``."""
    step, unit = binary_unit(value)
    return f"{_digits(value / step, digits)} {unit}"
