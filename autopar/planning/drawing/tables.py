"""Rich tables that never cut a number: the plan, the program summary, the measured steps.

Rich fits a table to its console by shrinking columns, wrapping their cells
and, when that is not enough, cutting them with an ellipsis; printed to a
file or a pipe its console is 80 columns unless told otherwise. A number or
a name cut that way is a wrong number. ``compact_table`` makes every column
``no_wrap`` and at least as wide as its longest cell, except the prose
columns named in ``wrap`` (which wrap at spaces), and spends one space
between columns and no frame, so a table of numbers takes about the width
of its widest row. ``PIPED_WIDTH`` is the width the commands print at when
the output is not a terminal.
"""

from __future__ import annotations

from collections.abc import Sequence

from rich import box
from rich.table import Table

from autopar.planning.errors import PlanError

__all__ = ["PIPED_WIDTH", "compact_table"]

PIPED_WIDTH = 120
"""Columns of the output when it is not a terminal (a file, a pipe, a test's capture)."""


def compact_table(title: str | None, columns: Sequence[str], rows: Sequence[Sequence[str]], *,
                  caption: str | None = None, left: Sequence[str] = (), wrap: Sequence[str] = (),
                  styles: Sequence[str | None] = ()) -> Table:
    """A table of ``rows`` (strings, one per column) under ``columns``: a rule under the header,
    one space between columns, numbers right-aligned and the ``left`` (text) columns left-aligned.
    A cell of a column not in ``wrap`` is never wrapped or cut (the column is at least as wide
    as its longest cell); ``wrap`` columns (prose) wrap at spaces when the console is too narrow.
    ``styles[i]`` styles row i (None: plain). The table is as wide as its title (columns spread)
    up to the console's width; a longer title and the caption wrap at spaces."""
    bad = [i for i, r in enumerate(rows) if len(r) != len(columns)]
    if bad:
        raise PlanError(f"rows {bad} of table {title!r} do not have one cell per column ({len(columns)}: "
                         f"{', '.join(columns)})")
    tb = Table(title=title, caption=caption, box=box.SIMPLE_HEAD, padding=(0, 1), pad_edge=False,
               collapse_padding=True, show_edge=False, caption_justify="left",
               min_width=len(title) if title else None)  # the title on one line where the console allows
    for i, col in enumerate(columns):
        justify = "left" if col in left or col in wrap else "right"
        if col in wrap:
            tb.add_column(col, justify=justify)
            continue
        widest = max([len(col)] + [len(r[i]) for r in rows])
        tb.add_column(col, justify=justify, no_wrap=True, min_width=widest, overflow="fold")
    for r, style in zip(rows, list(styles) + [None] * (len(rows) - len(styles))):
        tb.add_row(*r, style=style)
    return tb
