"""What a pipeline stage does, one step at a time: :class:`Action` and its text form.

Vocabulary: ``p`` pipeline stages, ``v`` virtual chunks per stage, so ``p*v``
model chunks ``0 .. p*v-1``, placed on stages by the schedule's placement
(``placement.py``: interleaved ``c % p``, or V). ``m`` microbatches ``0 .. m-1``.

Text forms (compact, parsed back exactly by :meth:`Action.parse`)::

    F2.0      forward of chunk 2, microbatch 0
    B2.0      backward of chunk 2, microbatch 0 (its input gradient only, if the schedule has W)
    W2.0      weight gradient of chunk 2, microbatch 0 (zero-bubble schedules)
    SF2.0>3   send chunk 2's output activation (microbatch 0) to stage 3
    RF3.0<2   receive chunk 3's input activation (microbatch 0) from stage 2
    SB3.0>2   send the gradient of chunk 3's input to stage 2
    RB2.0<3   receive the gradient of chunk 2's output from stage 3

A communication action always names the *local* chunk it belongs to, so
``SF c.i`` on one stage matches ``RF c+1.i`` on the peer, and ``SB c.i``
matches ``RB c-1.i``.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from enum import Enum
from fractions import Fraction

from autopar.schedules.errors import ScheduleError

__all__ = ["Kind", "Action", "Time", "Key", "Loc"]

Time = int | float | Fraction
"""A duration or a point in time; pass :class:`~fractions.Fraction` costs for exact results."""

Key = tuple["Kind", int, int]
"""(kind, chunk, microbatch): identifies an action within a valid schedule."""
Loc = tuple[int, int]
"""(stage, index in that stage's action list)."""


class Kind(str, Enum):
    """What an action does; the value is its short text code."""

    F = "F"
    """Forward of one chunk for one microbatch."""
    B = "B"
    """Backward of one chunk for one microbatch: input and weight gradients, or, in a schedule
    that splits its backwards (one with W actions), the input gradient only."""
    W = "W"
    """Weight gradient of one chunk for one microbatch (the second half of a split backward):
    needs only its B, sends nothing, and must run before the step's optimizer update."""
    SEND_F = "SF"
    """Send the chunk's output activation to the next chunk's stage."""
    RECV_F = "RF"
    """Receive the chunk's input activation from the previous chunk's stage."""
    SEND_B = "SB"
    """Send the gradient of the chunk's input to the previous chunk's stage."""
    RECV_B = "RB"
    """Receive the gradient of the chunk's output from the next chunk's stage."""


_COMPUTE = frozenset({Kind.F, Kind.B, Kind.W})

_ACTION_RE = re.compile(r"(SF|RF|SB|RB|F|B|W)(\d+)\.(\d+)(?:([<>])(\d+))?")


@dataclass(frozen=True, slots=True, repr=False)
class Action:
    """One step of one stage: ``kind`` of ``chunk`` for ``microbatch``.

    ``peer`` is the other stage of a send or receive and ``None`` for compute.
    """

    kind: Kind
    """F, B, W, or one of the four point-to-point kinds."""
    chunk: int
    """The local model chunk the action belongs to (0 .. p*v-1)."""
    microbatch: int
    """Microbatch index (0 .. m-1)."""
    peer: int | None = None
    """The stage sent to / received from; None for F, B and W."""

    def __post_init__(self) -> None:
        if type(self.kind) is not Kind:
            object.__setattr__(self, "kind", Kind(self.kind))
        if self.chunk < 0 or self.microbatch < 0:
            raise ScheduleError(
                f"negative chunk or microbatch in {self.kind.value}{self.chunk}.{self.microbatch}"
            )
        compute = self.kind in _COMPUTE
        if compute != (self.peer is None):
            what = "must not have" if compute else "needs"
            raise ScheduleError(
                f"a {self.kind.name} action {what} a peer stage (got peer={self.peer})"
            )

    @property
    def is_compute(self) -> bool:
        """True for F, B and W."""
        return self.peer is None  # __post_init__ ties the peer to the kind

    @property
    def is_comm(self) -> bool:
        """True for the four send/receive kinds."""
        return self.peer is not None

    @property
    def is_send(self) -> bool:
        return self.kind is Kind.SEND_F or self.kind is Kind.SEND_B

    @property
    def is_recv(self) -> bool:
        return self.kind is Kind.RECV_F or self.kind is Kind.RECV_B

    @property
    def key(self) -> Key:
        """``(kind, chunk, microbatch)``: identifies the action within a schedule."""
        return (self.kind, self.chunk, self.microbatch)

    def __str__(self) -> str:
        text = f"{self.kind.value}{self.chunk}.{self.microbatch}"
        if self.peer is not None:
            text += (">" if self.is_send else "<") + str(self.peer)
        return text

    __repr__ = __str__

    @classmethod
    def parse(cls, text: str) -> Action:
        """Inverse of ``str``: ``Action.parse("SF2.0>3") == Action(Kind.SEND_F, 2, 0, 3)``."""
        match = _ACTION_RE.fullmatch(text.strip())
        if match is None:
            raise ScheduleError(
                f"cannot parse action {text!r}: expected e.g. 'F2.0', 'B2.0', 'W2.0', 'SF2.0>3', 'RF3.0<2'"
            )
        code, chunk, microbatch, arrow, peer = match.groups()
        action = cls(Kind(code), int(chunk), int(microbatch), None if peer is None else int(peer))
        if arrow is not None and arrow != (">" if action.is_send else "<"):
            raise ScheduleError(f"cannot parse action {text!r}: sends use '>peer', receives '<peer'")
        return action
