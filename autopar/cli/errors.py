"""``CliError``: a command line the ``autopar`` command refuses.

Each is an ``AutoparError`` and a ``ValueError``; ``autopar.cli.main`` prints it as
``autopar <command>: <message>`` and exits with status 2.
"""

from __future__ import annotations

from autopar.core.errors import AutoparError

__all__ = ["CliError"]


class CliError(AutoparError, ValueError):
    """A flag's value the command cannot use: the message names the flag and the fix."""
