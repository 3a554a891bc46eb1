"""``PlanError``: what the planning floor raises when it refuses its input.

A layout that breaks a rule, a model or hardware profile it does not know, a
trace it cannot read or that does not match its schedule: each is a
``PlanError``, an ``AutoparError`` and a ``ValueError`` (so ``except
ValueError`` keeps catching it).
"""

from __future__ import annotations

from autopar.core.errors import AutoparError

__all__ = ["PlanError", "MissingCostError"]


class PlanError(AutoparError, ValueError):
    """The planning floor refused its input: the message says what is wrong and the fix."""


class MissingCostError(PlanError, KeyError):
    """A schedule asked for the measured cost of an action its trace does not hold (also a ``KeyError``)."""
