"""Where each model chunk lives: the chunk placements of the pipeline schedules.

``p`` stages hold ``p*v`` chunks, ``v`` each. A placement maps chunk ``c`` to
its stage; every schedule carries one (``Schedule.placement``) and every rule
and count that needs a chunk's stage asks it (``Schedule.stage_of``):

``interleaved`` (GPipe, 1F1B, interleaved 1F1B, ZB-H1)
    chunk ``c`` on stage ``c % p``: the model goes down the stages ``v`` times,
    always from stage 0 to stage p-1.
``v`` (ZB-V)
    pass ``k = c // p`` goes down the stages when ``k`` is even and back up
    when it is odd: chunk ``c`` on stage ``c % p`` or ``p - 1 - c % p``. For
    ``v = 2`` that is the V of Qi et al.: chunk ``c < p`` on stage ``c``, chunk
    ``c >= p`` on stage ``2p - 1 - c``, so stage ``r`` holds chunks ``r`` and
    ``2p - 1 - r`` and the first and last chunks (embedding and loss) share
    stage 0. A chunk's neighbours at the turn (``p - 1`` and ``p``) share a
    stage, so that hop needs no message.
"""

from __future__ import annotations

from enum import Enum

from autopar.core.config import SCHEDULE_NAMES
from autopar.schedules.errors import ScheduleError

__all__ = ["Placement", "placement_of", "chunk_placement", "stage_of_chunk"]


class Placement(str, Enum):
    """How chunks are laid on stages; the value is its word in a grid header (``placement=v``)."""

    INTERLEAVED = "interleaved"
    """Chunk ``c`` on stage ``c % p``."""
    V = "v"
    """Down the stages and back up: chunk ``c`` on ``c % p`` for even ``c // p``, else ``p - 1 - c % p``."""

    def __str__(self) -> str:
        return self.value


def stage_of_chunk(placement: Placement, p: int, chunk: int) -> int:
    """The stage that holds ``chunk`` under ``placement`` with ``p`` stages."""
    offset = chunk % p
    if placement is Placement.V and (chunk // p) % 2 == 1:
        return p - 1 - offset
    return offset


def placement_of(name: str) -> Placement:
    """The placement the named schedule runs on: V for 'zbv', interleaved for the others."""
    if name not in SCHEDULE_NAMES:
        raise ScheduleError(f"unknown schedule {name!r}; known: {', '.join(SCHEDULE_NAMES)}")
    return Placement.V if name == "zbv" else Placement.INTERLEAVED


def chunk_placement(name: str, p: int, v: int) -> tuple[int, ...]:
    """The stage of each chunk ``0 .. p*v-1`` for schedule ``name``: what the compiler and the
    runtime need to put each chunk's parameters on the rank that runs it.

    ``chunk_placement("zbv", 4, 2) == (0, 1, 2, 3, 3, 2, 1, 0)``;
    ``chunk_placement("interleaved", 4, 2) == (0, 1, 2, 3, 0, 1, 2, 3)``.
    """
    if p < 1 or v < 1:
        raise ScheduleError(f"p and v must be positive, got p={p}, v={v}")
    placement = placement_of(name)
    return tuple(stage_of_chunk(placement, p, c) for c in range(p * v))
