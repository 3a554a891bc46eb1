"""Megatron's tensor-parallel mappings, as autograd functions in conjugate pairs.

For a group of t ranks:

- ``copy_to_tp``     (f)  forward identity,    backward all-reduce
- ``reduce_from_tp`` (g)  forward all-reduce,  backward identity
- ``gather_from_tp``      forward all-gather,  backward take the local slice
- ``scatter_to_tp``       forward take the local slice, backward all-gather

Each short-circuits when the group has one rank and is registered as a
collective (``autopar.core.collectives``) where it is defined.
"""

from __future__ import annotations

import torch

from autopar.core.collectives import ALL_GATHER, ALL_REDUCE, collective, output_bytes
from autopar.core.comm.group import TPGroup, all_gather, all_reduce, conjugate_pair

__all__ = ["copy_to_tp", "reduce_from_tp", "gather_from_tp", "scatter_to_tp"]


class _CopyToTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return all_reduce(grad, ctx.group), None


class _ReduceFromTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        return all_reduce(x, group)

    @staticmethod
    def backward(ctx, grad):
        return grad, None


def _own_slice(grad: torch.Tensor, group: TPGroup, dim: int, segments: tuple[int, ...] | None) -> torch.Tensor:
    return group.own_slice(grad, dim, segments)


_GatherFromTP = conjugate_pair("_GatherFromTP", all_gather, _own_slice)


class _ScatterToTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, dim, segments):
        ctx.args = (group, dim, segments, x.shape[dim])
        return group.own_slice(x, dim, segments)

    @staticmethod
    def backward(ctx, grad):
        group, dim, segments, size = ctx.args
        full = all_gather(grad, group, dim, segments)
        return full.narrow(dim, 0, size), None, None, None


@collective("f (copy_to_tp)", "bwd all-reduce", ALL_REDUCE, output_bytes)
def copy_to_tp(x: torch.Tensor, tp: TPGroup) -> torch.Tensor:
    """f: identity forward; all-reduce of the gradient backward."""
    if tp.size == 1 or not x.requires_grad:
        return x
    return _CopyToTP.apply(x, tp)


@collective("g (reduce_from_tp)", "fwd all-reduce", ALL_REDUCE, output_bytes)
def reduce_from_tp(x: torch.Tensor, tp: TPGroup) -> torch.Tensor:
    """g: all-reduce (sum of partial results) forward; identity backward."""
    if tp.size == 1:
        return x
    return _ReduceFromTP.apply(x, tp)


@collective("gather_from_tp", "fwd all-gather (fallback)", ALL_GATHER, output_bytes)
def gather_from_tp(x: torch.Tensor, tp: TPGroup, dim: int, segments: tuple[int, ...] | None = None,
                   size: int | None = None) -> torch.Tensor:
    """All-gather a sharded tensor to its full (unpadded ``size``) form; backward keeps the local slice."""
    if tp.size == 1:
        full = x
    else:
        full = _GatherFromTP.apply(x, tp, dim, segments)
    if size is not None and full.shape[dim] != size:
        full = full.narrow(dim, 0, size)
    return full


@collective("scatter_to_tp", "bwd all-gather", ALL_GATHER, output_bytes)
def scatter_to_tp(x: torch.Tensor, tp: TPGroup, dim: int, segments: tuple[int, ...] | None = None) -> torch.Tensor:
    """Keep this rank's slice of a replicated tensor; backward all-gathers the gradient."""
    if tp.size == 1:
        return x
    return _ScatterToTP.apply(x, tp, dim, segments)
