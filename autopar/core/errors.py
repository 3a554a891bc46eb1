"""``AutoparError``: the one base of every error autopar raises on purpose; ``ConfigError``, a bad layout.

Each error names what is wrong, where (module path, graph node, source
line), the numbers and the fix; its class says which part refused
(``ShardingError`` from the sharding pass, ``CheckpointError`` from a
checkpoint, ...). Every such class derives from ``AutoparError`` and from the
built-in exception that fits it (``ValueError`` for bad input,
``RuntimeError`` for a failure while running), so a user can catch all of
autopar's refusals with one ``except autopar.AutoparError`` or keep catching
the built-in kind.

``ConfigError`` is the refusal of a parallel layout or training option before
anything runs (``ParallelConfig``, ``MeshShape``, a mesh for the wrong world).
"""

from __future__ import annotations

__all__ = ["AutoparError", "ConfigError"]


class AutoparError(Exception):
    """An error autopar raises on purpose: the message says what is wrong, where, and the fix."""


class ConfigError(AutoparError, ValueError):
    """A parallel layout or training option that cannot be: the message shows the numbers and the fix."""
