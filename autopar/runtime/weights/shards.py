"""One rank's shard of a parameter, assembled from whatever holds the full tensor.

A parameter split ``Shard(dim, segments)`` over t ranks is, on rank r, the
concatenation of every segment's r-th 1/t along ``dim`` (``core.comm.local_slice``).
A padded dimension (a vocabulary of 257 padded to 258 for t=2) has segments
summing to more than the full size: rows past the end are zeros.

``shard_pieces`` says which rows of the full tensor those are, and
``assemble`` builds the shard from a ``read(start, stop)`` that returns rows
``[start, stop)`` of the full tensor along ``dim``: a narrow of a tensor in
memory, a sliced read of a checkpoint file. The shard is written piece by
piece into one tensor on the target device, so no padded or concatenated copy
of the full tensor is ever made.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from autopar.core.tensor_placement import PlacementError, Replicate, Shard

__all__ = ["Piece", "Reader", "shard_pieces", "assemble", "narrow_reader", "expert_slice"]

Reader = Callable[[int, int], torch.Tensor]
"""``read(start, stop)``: rows ``[start, stop)`` of the full tensor along the sharded dim
(the whole tensor when the parameter is replicated: then called once with ``(0, size)``)."""


@dataclass(frozen=True)
class Piece:
    """Consecutive rows of a shard: ``[start, stop)`` of the full tensor, then ``pad`` rows of zeros."""

    start: int
    stop: int
    pad: int

    @property
    def rows(self) -> int:
        return self.stop - self.start + self.pad


def shard_pieces(size: int, spec: Replicate | Shard, tp_rank: int, tp: int) -> list[Piece]:
    """The pieces of rank ``tp_rank``'s shard of a dimension of ``size`` rows, in order.

    Replicated: the whole dimension. Sharded: each segment's ``tp_rank``-th
    1/t, the part past ``size`` (padding) as zeros.
    """
    if not isinstance(spec, Shard):
        return [Piece(0, size, 0)]
    segments = spec.segments if spec.segments is not None else (size,)
    pieces, offset = [], 0
    for seg in segments:
        n = seg // tp
        lo = offset + tp_rank * n
        start, stop = min(lo, size), min(lo + n, size)
        pieces.append(Piece(start, stop, n - (stop - start)))
        offset += seg
    return pieces


def assemble(read: Reader, full_shape: tuple[int, ...], spec: Replicate | Shard, tp_rank: int, tp: int,
             dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Rank ``tp_rank``'s shard of a parameter of ``full_shape``, read piece by piece into one
    new tensor of ``dtype`` on ``device`` (padding rows zero)."""
    dim = spec.dim if isinstance(spec, Shard) else 0
    if not full_shape:  # a scalar parameter: nothing to split
        return read(0, 1).to(device=device, dtype=dtype, copy=True).reshape(())
    pieces = shard_pieces(full_shape[dim], spec, tp_rank, tp)
    shape = list(full_shape)
    shape[dim] = sum(p.rows for p in pieces)
    out = torch.empty(shape, dtype=dtype, device=device)
    at = 0
    for p in pieces:
        if p.stop > p.start:
            out.narrow(dim, at, p.stop - p.start).copy_(read(p.start, p.stop))
        if p.pad:
            out.narrow(dim, at + p.stop - p.start, p.pad).zero_()
        at += p.rows
    return out


def narrow_reader(full: torch.Tensor, spec: Replicate | Shard) -> Reader:
    """A ``Reader`` over a tensor in memory (views, no copies)."""
    if full.dim() == 0:
        return lambda start, stop: full
    dim = spec.dim if isinstance(spec, Shard) else 0
    return lambda start, stop: full.narrow(dim, start, stop - start)


def expert_slice(read: Reader, full_shape: tuple[int, ...], spec: Replicate | Shard, first: int,
                 count: int) -> tuple[Reader, tuple[int, ...]]:
    """A stacked expert weight (E, ...) seen as experts ``[first, first + count)`` only: the reader of
    that (count, ...) tensor and its shape, for ``assemble`` to apply the tensor-parallel split to.
    Whole along dim 0 (no tp split there): the rows read are those experts' only; split along another
    dim: each read narrowed to them."""
    shape = (count, *full_shape[1:])
    if not isinstance(spec, Shard) or spec.dim == 0:
        if isinstance(spec, Shard):
            raise PlacementError(f"a stacked expert weight split by tp along its expert dim: {spec}")
        return (lambda start, stop: read(first + start, first + stop)), shape
    return (lambda start, stop: read(start, stop).narrow(0, first, count)), shape
