"""``AutoparError``: the one base of every error autopar raises on purpose.

Each error names what is wrong, where (module path, graph node, source
line), the numbers and the fix; its class says which part refused
(``ShardingError`` from the sharding pass, ``CheckpointError`` from a
checkpoint, ...). Every such class derives from ``AutoparError`` and from the
built-in exception that fits it (``ValueError`` for bad input,
``RuntimeError`` for a failure while running), so a user can catch all of
autopar's refusals with one ``except autopar.AutoparError`` or keep catching
the built-in kind.
"""

from __future__ import annotations

__all__ = ["AutoparError"]


class AutoparError(Exception):
    """An error autopar raises on purpose: the message says what is wrong, where, and the fix."""
