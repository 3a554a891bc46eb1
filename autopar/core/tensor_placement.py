"""Tensor-parallel placements of a value: how a global tensor lives on t ranks.

- ``Replicate()``           every rank holds the whole tensor.
- ``Shard(dim, segments)``  dimension ``dim`` is split t ways. With ``segments``
                            the dimension is first cut into contiguous segments
                            (a fused QKV output is ``(C, C, C)``) and *each*
                            segment is split t ways; rank i holds the
                            concatenation of every segment's i-th piece. The
                            segment sizes are global and may include padding
                            (a vocabulary of 50,257 padded to 50,258 for t=2).
- ``Partial()``             every rank holds a summand; the value is their sum.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from autopar.core.errors import AutoparError

__all__ = ["Placement", "Replicate", "Shard", "Partial", "local_size", "PlacementError"]


class PlacementError(AutoparError, ValueError):
    """A placement that cannot hold a tensor: a dimension or segment that does not split t ways."""


@dataclass(frozen=True)
class Replicate:
    def __repr__(self) -> str:
        return "R"


@dataclass(frozen=True)
class Partial:
    def __repr__(self) -> str:
        return "P"


@dataclass(frozen=True)
class Shard:
    dim: int
    """Tensor dimension split across the tensor-parallel ranks (non-negative)."""
    segments: tuple[int, ...] | None = None
    """Global sizes of the contiguous segments each split t ways; None = one segment."""
    origin: str | None = field(default=None, compare=False)
    """Name of the node that introduced the split (for messages), not part of equality."""

    def __repr__(self) -> str:
        seg = "" if self.segments is None or len(self.segments) == 1 else f",{list(self.segments)}"
        return f"S({self.dim}{seg})"


Placement = Replicate | Shard | Partial


def local_size(size: int, placement: Shard, tp: int) -> int:
    """Size of the sharded dimension on one rank: sum over segments of seg/tp."""
    segs = placement.segments if placement.segments is not None else (size,)
    for s in segs:
        if s % tp:
            raise PlacementError(f"segment of size {s} does not split {tp} ways")
    return sum(s // tp for s in segs)
