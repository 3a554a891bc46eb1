"""The rank x time grid: a schedule as text, one row per stage, and back.

::

    gpipe p=2 v=1 m=2
    step     0    1    2    3
    stage 0: F0.0 F0.1 B0.0 B0.1
    stage 1: F1.0 F1.1 B1.0 B1.1

A forward-only (evaluation) schedule's header ends with ``forward-only``; a
schedule whose chunks are not interleaved names its placement
(``zbv p=2 v=2 m=4 placement=v``). W actions (weight gradients) print as ``W2.0``.
``format_grid`` prints it (marked actions as ``[F2.0]``, optionally clipped to
some columns); ``read_grid`` reads an unclipped one back into the parts of a
``Schedule`` (``autopar.schedules.parse_grid`` builds the Schedule).
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping, Sequence

from autopar.schedules.actions import Action, Loc
from autopar.schedules.errors import ScheduleError

__all__ = ["format_grid", "wrap_grid", "read_grid", "FORWARD_ONLY"]

FORWARD_ONLY = "forward-only"
"""The last word of a forward-only schedule's header (``1f1b p=2 v=1 m=4 forward-only``)."""


def format_grid(header: str, actions: Mapping[int, Sequence[Action]], marks: Iterable[Loc] = (),
                columns: tuple[int, int] | None = None) -> str:
    """``header`` (e.g. ``gpipe p=2 v=1 m=2``), then the step numbers, then one row per stage.

    Marked actions print as ``[F2.0]``. ``columns=(lo, hi)`` clips the grid to
    steps ``lo .. hi-1`` (shown with ``...``; a clipped grid does not parse back).
    """
    marked = set(marks)
    stages = sorted(actions)
    steps = max((len(acts) for acts in actions.values()), default=0)
    lo, hi = columns if columns is not None else (0, steps)
    lo, hi = max(0, lo), min(steps, hi)

    def cell(s: int, t: int) -> str:
        acts = actions[s]
        if t >= len(acts):
            return ""
        return f"[{acts[t]}]" if (s, t) in marked else str(acts[t])

    cells = {s: [cell(s, t) for t in range(lo, hi)] for s in stages}
    widths = [max([len(str(lo + j))] + [len(cells[s][j]) for s in cells]) for j in range(hi - lo)]
    label_width = len(f"stage {stages[-1]}:") if stages else 0
    head = "... " if lo > 0 else ""
    tail = " ..." if hi < steps else ""

    def row(label: str, items: list[str]) -> str:
        body = " ".join(item.ljust(w) for item, w in zip(items, widths, strict=True))
        return f"{label.ljust(label_width)} {head}{body}{tail}".rstrip()

    lines = [header, row("step", [str(t) for t in range(lo, hi)])]
    lines += [row(f"stage {s}:", cells[s]) for s in stages]
    return "\n".join(lines)


def wrap_grid(header: str, actions: Mapping[int, Sequence[Action]], width: int = 100) -> str:
    """The grid of :func:`format_grid` cut into blocks of consecutive steps, each block no wider than
    ``width`` characters (at least one step per block), for printing in a terminal."""
    steps = max((len(acts) for acts in actions.values()), default=0)
    label = len(f"stage {max(actions)}:") + 1 if actions else 0
    blocks, lo, used = [], 0, label + 8  # room for the "... " and " ..." of a clipped block
    for t in range(steps):
        w = max([len(str(t))] + [len(str(acts[t])) for acts in actions.values() if t < len(acts)]) + 1
        if used + w > width and t > lo:
            blocks.append((lo, t))
            lo, used = t, label + 8
        used += w
    blocks.append((lo, steps))
    parts = [format_grid(header, actions, columns=c) for c in blocks]
    return "\n".join([parts[0]] + [p.split("\n", 1)[1] for p in parts[1:]])


def read_grid(text: str) -> tuple[str, int, int, int, dict[int, list[Action]], bool, str]:
    """``(name, p, v, m, actions, forward_only, placement)`` of an unclipped grid; marks ``[..]``
    are ignored; the placement is 'interleaved' unless the header names one."""
    lines = [line.strip() for line in text.strip().splitlines() if line.strip()]
    if not lines:
        raise ScheduleError("cannot parse an empty schedule grid")
    head = re.fullmatch(rf"(\S+) p=(\d+) v=(\d+) m=(\d+)(?: placement=(\S+))?( {FORWARD_ONLY})?", lines[0])
    if head is None:
        raise ScheduleError(f"grid header {lines[0]!r} should read '<name> p=<p> v=<v> m=<m>', "
                         f"optionally followed by ' placement=<placement>' and ' {FORWARD_ONLY}'")
    name, p, v, m = head.group(1), *map(int, head.groups()[1:4])
    actions: dict[int, list[Action]] = {}
    for line in lines[1:]:
        if line.startswith("step"):
            continue
        row = re.fullmatch(r"stage (\d+):(.*)", line)
        if row is None:
            raise ScheduleError(f"cannot parse grid line {line!r}: expected 'stage <r>: <actions>'")
        tokens = row.group(2).split()
        if "..." in tokens:
            raise ScheduleError(
                "cannot parse a clipped grid (it shows '...'); format it without columns="
            )
        actions[int(row.group(1))] = [Action.parse(tok.strip("[]")) for tok in tokens]
    return name, p, v, m, actions, head.group(6) is not None, head.group(5) or "interleaved"
