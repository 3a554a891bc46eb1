"""Pictures of a simulated pipeline step: a rich timeline for the terminal and
an SVG file. Ranks (stages) are rows, time runs left to right; forwards are
blue, backwards green (darker for later chunks), sends grey, and the empty
space in between is the bubble, drawn in red so it can be seen.
"""

from __future__ import annotations

from html import escape

from rich.text import Text

from autopar.simulate import Event, SimResult

__all__ = ["timeline_text", "timeline_svg", "write_svg"]

_F_COLOURS = ("#4c78a8", "#2f5d8a", "#6b98c7", "#1d3f66")
_B_COLOURS = ("#54a24b", "#3b7d34", "#7cc474", "#25591f")
_COMM = "#9e9e9e"
_IDLE = "#f6d2d2"


def _colour(e: Event, p: int) -> str:
    local = e.chunk // max(p, 1)
    if e.kind == "F":
        return _F_COLOURS[local % len(_F_COLOURS)]
    if e.kind == "B":
        return _B_COLOURS[local % len(_B_COLOURS)]
    return _COMM


def _label(e: Event) -> str:
    return e.label if e.kind in ("F", "B") else ""


def timeline_text(sim: SimResult, width: int = 100, unit: str = "s") -> Text:
    """The step as rich Text, ``width`` cells of time per rank.

    A cell shows what occupies its middle instant: forward (blue), backward
    (green), send (grey) or nothing (red dots: the bubble). Wide enough
    actions carry their ``chunk.microbatch`` label.
    """
    sched = sim.schedule
    span = sim.step_time or 1.0
    scale = span / width
    out = Text()
    head = (f"{sched.name} p={sched.p} v={sched.v} m={sched.m}: step {sim.step_time:.4g} {unit}, "
            f"bubble {sim.bubble:.1%} (idle / compute, worst stage)\n")
    out.append(head, style="bold")
    lab_w = len(f"rank {sched.p - 1} ")
    for s in range(sched.p):
        cells: list[tuple[str, str]] = [("·", "red")] * width
        for e in sim.events[s]:
            a = int(e.start / scale + 0.5)
            z = max(int(e.end / scale + 0.5), a + 1 if e.end > e.start else a)
            a, z = min(a, width), min(z, width)
            style = f"white on {_colour(e, sched.p)}"
            text = f"{e.chunk}.{e.microbatch}" if e.kind in ("F", "B") else ""
            for k in range(a, z):
                ch = text[k - a] if k - a < len(text) and (z - a) >= len(text) else " "
                cells[k] = (ch, style)
        out.append(f"rank {s}".ljust(lab_w), style="bold")
        for ch, style in cells:
            out.append(ch, style=style)
        out.append("\n")
    out.append("legend: ", style="bold")
    out.append(" F ", style=f"white on {_F_COLOURS[0]}")
    out.append(" forward  ")
    out.append(" B ", style=f"white on {_B_COLOURS[0]}")
    out.append(" backward (+recompute)  ")
    out.append("   ", style=f"on {_COMM}")
    out.append(" send  ")
    out.append("···", style="red")
    out.append(" bubble;  labels are chunk.microbatch, darker shades for later chunks")
    return out


def timeline_svg(sim: SimResult, title: str = "", width: int = 1200, row_h: int = 28, unit: str = "s") -> str:
    """The step as an SVG document (a string)."""
    sched = sim.schedule
    left, top, right = 70, 46 if title else 26, 20
    plot_w = width - left - right
    span = sim.step_time or 1.0
    sx = plot_w / span
    height = top + sched.p * (row_h + 6) + 60
    parts = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
        f'font-family="Helvetica, Arial, sans-serif" font-size="11">',
        '<rect width="100%" height="100%" fill="white"/>',
    ]
    if title:
        parts.append(f'<text x="{left}" y="20" font-size="14" font-weight="bold">{escape(title)}</text>')
    sub = (f"{sched.name} p={sched.p} v={sched.v} m={sched.m} | step {sim.step_time:.4g} {unit} | "
           f"bubble {sim.bubble:.1%}")
    parts.append(f'<text x="{left}" y="{top - 8}" fill="#444">{escape(sub)}</text>')
    for s in range(sched.p):
        y = top + s * (row_h + 6)
        parts.append(f'<text x="{left - 8}" y="{y + row_h / 2 + 4}" text-anchor="end">rank {s}</text>')
        parts.append(f'<rect x="{left}" y="{y}" width="{plot_w:.1f}" height="{row_h}" fill="{_IDLE}">'
                     f'<title>bubble (idle)</title></rect>')
        for e in sim.events[s]:
            x, w = left + e.start * sx, max((e.end - e.start) * sx, 0.5)
            tip = f"{e.label}: {e.start:.4g}-{e.end:.4g} {unit}"
            parts.append(f'<rect x="{x:.2f}" y="{y}" width="{w:.2f}" height="{row_h}" '
                         f'fill="{_colour(e, sched.p)}" stroke="white" stroke-width="0.5">'
                         f'<title>{escape(tip)}</title></rect>')
            lab = _label(e)
            if lab and w >= 7 * len(lab):
                parts.append(f'<text x="{x + w / 2:.2f}" y="{y + row_h / 2 + 4}" fill="white" '
                             f'text-anchor="middle">{escape(lab)}</text>')
            elif lab and w >= 6 * (len(lab) - 1):
                short = f"{e.chunk}.{e.microbatch}"
                parts.append(f'<text x="{x + w / 2:.2f}" y="{y + row_h / 2 + 4}" fill="white" '
                             f'font-size="9" text-anchor="middle">{escape(short)}</text>')
    # time axis
    ya = top + sched.p * (row_h + 6) + 4
    parts.append(f'<line x1="{left}" y1="{ya}" x2="{left + plot_w}" y2="{ya}" stroke="#333"/>')
    for k in range(11):
        x = left + plot_w * k / 10
        parts.append(f'<line x1="{x:.1f}" y1="{ya}" x2="{x:.1f}" y2="{ya + 4}" stroke="#333"/>')
        parts.append(f'<text x="{x:.1f}" y="{ya + 16}" text-anchor="middle">{span * k / 10:.3g}</text>')
    parts.append(f'<text x="{left + plot_w}" y="{ya + 30}" text-anchor="end">time ({unit})</text>')
    # legend
    ly = ya + 30
    items = [(_F_COLOURS[0], "forward"), (_B_COLOURS[0], "backward (+recompute)"), (_COMM, "send"),
             (_IDLE, "bubble")]
    x = left
    for colour, name in items:
        parts.append(f'<rect x="{x}" y="{ly - 10}" width="14" height="12" fill="{colour}" stroke="#999"/>')
        parts.append(f'<text x="{x + 18}" y="{ly}">{escape(name)}</text>')
        x += 30 + 7 * len(name)
    parts.append(f'<text x="{x}" y="{ly}" fill="#444">labels: F/B chunk.microbatch; darker = later chunk</text>')
    parts.append("</svg>")
    return "\n".join(parts)


def write_svg(sim: SimResult, path: str, title: str = "", unit: str = "s") -> str:
    """Write ``timeline_svg(sim)`` to ``path``; returns the path."""
    with open(path, "w", encoding="utf-8") as fh:
        fh.write(timeline_svg(sim, title=title, unit=unit))
    return path
