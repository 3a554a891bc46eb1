"""The errors of gradient synchronisation and the optimizers: bad input, a wrong kind, a wrong order.

Each derives from ``AutoparError`` and from the built-in it stands for, so
``except ValueError`` (``TypeError``, ``RuntimeError``) keeps working.
"""

from __future__ import annotations

from autopar.core.errors import AutoparError

__all__ = ["OptimizerError", "OptimizerTypeError", "StepOrderError"]


class OptimizerError(AutoparError, ValueError):
    """An optimizer or a gradient reduction given something it cannot take (a tensor that is not
    one of the engine's parameters, a state saved for another layout)."""


class OptimizerTypeError(AutoparError, TypeError):
    """An optimizer class the distributed optimizer cannot wrap (not element-wise, not an optimizer)."""


class StepOrderError(AutoparError, RuntimeError):
    """A call out of its order: a distributed optimizer made twice or over gradients already held, a
    parameter group added after the layout, a weight backward before its input backward."""
