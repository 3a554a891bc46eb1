"""Scaled dot-product attention split by heads (or batch)."""

from __future__ import annotations

import torch
import torch.fx as fx

from autopar.core.tensor_placement import Shard
from passes.rules.context import Ctx, arg, arg_path, ndim, shape
from passes.rules.decision import R, Decision, fallback
from passes.rules.registry import Placements, register_rule

aten = torch.ops.aten


@register_rule(aten.scaled_dot_product_attention.default)
def sdpa(ctx: Ctx, node: fx.Node, pl: Placements) -> Decision:
    """q, k, v split alike on the batch or head dim: attention runs on the local heads; a
    replicated q, k or v is sliced, and the mask sliced or (broadcast along the heads) read whole."""
    mask = arg(node, 3, "attn_mask")
    mask_path = arg_path(node, 3, "attn_mask")
    qkv = [(("a", i), a) for i, a in enumerate(node.args[:3])]
    shards = [(path, pl[a]) for path, a in qkv if isinstance(pl[a], Shard)]
    if not shards:
        if isinstance(mask, fx.Node) and isinstance(pl[mask], Shard):
            return fallback([(mask_path, pl[mask])], "sharded mask")
        return Decision(R)
    dims = {(p.dim, p.segments) for _, p in shards}
    if len(dims) != 1 or next(iter(dims))[0] >= 2:
        return fallback(shards, "attention sharded on a sequence or head-size dim")
    (d, segs), = dims
    scatter, copy = [], []
    for path, a in qkv:
        if isinstance(pl[a], Shard):
            continue
        if not ctx.divides(shape(a)[d]):
            return fallback(shards, "replicated q/k/v head count not divisible by tp")
        scatter.append((path, Shard(d, segs)))
    if isinstance(mask, fx.Node):
        pm = pl[mask]
        ad = d - (4 - ndim(mask))  # the mask's dim under the split one (negative: it lacks it)
        if isinstance(pm, Shard):
            if pm.dim != ad:
                return fallback(shards + [(mask_path, pm)], "mask sharded differently from the heads")
        elif ad < 0 or shape(mask)[ad] == 1:
            if mask.name in ctx.requires_grad:
                copy.append(mask_path)
        else:
            scatter.append((mask_path, Shard(ad, segs)))
    return Decision(Shard(d, segs, shards[0][1].origin), kind="sharded", copy_in=tuple(copy),
                    scatter_in=tuple(scatter))
