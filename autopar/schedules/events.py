"""``Event``: one thing one pipeline rank did, from when to when.

The same record for a simulated step (``autopar.schedules.simulator``), its
pictures (``autopar.planning.drawing.timeline``) and a measured one (the runtime's
``autopar.runtime.engine.timeline``), so a prediction and a measurement can be laid
side by side.
"""

from __future__ import annotations

from dataclasses import dataclass

from autopar.schedules.actions import Action, Time

__all__ = ["Event", "EVENT_KINDS"]

EVENT_KINDS: tuple[str, ...] = ("F", "B", "W", "comm", "wait")


@dataclass(frozen=True, slots=True)
class Event:
    """One action (or one batch of sends and receives) of one rank in time."""

    rank: int
    """Who ran it: the pipeline stage in a simulated step, the global rank in a measured one."""
    kind: str
    """``F``, ``B``, ``W`` (a weight gradient), ``comm`` (a transfer, a blocking send, or a batch of sends and receives)
    or ``wait`` (an exchange posted, waiting for its partner to post its side)."""
    name: str
    """The action's text (``F2.0``, ``SF2.0>3``), or the actions of a batch (``SF0.1>1 RB2.0<1``)."""
    start: Time
    """Seconds (or the costs' units) since the start of the step."""
    end: Time

    @property
    def action(self) -> Action | None:
        """The F, B or W this event ran, read from its name; None for transfers and waits."""
        return Action.parse(self.name) if self.kind in ("F", "B", "W") else None
