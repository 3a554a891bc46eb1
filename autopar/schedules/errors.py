"""``ScheduleError``: the one error class of the schedules, from a bad layout to a failed validation.

It lives apart from ``Schedule`` so that every module of the floor (actions, grids,
generators, the simulator) raises it without importing the schedule type.
"""

from __future__ import annotations

from collections.abc import Sequence

from autopar.core.errors import AutoparError

__all__ = ["ScheduleError"]


class ScheduleError(AutoparError, ValueError):
    """A schedule that cannot be (a bad layout, action or grid) or failed validation; a validation
    message shows the grid with the failing actions marked."""

    def __init__(self, message: str, marks: Sequence[tuple[int, int]] = ()) -> None:
        super().__init__(message)
        self.marks: tuple[tuple[int, int], ...] = tuple(marks)
        """(stage, index) of each marked action."""
