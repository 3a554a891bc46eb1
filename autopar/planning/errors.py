"""``PlanError``: what the planning floor raises when it refuses its input.

A layout that breaks a rule, a model or hardware profile it does not know, a
trace it cannot read or that does not match its schedule: each is a
``PlanError``, an ``AutoparError`` and a ``ValueError`` (so ``except
ValueError`` keeps catching it).
"""

from __future__ import annotations

from autopar.core.errors import AutoparError

__all__ = ["PlanError", "MissingCostError", "HardwareProfileError", "ProfileVersionError", "ProfileFieldError",
           "ProfileCoverageError"]


class PlanError(AutoparError, ValueError):
    """The planning floor refused its input: the message says what is wrong and the fix."""


class MissingCostError(PlanError, KeyError):
    """A schedule asked for the measured cost of an action its trace does not hold (also a ``KeyError``)."""


class HardwareProfileError(PlanError):
    """A hardware profile (the JSON ``autopar tune`` writes) the planner cannot use: the message names
    the file, what is wrong, and the ``autopar tune`` command that measures what it needs."""


class ProfileVersionError(HardwareProfileError):
    """The profile's format version is not the one this autopar reads (or the file is no profile)."""


class ProfileFieldError(HardwareProfileError):
    """A field the format requires is missing, or holds a value of the wrong kind."""


class ProfileCoverageError(HardwareProfileError):
    """A layout needs a collective over a group size or placement the profile did not measure."""
