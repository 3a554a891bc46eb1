"""Sums and means over the split dim (a local one, then g), and normalizations over other dims.

Other reductions (amax, var, argmax, ...) are dimension maps (``views.DIM_MAPS``).
"""

from __future__ import annotations

import torch
import torch.fx as fx

from autopar.core.tensor_placement import Shard
from passes.rules.context import Ctx, ndim, norm_dims, padded
from passes.rules.decision import R, Decision, fallback
from passes.rules.registry import Placements, register_rule
from passes.rules.views import map_dims, reduction_map

aten = torch.ops.aten


@register_rule(aten.sum.dim_IntList, aten.mean.dim)
def sum_or_mean(ctx: Ctx, node: fx.Node, pl: Placements) -> Decision:
    """A sum over the sharded dim (no padding) is a local sum and g: the partial sums add up.
    A mean is the local mean over t (the ranks hold equal parts), then g: an RMSNorm over a
    split q (some models normalise q and k before taking heads apart) stays split."""
    x = node.args[0]
    p = pl[x]
    dims = norm_dims(node.args[1] if len(node.args) > 1 else node.kwargs.get("dim"), ndim(x))
    if isinstance(p, Shard) and p.dim in dims and not padded(x, p) and node.kwargs.get("dtype") is None:
        return Decision(R, kind="sharded", reduce_out=True, mean_over_ranks=node.target == aten.mean.dim)
    return map_dims(node, pl, reduction_map(2)(node))


def _normalization(ctx: Ctx, node: fx.Node, pl: Placements, n_normalized: int, weight_args: list[int]) -> Decision:
    """Normalization over the last ``n_normalized`` dims: split elsewhere, it runs locally; its
    weights (arguments ``weight_args``) are read whole by every rank (f)."""
    x = node.args[0]
    p = pl[x]
    if not isinstance(p, Shard):
        return Decision(R)
    if p.dim >= ndim(x) - n_normalized:
        return fallback([(("a", 0), p)], "normalization over the sharded dim")
    copy_in = tuple(("a", i) for i in weight_args if len(node.args) > i and isinstance(node.args[i], fx.Node)
                    and node.args[i].name in ctx.requires_grad)
    return Decision(Shard(p.dim, p.segments, p.origin), kind="sharded", copy_in=copy_in)


@register_rule(aten.layer_norm.default)
def layer_norm(ctx: Ctx, node: fx.Node, pl: Placements) -> Decision:
    return _normalization(ctx, node, pl, len(node.args[1]), [2, 3])


@register_rule(aten.rms_norm.default)
def rms_norm(ctx: Ctx, node: fx.Node, pl: Placements) -> Decision:
    return _normalization(ctx, node, pl, len(node.args[1]), [2])
