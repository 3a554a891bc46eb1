"""Element-wise ops: broadcasting ones (by ``torch.Tag.pointwise``), ones placed like their first
input (copies, casts, dropout), and concatenation."""

from __future__ import annotations

import torch
import torch.fx as fx

from autopar.core.tensor_placement import Shard
from passes.rules.context import Ctx, Path, arg, ndim, operands, shape
from passes.rules.decision import R, Decision, fallback
from passes.rules.registry import Placements, register_rule, register_tag

__all__ = ["elementwise", "SAME_AS_INPUT"]

aten = torch.ops.aten


def elementwise(ctx: Ctx, node: fx.Node, pl: Placements, ops: list[tuple[Path, fx.Node]] | None = None,
                out_nd: int | None = None, concat: bool = False) -> Decision:
    """A broadcasting element-wise op over ``ops`` (default: every operand): the output split like
    its split operands; replicated operands that carry the split dim are sliced, those that
    broadcast along it are read whole (f if they require grad). With ``concat`` the split
    operands' sizes may differ from the output's (the dims of a concatenation)."""
    ops = ops if ops is not None else operands(node)
    out_nd = out_nd if out_nd is not None else ndim(node)
    out_shape = shape(node)
    target = None
    shards = []
    for path, a in ops:
        p = pl[a]
        if not isinstance(p, Shard):
            continue
        od = p.dim + (out_nd - ndim(a))
        shards.append((path, p))
        if not concat and shape(a)[p.dim] != out_shape[od]:  # a split dim cannot broadcast
            return fallback(shards, f"operand {a.name} is split on a dim of size {shape(a)[p.dim]} that "
                                    f"broadcasts to {out_shape[od]}")
        if target is None:
            target = (od, p.segments, p.origin)
        elif (od, p.segments) != target[:2]:
            others = [(q, pl[b]) for q, b in ops if isinstance(pl[b], Shard) and q != path]
            return fallback(shards + others, f"operands sharded on different dims ({target[0]} vs {od})")
    if target is None:
        return Decision(R)
    od, segs, origin = target
    copy_in, scatter_in = [], []
    for path, a in ops:
        if isinstance(pl[a], Shard):
            continue
        ad = od - (out_nd - ndim(a))  # the operand's dim that broadcasts to od (negative: it lacks one)
        if ad < 0 or shape(a)[ad] == 1:
            if a.name in ctx.requires_grad:
                copy_in.append(path)
        elif shape(a)[ad] == out_shape[od]:
            scatter_in.append((path, Shard(ad, segs)))
        else:
            return fallback(shards, f"operand {a.name} has size {shape(a)[ad]} on the sharded dim")
    return Decision(Shard(od, segs, origin), kind="sharded", copy_in=tuple(copy_in), scatter_in=tuple(scatter_in))


@register_tag(torch.Tag.pointwise)
def pointwise(ctx: Ctx, node: fx.Node, pl: Placements) -> Decision:
    return elementwise(ctx, node, pl)


SAME_AS_INPUT = (
    aten.clone.default, aten._to_copy.default, aten.contiguous.default, aten.alias.default,
    aten.detach.default, aten.lift_fresh_copy.default, aten.dropout.default, aten.to.dtype,
    aten.to.dtype_layout, aten.zeros_like.default, aten.ones_like.default, aten.empty_like.default,
    aten.full_like.default, aten.native_dropout.default, aten.feature_dropout.default,
    aten.type_as.default,
)
"""Ops whose every output is placed like their first input."""


@register_rule(*SAME_AS_INPUT)
def same_as_input(ctx: Ctx, node: fx.Node, pl: Placements) -> Decision:
    p = pl[node.args[0]]
    if not isinstance(p, Shard):
        return Decision(R)
    if isinstance(node.meta["val"], (tuple, list)):
        return Decision(tuple(p for _ in node.meta["val"]), kind="sharded")
    return Decision(p, kind="sharded")


NEW_OF_SIZE = (aten.new_zeros.default, aten.new_ones.default, aten.new_empty.default, aten.new_full.default)
"""Tensors made with a size given as an argument: their input gives only a dtype and a device."""


@register_rule(*NEW_OF_SIZE)
def new_of_size(ctx: Ctx, node: fx.Node, pl: Placements) -> Decision:
    """``x.new_zeros(size)`` and the like: the same whole tensor whatever ``x``'s placement (nothing of
    ``x`` is read but its dtype), so a split ``x`` is not gathered for it."""
    return Decision(R)


@register_rule(aten.cat.default, aten.stack.default)
def concatenate(ctx: Ctx, node: fx.Node, pl: Placements) -> Decision:
    """cat/stack of values split alike, along another dim."""
    stack = node.target == aten.stack.default
    out_nd = ndim(node)
    dim = arg(node, 1, "dim", 0) % out_nd
    # cat skips 1-D empty tensors (an empty key/value cache concatenated with the new keys)
    ops = [(("a", 0, j), a) for j, a in enumerate(node.args[0])
           if stack or not (isinstance(a, fx.Node) and shape(a) == (0,))]
    dec = elementwise(ctx, node, pl, ops=ops, out_nd=out_nd - 1 if stack else out_nd, concat=True)
    if dec.kind != "sharded":
        return dec
    od = dec.out.dim + (1 if stack and dim <= dec.out.dim else 0)
    if (not stack and od == dim) or dec.copy_in:
        return fallback([(path, pl[a]) for path, a in ops if isinstance(pl[a], Shard)],
                        "concatenation along the sharded dim")
    return Decision(Shard(od, dec.out.segments, dec.out.origin), kind="sharded", scatter_in=dec.scatter_in)
