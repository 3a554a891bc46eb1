"""Views that regroup dims (view, reshape, flatten, unflatten, expand) and cuts of the split dim
(split, chunk, slice): their sizes become local ones (``Decision.local_args``).

A column-parallel output cut into pieces that the ranks cannot share as one
block (a fused (q, k, v) split three ways) raises ``NeedSegments``: the
analysis then splits the linear piece by piece, each piece t ways.
"""

from __future__ import annotations

import math
from dataclasses import replace

import torch
import torch.fx as fx

from autopar.core.graph import module_path, source_line
from autopar.core.tensor_placement import Shard
from passes.rules.context import Ctx, arg, ndim, shape
from passes.rules.decision import R, Decision, NeedSegments, fallback, replicated
from passes.rules.registry import Placements, register_rule
from passes.rules.views import DimMap, map_dims

__all__ = ["view_groups", "slice_pieces"]

aten = torch.ops.aten


def view_groups(ishape, oshape) -> list[tuple[list[int], list[int]]]:
    """Pair up runs of input and output dims with equal products: [(in_dims, out_dims)]."""
    groups, i, o = [], 0, 0
    ni, no = len(ishape), len(oshape)
    while i < ni or o < no:
        gi, go = [], []
        pi = po = 1
        if i < ni:
            gi.append(i); pi *= ishape[i]; i += 1
        if o < no:
            go.append(o); po *= oshape[o]; o += 1
        while pi != po:
            if pi < po and i < ni:
                gi.append(i); pi *= ishape[i]; i += 1
            elif o < no:
                go.append(o); po *= oshape[o]; o += 1
            else:
                break
        # absorb trailing size-1 dims
        while i < ni and ishape[i] == 1 and (o >= no or oshape[o] != 1):
            gi.append(i); i += 1
        while o < no and oshape[o] == 1 and (i >= ni or ishape[i] != 1):
            go.append(o); o += 1
        groups.append((gi, go))
    return groups


