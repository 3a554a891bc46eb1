"""Pictures of a simulated pipeline step: a rich timeline for the terminal and
an SVG file.

Pipeline stages are rows, time runs left to right. Forwards are blue,
backwards green (in a zero-bubble schedule, B: the input gradient), weight
gradients (W, zero-bubble schedules) orange, one shade per model chunk of the
stage (lighter = the stage's first chunk: chunk ``c < p`` both interleaved and
in ZB-V's V); each box is labelled ``F<chunk>.<microbatch>`` (or
``<chunk>.<microbatch>`` when narrow; every box has a tooltip). Transfers are
dark grey, an exchange posted and waiting for its partner is hatched grey,
and the bubble (a stage with nothing to do) is pale red.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from html import escape

from rich.text import Text

from autopar.schedules import Event, Sends, SimResult

__all__ = ["timeline_text", "timeline_svg", "write_svg", "svg_time_axis"]

# one shade per local chunk (chunk // p), lightest first
_F_COLOURS = ("#6b9bd1", "#3f74b5", "#21508f", "#11335f")
_B_COLOURS = ("#74c476", "#41a046", "#23782f", "#0f4d1c")
_W_COLOURS = ("#f0a04b", "#d9771f", "#a8540c", "#733604")
_COMPUTE = {"F": _F_COLOURS, "B": _B_COLOURS, "W": _W_COLOURS}
_COMM = "#555555"
_WAIT = "#c8c8c8"
_IDLE = "#fadbd8"

_HOW = {
    Sends.POSTED: "lowered: non-blocking sends, receives awaited by their consumer, as autopar's runtime runs it",
    Sends.EAGER: "eager sends (the planner's model)",
    Sends.BATCHED: "batched exchanges, each waited for whole (dry run)",
}


def _short(e: Event) -> str:
    """``chunk.microbatch`` of an F, B or W event (its name without the kind)."""
    act = e.action
    return f"{act.chunk}.{act.microbatch}"


def _colour(e: Event, p: int) -> str:
    """Blue for a forward, green for a backward, orange for a weight gradient (darker for a stage's
    later chunks), grey otherwise."""
    if e.kind == "wait":
        return _WAIT
    if e.kind not in _COMPUTE:
        return _COMM
    colours = _COMPUTE[e.kind]
    return colours[(e.action.chunk // max(p, 1)) % len(colours)]


def _summary(sim: SimResult, unit: str) -> str:
    sched = sim.schedule
    how = _HOW[sim.sends]
    return (f"{sched.name} p={sched.p} v={sched.v} m={sched.m} ({how}): step {float(sim.step_time):.4g} {unit}, "
            f"bubble {float(sim.bubble):.1%} (idle / compute, worst stage; (p-1)/(v m) = "
            f"{(sched.p - 1) / (sched.v * sched.m):.1%})")


def timeline_text(sim: SimResult, width: int = 100, unit: str = "s") -> Text:
    """The step as rich Text, ``width`` cells of time per stage.

    A cell shows what occupies its middle instant: forward (blue), backward
    (green), transfer (dark grey), waiting on an exchange partner (``~``) or
    nothing (red dots: the bubble). Wide enough actions carry their
    ``chunk.microbatch`` label.
    """
    sched = sim.schedule
    span = float(sim.step_time or 1.0)
    scale = span / width
    out = Text()
    out.append(_summary(sim, unit) + "\n", style="bold")
    lab_w = len(f"stage {sched.p - 1} ")
    for s in range(sched.p):
        cells: list[tuple[str, str]] = [("·", "red")] * width
        for e in sim.events[s]:
            a = int(float(e.start) / scale + 0.5)
            z = max(int(float(e.end) / scale + 0.5), a + 1 if e.end > e.start else a)
            a, z = min(a, width), min(z, width)
            if e.kind == "wait":
                for k in range(a, z):
                    cells[k] = ("~", "grey50")
                continue
            style = f"white on {_colour(e, sched.p)}"
            text = _short(e) if e.kind in _COMPUTE else ""
            for k in range(a, z):
                ch = text[k - a] if k - a < len(text) and (z - a) >= len(text) else " "
                cells[k] = (ch, style)
        out.append(f"stage {s}".ljust(lab_w), style="bold")
        for ch, style in cells:
            out.append(ch, style=style)
        out.append("\n")
    out.append("legend: ", style="bold")
    out.append(" F ", style=f"white on {_F_COLOURS[0]}")
    out.append(" forward  ")
    out.append(" B ", style=f"white on {_B_COLOURS[0]}")
    out.append(" backward (+recompute)  ")
    if sched.splits_backward:
        out.append(" W ", style=f"white on {_W_COLOURS[0]}")
        out.append(" weight gradient (B: input gradient)  ")
    out.append("   ", style=f"on {_COMM}")
    out.append(" transfer  ")
    out.append("~~~", style="grey50")
    out.append(" waiting for the partner  ")
    out.append("···", style="red")
    out.append(" bubble;  labels are chunk.microbatch, darker shades for later chunks of a stage")
    return out


def _nice_step(span: float, target: int = 10) -> float:
    raw = span / max(target, 1)
    mag = 10 ** math.floor(math.log10(raw)) if raw > 0 else 1.0
    for k in (1, 2, 2.5, 5, 10):
        if raw <= k * mag:
            return k * mag
    return 10 * mag


def _auto_width(sim: SimResult, min_width: int = 1200, max_width: int = 16000, min_box: float = 30.0) -> int:
    """A width at which the shortest compute box is about ``min_box`` px wide (clamped)."""
    durs = [e.end - e.start for evs in sim.events.values() for e in evs if e.kind in _COMPUTE and e.end > e.start]
    if not durs or not sim.step_time:
        return min_width
    return int(min(max(min_width, 102 + min_box * sim.step_time / min(durs)), max_width))


def timeline_svg(sim: SimResult, title: str = "", width: int | None = None, row_h: int = 30, unit: str = "s",
                 notes: tuple[str, ...] = ()) -> str:
    """The step as an SVG document (a string).

    ``width`` None picks one at which the shortest compute box is about 30 px
    wide (1200 to 16000 px), so labels fit; ``notes`` are extra lines under the
    title.
    """
    p = sim.schedule.p
    width = width or _auto_width(sim)
    top = 30 + (22 if title else 0) + 16 * len(notes)
    frame = _Frame(left=78, top=top, plot_w=width - 78 - 24, sx=(width - 78 - 24) / float(sim.step_time or 1.0),
                   row_h=row_h, gap=8, unit=unit)
    axis_y = top + p * (row_h + frame.gap)
    height = axis_y + 92
    parts = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
        f'font-family="Helvetica, Arial, sans-serif" font-size="11">',
        "<defs><pattern id=\"wait\" width=\"6\" height=\"6\" patternUnits=\"userSpaceOnUse\" "
        "patternTransform=\"rotate(45)\"><rect width=\"6\" height=\"6\" fill=\"#e4e4e4\"/>"
        "<line x1=\"0\" y1=\"0\" x2=\"0\" y2=\"6\" stroke=\"#9a9a9a\" stroke-width=\"2\"/></pattern></defs>",
        '<rect width="100%" height="100%" fill="white"/>',
    ]
    parts += _svg_titles(sim, frame, title, notes)
    parts += _svg_time_axis(sim, frame, axis_y)
    for s in range(p):
        parts += _svg_stage_row(sim, frame, s)
    parts += _svg_legend(max(sim.schedule.v, 1), frame.left, axis_y + 52, sim.schedule.splits_backward)
    parts.append("</svg>")
    return "\n".join(parts)


@dataclass(frozen=True)
class _Frame:
    """Where the plot sits in the SVG: left edge and top of the rows, plot width, pixels per
    second, row height and the gap between rows, and the time unit."""

    left: int
    top: int
    plot_w: float
    sx: float
    row_h: int
    gap: int
    unit: str


def _svg_titles(sim: SimResult, frame: _Frame, title: str, notes: tuple[str, ...]) -> list[str]:
    """The title (bold), the summary line and the notes, each on its own line."""
    parts, y = [], 20
    if title:
        parts.append(f'<text x="{frame.left}" y="{y}" font-size="15" font-weight="bold">{escape(title)}</text>')
        y += 20
    parts.append(f'<text x="{frame.left}" y="{y}" fill="#333">{escape(_summary(sim, frame.unit))}</text>')
    for note in notes:
        y += 16
        parts.append(f'<text x="{frame.left}" y="{y}" fill="#333">{escape(note)}</text>')
    return parts


def _svg_time_axis(sim: SimResult, frame: _Frame, axis_y: float) -> list[str]:
    """Vertical grid lines at round times, the axis under the rows, its ticks and label."""
    return svg_time_axis(float(sim.step_time or 1.0), frame.left, frame.plot_w, frame.sx, frame.top, axis_y,
                         frame.unit)


def svg_time_axis(span: float, left: float, plot_w: float, sx: float, top: float, axis_y: float,
                  unit: str) -> list[str]:
    """SVG parts: grid lines at round times from ``top`` down to the axis at ``axis_y``, the axis
    from ``left`` over ``plot_w`` pixels, its ticks and its label; ``span`` in ``unit``s, ``sx``
    pixels per ``unit``."""
    step = _nice_step(span)
    parts, k = [], 0
    while k * step <= span * (1 + 1e-9):
        x = left + k * step * sx
        parts.append(f'<line x1="{x:.1f}" y1="{top - 4}" x2="{x:.1f}" y2="{axis_y}" stroke="#eeeeee"/>')
        parts.append(f'<line x1="{x:.1f}" y1="{axis_y}" x2="{x:.1f}" y2="{axis_y + 5}" stroke="#333"/>')
        parts.append(f'<text x="{x:.1f}" y="{axis_y + 17}" text-anchor="middle">{k * step:.4g}</text>')
        k += 1
    parts.append(f'<line x1="{left}" y1="{axis_y}" x2="{left + plot_w}" y2="{axis_y}" stroke="#333"/>')
    parts.append(f'<text x="{left + plot_w}" y="{axis_y + 32}" text-anchor="end">time ({unit})</text>')
    return parts


def _svg_stage_row(sim: SimResult, frame: _Frame, s: int) -> list[str]:
    """One stage: its label, the bubble as background, and a box per event (compute boxes labelled)."""
    y = frame.top + s * (frame.row_h + frame.gap)
    row_h, unit = frame.row_h, frame.unit
    parts = [f'<text x="{frame.left - 8}" y="{y + row_h / 2 + 4}" text-anchor="end" '
             f'font-weight="bold">stage {s}</text>',
             f'<rect x="{frame.left}" y="{y}" width="{frame.plot_w:.1f}" height="{row_h}" fill="{_IDLE}">'
             f'<title>bubble (idle)</title></rect>']
    for e in sim.events[s]:
        start, end = float(e.start), float(e.end)
        x, w = frame.left + start * frame.sx, max((end - start) * frame.sx, 0.6)
        tip = f"{e.name}: {start:.4g}-{end:.4g} {unit}"
        if e.kind == "wait":
            tip = f"waiting for the partner of {e.name}: {start:.4g}-{end:.4g} {unit}"
            parts.append(f'<rect x="{x:.2f}" y="{y + 4}" width="{w:.2f}" height="{row_h - 8}" '
                         f'fill="url(#wait)"><title>{escape(tip)}</title></rect>')
            continue
        if e.kind == "comm":
            parts.append(f'<rect x="{x:.2f}" y="{y + 4}" width="{w:.2f}" height="{row_h - 8}" '
                         f'fill="{_COMM}"><title>{escape("transfer " + tip)}</title></rect>')
            continue
        parts.append(f'<rect x="{x:.2f}" y="{y}" width="{w:.2f}" height="{row_h}" '
                     f'fill="{_colour(e, sim.schedule.p)}" stroke="white" stroke-width="0.7">'
                     f'<title>{escape(tip)}</title></rect>')
        full, short = e.name, _short(e)
        for lab, size, cw in ((full, 11, 6.6), (short, 10, 6.0), (short, 8, 4.9)):
            if w >= cw * len(lab) + 3:
                parts.append(f'<text x="{x + w / 2:.2f}" y="{y + row_h / 2 + size / 2 - 1:.1f}" '
                             f'fill="white" font-size="{size}" text-anchor="middle">{escape(lab)}</text>')
                break
    return parts


def _svg_legend(v: int, left: int, ly: float, split: bool = False) -> list[str]:
    """Swatches for forward and backward (one shade per chunk of a stage), the weight gradient when
    the backward is ``split`` (zero-bubble schedules), waiting, transfer and the bubble, and a line
    on how to read the labels."""
    parts, x = [], left
    kinds = [(_F_COLOURS, "forward"), (_B_COLOURS, "input gradient (B)" if split else "backward (+recompute)")]
    kinds += [(_W_COLOURS, "weight gradient (W)")] if split else []
    for colours, name in kinds:
        for k in range(min(v, len(colours))):
            parts.append(f'<rect x="{x + 15 * k}" y="{ly - 11}" width="14" height="14" fill="{colours[k]}"/>')
        x += 15 * min(v, len(colours)) + 4
        parts.append(f'<text x="{x}" y="{ly}">{escape(name)}</text>')
        x += 14 + 6.5 * len(name)
    for fill, name in (("url(#wait)", "waiting for the partner's send/receive"), (_COMM, "transfer"),
                       (_IDLE, "bubble (idle)")):
        parts.append(f'<rect x="{x}" y="{ly - 11}" width="14" height="14" fill="{fill}" stroke="#999"/>')
        parts.append(f'<text x="{x + 18}" y="{ly}">{escape(name)}</text>')
        x += 34 + 6.5 * len(name)
    shades = (f"shades: the stage's model chunks 0..{v - 1} (shade k: chunk c with c // p = k), lightest first; "
              if v > 1 else "")
    parts.append(f'<text x="{left}" y="{ly + 20}" fill="#444">labels: F/B/W chunk.microbatch; {shades}'
                 f'hover a box for its times</text>')
    return parts


def write_svg(sim: SimResult, path: str, title: str = "", unit: str = "s", notes: tuple[str, ...] = (),
              width: int | None = None) -> str:
    """Write ``timeline_svg(sim)`` to ``path``; returns the path."""
    with open(path, "w", encoding="utf-8") as fh:
        fh.write(timeline_svg(sim, title=title, unit=unit, notes=notes, width=width))
    return path
