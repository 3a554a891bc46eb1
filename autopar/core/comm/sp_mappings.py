"""Sequence parallelism's mappings: f and g along the token dim.

- ``reduce_scatter_to_sp``  g under sequence parallelism: forward reduce-scatter
                            along the token dim, backward all-gather
- ``gather_from_sp``        f under sequence parallelism: forward all-gather
                            along the token dim, backward reduce-scatter

A ring all-reduce is a reduce-scatter then an all-gather, so the pair moves the
bytes of tensor parallelism's f and g while each rank keeps only 1/t of the
tokens between them. ``gather_from_sp`` leaves its gathered value to
``kept_slices``, which lets the consumers save this rank's slice instead.
"""

from __future__ import annotations

import torch

from autopar.core.collectives import ALL_GATHER, REDUCE_SCATTER, collective, input_bytes, output_bytes, twice
from autopar.core.comm.group import TPGroup, all_gather_dim, conjugate_pair, reduce_scatter_dim
from autopar.core.comm.kept_slices import remember_gathered

__all__ = ["reduce_scatter_to_sp", "gather_from_sp"]


_ReduceScatterToSP = conjugate_pair("_ReduceScatterToSP", reduce_scatter_dim, all_gather_dim)
_GatherFromSP = conjugate_pair("_GatherFromSP", all_gather_dim, reduce_scatter_dim)


@collective("g (reduce_scatter_to_sp)", "fwd reduce-scatter; bwd all-gather", (REDUCE_SCATTER, ALL_GATHER),
            twice(input_bytes), forward_nbytes=input_bytes)
def reduce_scatter_to_sp(x: torch.Tensor, tp: TPGroup, dim: int, segments: tuple[int, ...] | None = None
                         ) -> torch.Tensor:
    """g of sequence parallelism: the partial sums reduce-scattered along the token dim ``dim``, each
    rank keeping its 1/t of the tokens; backward all-gathers the gradient. A ring all-reduce is
    exactly a reduce-scatter then an all-gather: the same bytes, split across g and the next f.
    ``segments``: the token dim holds several sequences (flattened (B*T, C)); each rank keeps its
    1/t of every one, so viewing the tokens back as (B, T, C) keeps a split of T."""
    if tp.size == 1:
        return x
    return _ReduceScatterToSP.apply(x, tp, dim, segments)


def _gathered_thrice(node) -> int:
    return 3 * output_bytes(node)


@collective("f (gather_from_sp)", "fwd all-gather; bwd reduce-scatter, all-gather of the kept slice",
            (ALL_GATHER, REDUCE_SCATTER, ALL_GATHER), _gathered_thrice, forward_nbytes=output_bytes)
def gather_from_sp(x: torch.Tensor, tp: TPGroup, dim: int, segments: tuple[int, ...] | None = None
                   ) -> torch.Tensor:
    """f of sequence parallelism: the tokens split along ``dim`` all-gathered before a column-parallel
    region; backward reduce-scatters the region's partial gradients (the sum f's all-reduce made).

    Inside ``keeping_gathered_slices`` (the engine runs every chunk so) the ops reading the gathered
    value save this rank's slice ``x`` instead, and the backward all-gathers it again once for them
    all: 1/t of the bytes kept, one more all-gather of the value moved (counted in its bytes)."""
    if tp.size == 1:
        return x
    full = _GatherFromSP.apply(x, tp, dim, segments)
    # traced by torch.compile: what the backward keeps is the compiled graph's partitioner's choice
    if torch.is_grad_enabled() and x.requires_grad and not torch.compiler.is_compiling():
        remember_gathered(full, x, tp, dim, segments)
    return full
