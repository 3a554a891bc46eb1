"""``ExportError``: writing a HuggingFace directory failed while running.

What cannot be read or written as asked (a directory that is a file, a dtype
safetensors cannot store, a tensor transformers' conversion cannot make) is a
``CheckpointError``, the error of every checkpoint; ``ExportError`` is the
failure of the writing itself: a rank's file that could not be written, a
machine whose byte order safetensors does not use.
"""

from __future__ import annotations

from autopar.core.errors import AutoparError

__all__ = ["ExportError"]


class ExportError(AutoparError, RuntimeError):
    """Writing the export failed on one or more ranks; the message names each rank and why."""
