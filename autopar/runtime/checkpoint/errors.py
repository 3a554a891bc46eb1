"""The runtime's errors that users catch by name (re-exported from ``autopar``)."""

from __future__ import annotations

from autopar.core.errors import AutoparError

__all__ = ["CheckpointError", "CheckpointNotFoundError"]


class CheckpointError(AutoparError, ValueError):
    """A checkpoint (autopar's own or a HuggingFace one) that does not fit the program, cannot be read
    or cannot be written: what is missing or mis-shaped, where, and the fix. Raised on every rank."""


class CheckpointNotFoundError(CheckpointError, FileNotFoundError):
    """A checkpoint file or directory that is not there: a ``FileNotFoundError`` too."""
