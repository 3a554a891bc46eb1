"""How far the model's uncertain inputs would have to move to change a ranking.

The planner's choice between two layouts rests on a handful of numbers that are
measured or fitted, not exact: how fast a GEMM runs, how fast the memory-bound
kernels stream HBM, the bus bandwidth NCCL reaches over NVLink and over
InfiniBand, and how much of the HBM a run may use. ``flip_points`` answers, for
each of them, "by what factor would this number have to change for the other
layout to be as fast?" A recommendation whose flip points are all far away, or
beyond what the hardware can physically do, is robust; one that flips at x1.05
is a coin toss, and the output says so.

Each factor is found by bisection on log(factor) over [1/8, 8], with the
closed-form estimate (``estimate(simulate=False)``, within about 0.3% of the
simulated one on pipelined layouts) so that one comparison costs a few
milliseconds.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Callable

from autopar.planning.cost.hardware import Hardware
from autopar.planning.cost.layout import Cluster
from autopar.planning.cost.step_estimate import Estimate, estimate
from autopar.planning.quantities import rate

__all__ = ["Knob", "KNOBS", "FlipPoint", "flip_points", "flip_lines", "memory_margin_line"]

LIMIT = 8.0
"""Factors are searched in [1/LIMIT, LIMIT]."""


@dataclass(frozen=True)
class Knob:
    """One uncertain input of the model and how to scale it."""

    name: str
    """Short key, e.g. ``nvlink``."""
    what: str
    """What it is, for the output."""
    scale: Callable[[Hardware, float], Hardware]
    """The hardware with this input multiplied by a factor."""
    value: Callable[[Hardware], str]
    """The input's value on a profile, in words, e.g. ``234 GB/s bus bandwidth``."""
    ceiling: Callable[[Hardware], float] | None = None
    """The largest factor physics allows (an efficiency cannot pass 1), or None."""


KNOBS: tuple[Knob, ...] = (
    Knob("gemm", "GEMM throughput",
         lambda hw, f: hw.with_efficiency(gemm=hw.eff.gemm * f),
         lambda hw: f"{rate(hw.eff.gemm * hw.peak_flops, 'FLOP')} for a large GEMM",
         lambda hw: 1.0 / hw.eff.gemm),
    Knob("hbm", "memory-bound kernel bandwidth",
         lambda hw, f: hw.with_efficiency(hbm=hw.eff.hbm * f),
         lambda hw: rate(hw.eff.hbm * hw.hbm_bw, "B"),
         lambda hw: 1.0 / hw.eff.hbm),
    Knob("nvlink", "NVLink bus bandwidth (tensor-parallel all-reduces, scatter/gather)",
         lambda hw, f: replace(hw, nvlink_bw=hw.nvlink_bw * f),
         lambda hw: rate(hw.nvlink_bw * hw.nvlink_efficiency, "B"),
         lambda hw: 1.0 / hw.nvlink_efficiency),
    Knob("ib", "InfiniBand bandwidth per NIC (pipeline sends, data-parallel all-reduce)",
         lambda hw, f: replace(hw, ib_bw=hw.ib_bw * f),
         lambda hw: rate(hw.ib_bw * hw.ib_efficiency, "B"),
         lambda hw: 1.0 / hw.ib_efficiency),
)


@dataclass(frozen=True)
class FlipPoint:
    """Where one input makes two layouts equally fast."""

    knob: Knob
    factor: float | None
    """The input's multiplier at which ``other`` is as fast as ``chosen``; None if
    no factor in [1/8, 8] does it."""
    physical: bool
    """False when the factor asks for more than the hardware's line rate or peak."""


def _ratio(chosen: Estimate, other: Estimate, hw: Hardware) -> float:
    """other's iteration time / chosen's on hardware ``hw``."""
    cl = Cluster(chosen.cluster.gpus, hw, chosen.cluster.global_batch)
    a = estimate(chosen.spec, cl, chosen.layout, simulate=False, divisible_layers=False)
    b = estimate(other.spec, cl, other.layout, simulate=False, divisible_layers=False)
    return b.t_iter / a.t_iter


def _flip(chosen: Estimate, other: Estimate, knob: Knob, steps: int = 30) -> float | None:
    hw = chosen.cluster.hardware
    f = lambda x: _ratio(chosen, other, knob.scale(hw, x)) - 1.0  # noqa: E731
    if f(1.0) <= 0:  # already as fast
        return 1.0
    # the other layout is slower now; find the nearest factor on either side where it is not
    best: float | None = None
    for end in (LIMIT, 1.0 / LIMIT):
        if f(end) > 0:
            continue
        lo, hi = 0.0, math.log(end)  # f(exp(lo)) > 0 >= f(exp(hi))
        for _ in range(steps):
            mid = (lo + hi) / 2
            if f(math.exp(mid)) > 0:
                lo = mid
            else:
                hi = mid
        x = math.exp(hi)
        if best is None or abs(math.log(x)) < abs(math.log(best)):
            best = x
    return best


def flip_points(chosen: Estimate, other: Estimate) -> list[FlipPoint]:
    """For each uncertain input, the factor at which ``other`` catches up with ``chosen``."""
    hw = chosen.cluster.hardware
    out = []
    for knob in KNOBS:
        x = _flip(chosen, other, knob)
        physical = x is None or knob.ceiling is None or x <= knob.ceiling(hw)
        out.append(FlipPoint(knob, x, physical))
    return out


def flip_lines(chosen: Estimate, other: Estimate) -> list[str]:
    """The flip points in words, nearest first (how robust the choice of ``chosen`` is)."""
    hw = chosen.cluster.hardware
    pts = sorted(flip_points(chosen, other), key=lambda fp: abs(math.log(fp.factor)) if fp.factor else math.inf)
    lines = [f"  what would make {other.layout.short} as fast (one input at a time, closed-form model):"]
    for fp in pts:
        k = fp.knob
        if fp.factor is None:
            lines.append(f"    {k.what} ({k.value(hw)}): no change within x1/{LIMIT:g}..x{LIMIT:g}")
            continue
        new = k.value(k.scale(hw, fp.factor))
        note = "" if fp.physical else (f"; impossible: beyond the {hw.gpu}'s peak or line rate "
                                       f"(at most x{k.ceiling(hw):.2f})")
        lines.append(f"    {k.what}: x{fp.factor:.2f} ({k.value(hw)} -> {new}){note}")
    return lines


def memory_margin_line(e: Estimate) -> str:
    """How close a layout is to the memory line, in GiB and as a share of the HBM."""
    hw = e.cluster.hardware
    spare = hw.usable_bytes - e.memory.total
    pct = spare / hw.hbm_bytes
    tight = (" - tight: allocator fragmentation or a buffer the model does not count could exceed it"
             if 0 <= pct < 0.02 else "")
    return f"  {e.layout.short} leaves {spare / 2**30:.1f} GiB ({pct:.1%} of HBM) below the usable line{tight}"
