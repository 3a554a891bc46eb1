"""One picture of a measured step above its prediction (``autopar simulate --measured``).

Two bands on one time axis: the measured step (the run's median step, every
rank on one clock, each receive's wait split into waiting for the peer and
the transfer) and the same schedule simulated with the run's per-action
costs, rank by rank, in the colours of ``timeline.py`` (forward blue, backward
green, a zero-bubble schedule's weight gradient orange, transfer dark grey,
waiting for the partner hatched, bubble pale red).
Above them, a line with both step times and their ratio.
"""

from __future__ import annotations

from html import escape

from autopar.planning.drawing.timeline import _COMM, _IDLE, _colour, _svg_legend, svg_time_axis  # the project's drawing
from autopar.planning.measured.comparison import Comparison
from autopar.schedules import Event

__all__ = ["comparison_svg", "write_comparison_svg"]

_LEFT, _ROW_H, _GAP, _BAND_GAP = 150, 26, 6, 34


def comparison_svg(comp: Comparison, title: str = "", width: int = 1400) -> str:
    """The measured step and its prediction as an SVG document (a string)."""
    measured, predicted = comp.measured_events(), comp.predicted_events()
    ranks = sorted(measured)
    span = max(comp.predicted_step, _end(measured), 1e-12)
    sx = (width - _LEFT - 24) / span
    top = 30 + (20 if title else 0) + 16 * 2
    band_h = len(ranks) * (_ROW_H + _GAP)
    axis_y = top + 2 * band_h + _BAND_GAP
    parts = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{axis_y + 90}" '
             f'font-family="Helvetica, Arial, sans-serif" font-size="11">',
             '<defs><pattern id="wait" width="6" height="6" patternUnits="userSpaceOnUse" '
             'patternTransform="rotate(45)"><rect width="6" height="6" fill="#e4e4e4"/>'
             '<line x1="0" y1="0" x2="0" y2="6" stroke="#9a9a9a" stroke-width="2"/></pattern></defs>',
             '<rect width="100%" height="100%" fill="white"/>']
    parts += _titles(comp, title)
    # the axis in milliseconds: span and pixels per unit scaled from seconds
    parts += svg_time_axis(span * 1e3, _LEFT, width - 24 - _LEFT, sx / 1e3, top, axis_y, "ms")
    p = comp.run.schedule.p
    for i, rank in enumerate(ranks):
        y_meas = top + i * (_ROW_H + _GAP)
        y_pred = top + band_h + _BAND_GAP + i * (_ROW_H + _GAP)
        parts += _row(f"rank {rank}", measured[rank], y_meas, sx, p)
        parts += _row(f"rank {rank} (predicted)", predicted[rank], y_pred, sx, p)
    parts.append(f'<text x="{_LEFT}" y="{top + band_h + _BAND_GAP - 10}" fill="#444" font-weight="bold">'
                 f'predicted: {escape(comp.run.schedule.name)} simulated with the measured per-action costs '
                 f'(posted sends)</text>')
    parts += _svg_legend(max(comp.run.schedule.v, 1), _LEFT, axis_y + 52, split=comp.run.schedule.splits_backward)
    parts.append("</svg>")
    return "\n".join(parts)


def _end(events: dict[int, list[Event]]) -> float:
    return max((e.end for evs in events.values() for e in evs), default=0.0)


def _titles(comp: Comparison, title: str) -> list[str]:
    """The title, the line with both step times and their ratio, and what the costs are."""
    sched, costs = comp.run.schedule, comp.costs
    lines = [comp.summary(),
             f"{sched.name} p={sched.p} v={sched.v} m={sched.m}; measured band: step {comp.shown_step} (the median "
             f"one); costs: medians over {len(comp.per_step)} steps; {costs.blocked} of {costs.received} received "
             f"tensors timed a transfer"]
    parts, y = [], 20
    if title:
        parts.append(f'<text x="{_LEFT}" y="{y}" font-size="15" font-weight="bold">{escape(title)}</text>')
        y += 20
    for line in lines:
        parts.append(f'<text x="{_LEFT}" y="{y}" fill="#333">{escape(line)}</text>')
        y += 16
    return parts


def _row(label: str, events: list[Event], y: float, sx: float, p: int) -> list[str]:
    """One rank's row: its label, the bubble as background, a box per event (compute labelled)."""
    plot_w = max((e.end for e in events), default=0.0) * sx
    parts = [f'<text x="{_LEFT - 8}" y="{y + _ROW_H / 2 + 4}" text-anchor="end" font-weight="bold">'
             f'{escape(label)}</text>',
             f'<rect x="{_LEFT}" y="{y}" width="{plot_w:.1f}" height="{_ROW_H}" fill="{_IDLE}"/>']
    for e in events:
        x, w = _LEFT + e.start * sx, max((e.end - e.start) * sx, 0.6)
        tip = escape(f"{e.kind} {e.name}: {e.start * 1e3:.3f}-{e.end * 1e3:.3f} ms")
        if e.kind in ("wait", "comm"):
            fill = "url(#wait)" if e.kind == "wait" else _COMM
            parts.append(f'<rect x="{x:.2f}" y="{y + 4}" width="{w:.2f}" height="{_ROW_H - 8}" fill="{fill}">'
                         f'<title>{tip}</title></rect>')
            continue
        parts.append(f'<rect x="{x:.2f}" y="{y}" width="{w:.2f}" height="{_ROW_H}" fill="{_colour(e, p)}" '
                     f'stroke="white" stroke-width="0.7"><title>{tip}</title></rect>')
        if w >= 6.0 * len(e.name) + 3:
            parts.append(f'<text x="{x + w / 2:.2f}" y="{y + _ROW_H / 2 + 4:.1f}" fill="white" font-size="10" '
                         f'text-anchor="middle">{escape(e.name)}</text>')
    return parts


def write_comparison_svg(comp: Comparison, path: str, title: str = "", width: int = 1400) -> str:
    """Write ``comparison_svg(comp)`` to ``path``; returns the path."""
    with open(path, "w", encoding="utf-8") as fh:
        fh.write(comparison_svg(comp, title, width))
    return path
