"""Context parallelism's ops in the rank graph: attention over the ring, and a rank's tokens of a whole tensor.

``passes/context_parallel.py`` splits the sequence of every activation over the
cp ranks of a context-parallel group; two kinds of node then need the group:

- ``cp_attention(tp, q, k, v, cp, causal, balanced, scale)``: a scaled
  dot-product attention whose queries, keys and values are this rank's tokens,
  computed over the whole sequence by ``ring_attention`` (keys and values
  passed around the group; exact, its backward included).
- ``cp_tokens(x, tp, dim, cp, balanced, segments)``: this rank's tokens of a
  value every rank holds whole along the sequence (a position embedding, a
  rotary table, anything made from ``arange`` over the positions) where it
  meets split tokens. Forward a gather of the rank's positions (no message);
  backward the gradient put back at those positions, zeros elsewhere: the
  gradients are summed over the cp ranks with the data-parallel reduction.

The group rides on the rank graph's ``tp`` argument (``TPGroup.cp``, set by
the engine). Without it (the compiler's shape propagation, an inspection
group) the ops compute rank 0's shapes without communicating.
"""

from __future__ import annotations

import torch

from autopar.core.comm.cp_layout import ContextParallelError, cp_positions
from autopar.core.comm.group import TPGroup
from autopar.core.comm.ring_attention import ring_attention

__all__ = ["cp_attention", "cp_tokens", "cp_group"]


def cp_group(tp: TPGroup, cp: int) -> TPGroup:
    """The context-parallel group the rank program runs over: the engine's, or an inspection group of ``cp``."""
    group = tp.cp
    if group is None:
        return TPGroup(0, cp, None)
    if group.size != cp:
        raise ContextParallelError(f"the program splits the sequence cp={cp} ways, but this rank's context-parallel "
                                   f"group has {group.size} ranks: run it on the mesh it was compiled for")
    return group


@torch.compiler.disable(reason="ring attention: point-to-point messages posted and waited on around the blocks")
def cp_attention(tp: TPGroup, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cp: int, causal: bool,
                 balanced: bool, scale: float | None = None) -> torch.Tensor:
    """``scaled_dot_product_attention(q, k, v, is_causal=causal, scale=scale)`` of this rank's queries over the
    whole sequence, the keys and values of the others arriving around the ring (``ring_attention``)."""
    out = ring_attention(q, k, v, cp_group(tp, cp), causal=causal, balanced=balanced, scale=scale)
    # laid out as scaled_dot_product_attention lays its output out, (B, S, H, D) in memory: the graph
    # may view its transpose without a copy, as the model's trace did
    return out.transpose(1, 2).contiguous().transpose(1, 2)


class _Tokens(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, index, dim):
        ctx.args = (index, dim, x.shape)
        return x.index_select(dim, index)

    @staticmethod
    def backward(ctx, grad):
        index, dim, shape = ctx.args
        return grad.new_zeros(shape).index_add(dim, index, grad), None, None


def cp_tokens(x: torch.Tensor, tp: TPGroup, dim: int, cp: int, balanced: bool,
              segments: tuple[int, ...] | None = None) -> torch.Tensor:
    """This context-parallel rank's tokens of ``x`` along ``dim`` (every segment's, when ``dim`` holds
    several sequences one after the other), in the layout's order; backward scatters the gradient back."""
    group = cp_group(tp, cp)
    sizes = list(segments) if segments is not None else [x.shape[dim]]
    index, start = [], 0
    for size in sizes:
        index.append(cp_positions(group.rank, cp, size, balanced, x.device) + start)
        start += size
    index = torch.cat(index)
    if not x.requires_grad:
        return x.index_select(dim, index)
    return _Tokens.apply(x, index, dim)
