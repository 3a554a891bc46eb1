"""``TraceError``, the error tracing raises, and which source files are tracing's own.

Tracing is three modules: ``trace.py`` (the export and what is read from it),
``custom_functions.py`` (custom ``torch.autograd.Function`` calls) and
``static_shapes.py`` (values whose shape depends on tensor values). All three
raise ``TraceError``; it lives here, below them, so that none of them imports
another to raise it. ``trace.py`` re-exports it, and ``autopar.TraceError``
is this class.

A frame in one of tracing's files is never the user's line: a failure's
explanation and a Function's call site skip them (``is_tracing_file``), as
does ``core/graph.py``'s ``source_line``.
"""

from __future__ import annotations

import os

from autopar.core.errors import AutoparError

__all__ = ["TraceError", "TRACING_FILES", "is_tracing_file"]


class TraceError(AutoparError, RuntimeError):
    """The model (with its loss) could not be traced; the message says where and what to try."""


TRACING_FILES = tuple(os.path.join("autopar", "compiler", name)
                      for name in ("trace.py", "custom_functions.py", "static_shapes.py", "trace_error.py"))
"""The files of autopar's tracing code, as the end of a path."""


def is_tracing_file(filename: str) -> bool:
    """Whether ``filename`` is one of tracing's own files (never the user's code)."""
    return filename.endswith(TRACING_FILES)