def _regroup(ctx: Ctx, node: fx.Node, p: Shard) -> Decision:
    """A view or reshape of a value split on dim d (in pieces ``segments``).

    Within the group of input dims the view regroups (``view_groups``), rank r
    holds, for every index of the group's dims before d and every segment, piece r
    of the segment times everything after d: a list of flat blocks, each cut t
    ways. The output keeps the split on the first output dim od of the group where
    those blocks are, row by row of the dims before od, the same list of segments
    of od, each a multiple of t times the size after od. So a split hidden size
    becomes split heads (h d -> h, d: heads divisible by t), a fused (q, k, v) in
    three segments becomes split head dims under an outer 3, and batch and split
    heads merged (b, h -> b h) become b segments of h, and back.

    ``local_args`` holds the local output shape at ``("a", 1)``; the callers move it.
    """
    ishape, oshape, d = shape(node.args[0]), shape(node), p.dim
    segs = list(p.segments) if p.segments is not None else [ishape[d]]
    is_padded = sum(segs) != ishape[d]
    group = next(((gi, go) for gi, go in view_groups(ishape, oshape) if d in gi), None)
    if group is None:
        return fallback([(("a", 0), p)], "view: sharded dim not found")
    gi, go = group
    outer_in = math.prod(ishape[k] for k in gi if k < d)
    inner_in = math.prod(ishape[k] for k in gi if k > d)
    if is_padded and (outer_in != 1 or inner_in != 1 or len([k for k in go if oshape[k] != 1]) != 1):
        return fallback([(("a", 0), p)], "view reshapes a padded vocabulary dim")
    flat = [s * inner_in for _ in range(outer_in) for s in segs]
    for od in go:
        if oshape[od] == 1:
            continue
        inner_out = math.prod(oshape[k] for k in go if k > od)
        rows = math.prod(oshape[k] for k in go if k < od)
        out_segs = _rows_of_segments(flat, rows, oshape[od] * inner_out if not is_padded else sum(flat))
        if out_segs is None or any(f % inner_out or not ctx.divides(f // inner_out) for f in out_segs):
            continue
        new = [f // inner_out for f in out_segs]
        local = list(oshape)
        local[od] = sum(s // ctx.tp for s in new)
        return Decision(Shard(od, None if (len(new) == 1 and not is_padded) else tuple(new), p.origin),
                        kind="sharded", local_args=((("a", 1), local),))
    if p.segments is None and ctx.is_column(p.origin) and outer_in == 1 and inner_in == 1:
        _ask_for_pieces(ctx, node, p, [k for k in go if oshape[k] != 1])
    olead = [k for k in go if oshape[k] != 1]
    if not olead:
        return fallback([(("a", 0), p)], "view drops the sharded dim")
    od = olead[0]
    inner_out = math.prod(oshape[k] for k in go if k > od)
    err = None
    if outer_in == 1 and not is_padded and p.segments is None and inner_out > 1 and not ctx.divides(oshape[od]):
        err = _split_error(ctx, node, d, od, inner_out)
    return fallback([(("a", 0), p)], "view splits the sharded dim unevenly", error=err)


def _ask_for_pieces(ctx: Ctx, node: fx.Node, p: Shard, olead: list[int]) -> None:
    """A column-parallel output unflattened into (pieces, rest) that the ranks cannot share by
    pieces (a packed (q, k, v)): raise ``NeedSegments`` so the linear splits each piece instead."""
    ishape, oshape, d = shape(node.args[0]), shape(node), p.dim
    if len(olead) < 2:
        return
    pieces = oshape[olead[0]]
    size = ishape[d] // pieces
    if pieces > 1 and ctx.divides(size) and size * pieces == ishape[d]:
        inner_out = math.prod(oshape[k] for k in olead if k > olead[0])
        err = _split_error(ctx, node, d, olead[0], inner_out) if not ctx.divides(pieces) else None
        raise NeedSegments(p.origin, [size] * pieces, err)


def _rows_of_segments(flat: list[int], rows: int, row_size: int) -> list[int] | None:
    """The segments of one row when ``flat`` is ``rows`` rows of ``row_size`` with the same segments
    in each (blocks never straddle rows), else None."""
    if sum(flat) != rows * row_size or len(flat) % rows:
        return None
    per = len(flat) // rows
    first = flat[:per]
    if sum(first) != row_size or any(flat[i * per:(i + 1) * per] != first for i in range(rows)):
        return None
    return first


def _split_error(ctx: Ctx, node: fx.Node, d: int, od: int, inner_out: int) -> str:
    ishape, oshape = shape(node.args[0]), shape(node)
    n = oshape[od]
    where = source_line(node)
    return (
        f"tensor parallelism tp={ctx.tp} cannot split module '{module_path(node)}': node {node.name} reshapes "
        f"{list(ishape)} -> {list(oshape)}, turning the split dimension of size {ishape[d]} into "
        f"{n} groups (attention heads or key/value heads) of {inner_out}; {n} is not divisible by tp={ctx.tp}"
        + (f" [{where}]" if where else "")
        + f". Fix: use a tp that divides {n} (one of {[k for k in range(1, n + 1) if n % k == 0]}), "
        f"or change the model's head count."
    )


def _split_input(pl: Placements, node: fx.Node) -> Shard | None:
    p = pl[node.args[0]]
    return p if isinstance(p, Shard) else None


@register_rule(aten.view.default, aten.reshape.default, aten._unsafe_view.default)
def view(ctx: Ctx, node: fx.Node, pl: Placements) -> Decision:
    p = _split_input(pl, node)
    return _regroup(ctx, node, p) if p is not None else Decision(R)


@register_rule(aten.flatten.using_ints)
def flatten(ctx: Ctx, node: fx.Node, pl: Placements) -> Decision:
    """Dims-based: nothing to localize."""
    p = _split_input(pl, node)
    if p is None:
        return Decision(R)
    dec = _regroup(ctx, node, p)
    return replace(dec, local_args=())


@register_rule(aten.unflatten.int)
def unflatten(ctx: Ctx, node: fx.Node, pl: Placements) -> Decision:
    """unflatten(x, dim, sizes): the sizes become the local ones."""
    p = _split_input(pl, node)
    if p is None:
        return Decision(R)
    dec = _regroup(ctx, node, p)
    if not dec.local_args:
        return dec
    dim = node.args[1] % ndim(node.args[0])  # a dim of the input
    local = dec.local_args[0][1]
    return replace(dec, local_args=((("a", 2), local[dim: dim + len(node.args[2])]),))


@register_rule(aten.expand.default)
def expand(ctx: Ctx, node: fx.Node, pl: Placements) -> Decision:
    x, p = node.args[0], _split_input(pl, node)
    if p is None:
        return Decision(R)
    oshape = shape(node)
    od = p.dim + (len(oshape) - ndim(x))
    if shape(x)[p.dim] != oshape[od]:
        return fallback([(("a", 0), p)], "expand of the sharded dim")
    local = list(oshape)
    local[od] = sum(s // ctx.tp for s in (p.segments or (oshape[od],)))
    return Decision(Shard(od, p.segments, p.origin), kind="sharded", local_args=((("a", 1), local),))


@register_rule(aten.split.Tensor, aten.split_with_sizes.default, aten.chunk.default, aten.unsafe_split.Tensor,
               aten.split.sizes)
def split(ctx: Ctx, node: fx.Node, pl: Placements) -> Decision:
    """Pieces along another dim are split alike; along the split dim, pieces that are its segments
    each become one block per rank (the split sizes become local)."""
    x, p = node.args[0], _split_input(pl, node)
    if p is None:
        return replicated(node)
    dim = arg(node, 2, "dim", 0) % ndim(x)
    sizes = [int(v.shape[dim]) for v in node.meta["val"]]
    if dim != p.dim:
        return Decision(tuple(Shard(p.dim, p.segments, p.origin) for _ in sizes), kind="sharded")
    if len(sizes) == 1:
        return Decision((Shard(p.dim, p.segments, p.origin),), kind="sharded", local_args=_local_split(ctx, node))
    if p.segments is not None and tuple(sizes) == tuple(p.segments):
        return Decision(tuple(Shard(p.dim, None, None) for _ in sizes), kind="sharded",
                        local_args=_local_split(ctx, node))
    if p.segments is None and ctx.is_column(p.origin):
        raise NeedSegments(p.origin, sizes)
    return fallback([(("a", 0), p)], "split of the sharded dim into unequal pieces")


def _local_split(ctx: Ctx, node: fx.Node) -> tuple:
    """The size argument of split/split_with_sizes along the split dim, on one rank (chunk's is a count)."""
    if node.target == aten.chunk.default:
        return ()
    sizes = node.args[1]
    local = [s // ctx.tp for s in sizes] if isinstance(sizes, (list, tuple)) else sizes // ctx.tp
    return ((("a", 1), local),)


def slice_range(node: fx.Node) -> tuple[int, int, int, int]:
    """(dim, start, end, step) of an aten.slice, normalised to the input's size."""
    x = node.args[0]
    dim = arg(node, 1, "dim", 0) % ndim(x)
    size = shape(x)[dim]
    start, end, step = arg(node, 2, "start"), arg(node, 3, "end"), arg(node, 4, "step", 1)
    start = 0 if start is None else (start + size if start < 0 else min(start, size))
    end = size if end is None else (end + size if end < 0 else min(end, size))
    return dim, start, end, step


def slice_pieces(x: fx.Node, dim: int) -> list[tuple[int, int]] | None:
    """The ranges of ``x``'s slices along ``dim`` when they cut it into contiguous pieces."""
    ranges = []
    for u in x.users:
        if u.target != aten.slice.Tensor:
            continue
        d, start, end, step = slice_range(u)
        if d != dim or step != 1:
            return None
        ranges.append((start, end))
    ranges = sorted(set(ranges))
    size = shape(x)[dim]
    if not ranges or ranges[0][0] != 0 or ranges[-1][1] != size:
        return None
    if any(a[1] != b[0] for a, b in zip(ranges, ranges[1:])):
        return None
    return ranges


@register_rule(aten.slice.Tensor)
def slice_(ctx: Ctx, node: fx.Node, pl: Placements) -> Decision:
    """Slices of the sharded dim that cut it into pieces (a fused QKV sliced into q, k, v), or
    that take every step-th entry of it."""
    x, p = node.args[0], pl[node.args[0]]
    dim, start, end, step = slice_range(node)
    size = shape(x)[dim]
    if not isinstance(p, Shard) or p.dim != dim or (start == 0 and end >= size and step == 1):
        return map_dims(node, pl, DimMap(lambda d: d))
    if p.segments is None and step > 1 and start < step and end >= size and (size // ctx.tp) % step == 0:
        # every step-th entry (gate and up interleaved): each rank's block starts on a multiple of
        # step, so its own every step-th entries are its block of the result
        return Decision(Shard(dim, None, p.origin), kind="sharded")
    pieces = slice_pieces(x, dim)
    if pieces is not None:
        sizes = tuple(b - a for a, b in pieces)
        if p.segments is not None and tuple(p.segments) == sizes:
            piece = pieces.index((start, end))
            local_start = sum(s // ctx.tp for s in p.segments[:piece])
            bounds = ((("a", 2), local_start), (("a", 3), local_start + p.segments[piece] // ctx.tp))
            return Decision(Shard(dim, None, None), kind="sharded", local_args=bounds)
        if p.segments is None and ctx.is_column(p.origin):
            raise NeedSegments(p.origin, list(sizes))
    return fallback([(("a", 0), p)], "slice of the sharded dim")
