"""Per-op sharding rules over the ATen ops of transformer graphs.

``decide(ctx, node, placement_of)`` looks at the placements of a node's tensor
operands and returns a ``Decision``: the placement of its output and what the
rewrite must put around it:

- ``copy_in``    operands that get Megatron's f (identity forward, all-reduce
                 backward): a replicated value that requires grad and feeds a
                 sharded computation whole (the input of a column-parallel
                 linear; a norm weight broadcast over sharded heads).
- ``scatter_in`` replicated operands narrowed to this rank's slice (a mask with
                 one row per head meeting head-sharded scores).
- ``gather_in``  sharded operands all-gathered because the op has no rule: the
                 op then runs replicated (a *fallback*, listed in the summary).
- ``reduce_out`` the op's output is a partial sum (row-parallel linear): g.
- ``local_shape`` for view/reshape/expand: the size argument on one rank.

Shapes come from ``node.meta["val"]`` (global). Dims are non-negative.
"""

from __future__ import annotations

import math
import operator
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.fx as fx

from autopar.core.placement import Partial, Replicate, Shard
from autopar.core.graph import TracedModel, module_path, source_line

__all__ = ["Ctx", "Decision", "NeedSegments", "decide", "weight_of", "linear_parts"]

aten = torch.ops.aten
R = Replicate()


class NeedSegments(Exception):
    """A split of a column-parallel output into pieces: the linear must shard each piece."""

    def __init__(self, origin: str, sizes: list[int], error: str | None = None):
        super().__init__(origin, sizes)
        self.origin, self.sizes = origin, list(sizes)
        self.error = error
        """What to report if the split into pieces does not work out either (the view that asked
        would otherwise need a number of groups that t does not divide)."""


@dataclass(frozen=True)
class Decision:
    out: Any
    """Placement of the output (a tuple of placements for multi-output ops)."""
    kind: str = "replicated"
    """replicated | sharded | column | row | vocab_embedding | vocab_cross_entropy | vocab_softmax |
    vocab_nll | vocab_gather | fallback"""
    copy_in: tuple = ()
    """Operand paths that get f (copy_to_tp)."""
    scatter_in: tuple = ()
    """(path, Shard) of replicated operands narrowed to the local slice."""
    gather_in: tuple = ()
    """(path, Shard) of sharded operands gathered for a fallback."""
    param_demand: dict = field(default_factory=dict)
    """Parameter placeholder name -> placement this op needs for it."""
    local_shape: tuple | None = None
    """The rewritten size argument of a view/reshape/expand."""
    reduce_out: bool = False
    """Output is a partial sum: insert g (reduce_from_tp) after it."""
    error: str | None = None
    """A divisibility problem: the user's tp does not fit the model here."""
    reason: str = ""
    """Why a fallback happened."""
    extra: dict = field(default_factory=dict)


@dataclass
class Ctx:
    """What the rules need to know besides placements."""

    tp: int
    param_of: dict[str, str]
    requires_grad: set[str]
    from_input: set[str]
    vocab_embeddings: set[str]
    column: dict = field(default_factory=dict)
    """Column-parallel linear node -> segments (None = one)."""

    @staticmethod
    def build(traced: TracedModel, tp: int) -> "Ctx":
        gm = traced.gm
        rg, inp = set(traced.param_of), set(traced.input_names)
        for n in gm.graph.nodes:
            if n.op != "call_function":
                continue
            ins = {a.name for a in n.all_input_nodes}
            if ins & rg and _is_float(n):
                rg.add(n.name)
            if ins & inp:
                inp.add(n.name)
        vocab = set()
        for n in gm.graph.nodes:
            if n.op == "call_function" and n.target == aten.embedding.default:
                w, ids = n.args[0], n.args[1]
                if tp > 1 and w.name in traced.param_of and ids.name in inp:
                    vocab.add(n.name)
        return Ctx(tp, dict(traced.param_of), rg, inp, vocab)

    @staticmethod
    def shape(n) -> tuple[int, ...]:
        return tuple(int(s) for s in n.meta["val"].shape)

    def out_dim_of_weight(self, node: fx.Node) -> int:
        return linear_parts(self, node)[3]


def _is_float(n: fx.Node) -> bool:
    v = n.meta.get("val")
    if isinstance(v, torch.Tensor):
        return v.dtype.is_floating_point
    if isinstance(v, (list, tuple)):
        return any(isinstance(x, torch.Tensor) and x.dtype.is_floating_point for x in v)
    return False


def _ndim(n: fx.Node) -> int:
    return len(n.meta["val"].shape)


# --------------------------------------------------------------------- operands


def _operands(node: fx.Node) -> list[tuple[tuple, fx.Node]]:
    """(path, node) of every fx.Node argument: ('a', i), ('a', i, j) or ('k', name)."""
    out = []
    for i, a in enumerate(node.args):
        if isinstance(a, fx.Node):
            out.append((("a", i), a))
        elif isinstance(a, (list, tuple)):
            out.extend((("a", i, j), b) for j, b in enumerate(a) if isinstance(b, fx.Node))
    for k, a in node.kwargs.items():
        if isinstance(a, fx.Node):
            out.append((("k", k), a))
    return out


def _arg(node: fx.Node, i: int, name: str, default=None):
    if len(node.args) > i:
        return node.args[i]
    return node.kwargs.get(name, default)


def _is_param(ctx: Ctx, n) -> bool:
    return isinstance(n, fx.Node) and n.op == "placeholder" and n.name in ctx.param_of


GROUPED_MM_OPS = ("aten::_grouped_mm", "transformers::grouped_mm_fallback")
"""Grouped matmuls of mixture-of-experts layers: x (S, K) @ W (E, K, N), rows grouped by expert
(by name: a library registers its op when the model's module is imported)."""


def _is_grouped_mm(t) -> bool:
    return isinstance(t, torch._ops.OpOverload) and t.name() in GROUPED_MM_OPS


def _expert_weight(ctx: Ctx, w) -> tuple[fx.Node, bool] | None:
    """(3-D parameter, transposed) when ``w`` is a stacked expert weight or its transpose(-2, -1)."""
    if _is_param(ctx, w) and _ndim(w) == 3:
        return w, False
    if (isinstance(w, fx.Node) and w.op == "call_function" and w.target == aten.transpose.int
            and _is_param(ctx, w.args[0]) and _ndim(w.args[0]) == 3 and sorted(d % 3 for d in w.args[1:3]) == [1, 2]):
        return w.args[0], True
    return None


def linear_parts(ctx: Ctx, node: fx.Node):
    """For a linear-like node: (x_path, weight parameter, bias, weight's output-feature dim,
    weight's input-feature dim). The weight is a 2-D parameter, one expert of a stacked 3-D
    one (``select(W, 0, e)``), or a stacked 3-D one read by a grouped matmul."""
    if node.op != "call_function":
        return None
    parts = _linear_parts(ctx, node)
    if parts is None:
        return None
    if len(parts) == 4:  # a 2-D weight: the input features are the other dim
        return (*parts, 1 - parts[3])
    return parts


def _linear_parts(ctx: Ctx, node: fx.Node):
    t = node.target
    if _is_grouped_mm(t):
        got = _expert_weight(ctx, node.args[1])
        if got is None:
            return None
        w, transposed = got  # the op reads (E, K, N): W stored (E, N, K) and transposed, or as is
        return ("a", 0), w, None, *((1, 2) if transposed else (2, 1))
    if t == aten.linear.default and isinstance(node.args[1], fx.Node) and node.args[1].target == aten.select.int:
        sel = node.args[1]
        if _is_param(ctx, sel.args[0]) and _ndim(sel.args[0]) == 3 and sel.args[1] % 3 == 0 \
                and _arg(node, 2, "bias") is None:
            return ("a", 0), sel.args[0], None, 1, 2  # one expert: W[e] (out, in) of W (E, out, in)
        return None
    if t == aten.linear.default:
        w = node.args[1]
        b = _arg(node, 2, "bias")
        if _is_param(ctx, w) and _ndim(w) == 2:
            return ("a", 0), w, b, 0
    elif t == aten.addmm.default:
        w = node.args[2]
        if _is_param(ctx, w) and _ndim(w) == 2 and _arg(node, 3, "beta", 1) == 1 and _arg(node, 4, "alpha", 1) == 1:
            return ("a", 1), w, node.args[0], 1
    elif t in (aten.mm.default, aten.matmul.default):
        w = node.args[1]
        if _is_param(ctx, w) and _ndim(w) == 2:
            return ("a", 0), w, None, 1
    return None


def weight_of(ctx: Ctx, node: fx.Node) -> fx.Node:
    return linear_parts(ctx, node)[1]



def _get(node: fx.Node, path: tuple) -> fx.Node:
    if path[0] == "k":
        return node.kwargs[path[1]]
    a = node.args[path[1]]
    return a[path[2]] if len(path) == 3 else a


# ------------------------------------------------------------------------ rules


def _fallback(node, shards: list[tuple[tuple, Shard]], reason: str, error: str | None = None) -> Decision:
    return Decision(R, kind="fallback", gather_in=tuple(shards), reason=reason, error=error)


def _align(d: int, out_nd: int, in_nd: int) -> int:
    """Operand dim that broadcasts to output dim d (negative: the operand lacks it)."""
    return d - (out_nd - in_nd)


def _elementwise(ctx: Ctx, node, pl, operands=None, out_nd=None, concat: bool = False) -> Decision:
    """Broadcasting element-wise op: output sharded like its sharded operands."""
    operands = operands if operands is not None else _operands(node)
    val = node.meta["val"]
    out_nd = out_nd if out_nd is not None else len(val.shape)
    out_shape = tuple(val.shape)
    target = None
    shards = []
    for path, a in operands:
        p = pl(a)
        if isinstance(p, Shard):
            od = p.dim + (out_nd - _ndim(a))
            shards.append((path, p))
            if not concat and a.meta["val"].shape[p.dim] != out_shape[od]:  # a split dim cannot broadcast
                return _fallback(node, shards, f"operand {a.name} is split on a dim of size "
                                               f"{a.meta['val'].shape[p.dim]} that broadcasts to {out_shape[od]}")
            if target is None:
                target = (od, p.segments, p.origin)
            elif (od, p.segments) != target[:2]:
                return _fallback(node, shards + [(pp, pl(x)) for pp, x in operands if isinstance(pl(x), Shard) and pp != path],
                                 f"operands sharded on different dims ({target[0]} vs {od})")
        elif isinstance(p, Partial):
            return _fallback(node, [], "partial operand")
    if target is None:
        return Decision(R)
    od, segs, origin = target
    copy_in, scatter_in = [], []
    for path, a in operands:
        if isinstance(pl(a), Shard):
            continue
        nd = _ndim(a)
        ad = _align(od, out_nd, nd)
        if ad < 0 or a.meta["val"].shape[ad] == 1:
            if a.name in ctx.requires_grad:
                copy_in.append(path)
        elif a.meta["val"].shape[ad] == out_shape[od]:
            scatter_in.append((path, Shard(ad, segs)))
        else:
            return _fallback(node, shards, f"operand {a.name} has size {a.meta['val'].shape[ad]} on the sharded dim")
    return Decision(Shard(od, segs, origin), kind="sharded", copy_in=tuple(copy_in), scatter_in=tuple(scatter_in))



def _unary_dim_map(node, pl, fn: Callable[[int], int | None], reason: str) -> Decision:
    """Ops on one sharded input whose output dim follows ``fn(input_dim)`` (None: no rule)."""
    x = node.args[0]
    p = pl(x)
    if not isinstance(p, Shard):
        return _fallback(node, [], "partial input") if isinstance(p, Partial) else Decision(R)
    others = [(path, a) for path, a in _operands(node)[1:] if isinstance(pl(a), (Shard, Partial))]
    if others:
        return _fallback(node, [(("a", 0), p)] + [(path, pl(a)) for path, a in others], "several sharded operands")
    d = fn(p.dim)
    if d is None:
        return _fallback(node, [(("a", 0), p)], reason)
    return Decision(Shard(d, p.segments, p.origin), kind="sharded")


def _norm_dims(dims, nd: int) -> list[int]:
    if dims is None:
        return list(range(nd))
    if isinstance(dims, int):
        dims = [dims]
    if len(dims) == 0:
        return list(range(nd))
    return [d % nd for d in dims]


def _reduction(node, pl, keepdim_index: int) -> Decision:
    x = node.args[0]
    nd = _ndim(x)
    dims = _norm_dims(node.args[1] if len(node.args) > 1 else node.kwargs.get("dim"), nd)
    keep = _arg(node, keepdim_index, "keepdim", False)

    def fn(d):
        if d in dims:
            return None
        return d if keep else d - sum(1 for r in dims if r < d)

    dec = _unary_dim_map(node, pl, fn, f"reduction over the sharded dim {dims}")
    if dec.kind == "sharded" and isinstance(node.meta["val"], (tuple, list)):
        return Decision(tuple(dec.out for _ in node.meta["val"]), kind="sharded")
    return dec


def _softmax(node, pl) -> Decision:
    x = node.args[0]
    nd = _ndim(x)
    dim = node.args[1] % nd
    p = pl(x)
    log = node.target in (aten.log_softmax.int, aten._log_softmax.default)
    if isinstance(p, Shard) and p.dim == dim and _contiguous(p) and not (log and _padded(x, p)):
        return Decision(Shard(dim, p.segments, p.origin), kind="vocab_softmax",
                        extra={"op": "log_softmax" if log else "softmax", "dim": dim, "size": Ctx.shape(x)[dim]})
    return _unary_dim_map(node, pl, lambda d: None if d == dim else d, "softmax over the sharded dim")


def _contiguous(p: Shard) -> bool:
    """One block per rank (possibly padded): the layout the vocabulary-parallel kernels read."""
    return p.segments is None or len(p.segments) == 1


def _padded(x: fx.Node, p: Shard) -> bool:
    return p.segments is not None and sum(p.segments) != Ctx.shape(x)[p.dim]


def _sum(node, pl) -> Decision:
    """A sum over the sharded dim (no padding) is a local sum and g: the partial sums add up.
    A mean is the local mean over t (the ranks hold equal parts), then g: an RMSNorm over a
    split q (some models normalise q and k before taking heads apart) stays split."""
    x = node.args[0]
    p = pl(x)
    nd = _ndim(x)
    dims = _norm_dims(node.args[1] if len(node.args) > 1 else node.kwargs.get("dim"), nd)
    if isinstance(p, Shard) and p.dim in dims and not _padded(x, p) and node.kwargs.get("dtype") is None:
        extra = {"mean_over_ranks": True} if node.target == aten.mean.dim else {}
        return Decision(R, kind="sharded", reduce_out=True, extra=extra)
    return _reduction(node, pl, 2)


def _gather(node, pl) -> Decision:
    """torch.gather along the sharded dim with a replicated index: each rank picks what falls in
    its columns (0 elsewhere) and g sums the picks (the log-probability of a label, say)."""
    x, dim, index = node.args[0], node.args[1], node.args[2]
    px, pi = pl(x), pl(index)
    nd = _ndim(x)
    dim %= nd
    if isinstance(px, Shard) and px.dim == dim and _contiguous(px) and not isinstance(pi, (Shard, Partial)):
        return Decision(R, kind="vocab_gather", reduce_out=True, extra={"dim": dim})
    if isinstance(px, Shard) and px.dim != dim and isinstance(pi, Replicate):
        return _fallback(node, [(("a", 0), px)], "gather with a replicated index over another dim")
    if isinstance(px, Shard) and isinstance(pi, Shard) and px.dim == pi.dim != dim and px.segments == pi.segments:
        return Decision(Shard(px.dim, px.segments, px.origin), kind="sharded")
    shards = [(path, q) for path, q in ((("a", 0), px), (("a", 2), pi)) if isinstance(q, Shard)]
    return _fallback(node, shards, "gather over the sharded dim")


def _nll(node, pl) -> Decision:
    x, target = node.args[0], node.args[1]
    px = pl(x)
    weight = _arg(node, 2, "weight")
    reduction = _arg(node, 3, "reduction", 1)
    ignore_index = _arg(node, 4, "ignore_index", -100)
    if isinstance(px, Shard) and px.dim == 1 and _ndim(x) == 2 and weight is None and _contiguous(px) \
            and not isinstance(pl(target), (Shard, Partial)):
        return Decision(R, kind="vocab_nll", extra={"reduction": reduction, "ignore_index": ignore_index})
    shards = [(("a", 0), px)] if isinstance(px, Shard) else []
    return _fallback(node, shards, "nll_loss with class weights or N-d input")


def _baddbmm(ctx: Ctx, node, pl) -> Decision:
    """beta * input + alpha * (b1 @ b2) (ALiBi's scores): the product split on its batch dim, the
    input sliced the same way (or, broadcast along it, read whole)."""
    inp, b1, b2 = node.args[0], node.args[1], node.args[2]
    if isinstance(pl(inp), (Shard, Partial)):
        return _fallback(node, [(("a", 0), pl(inp))] if isinstance(pl(inp), Shard) else [], "baddbmm of a split input")
    prod = _matmul(ctx, _BmmView(node, b1, b2), pl)
    remap = lambda path: ("a", path[1] + 1)  # noqa: E731  (b1, b2 are args 1, 2 of baddbmm)
    if prod.kind == "replicated":
        return prod
    if prod.kind != "sharded" or not isinstance(prod.out, Shard) or prod.out.dim != 0:
        # split on rows, columns or the contraction: the input would need slicing (or would be
        # summed t times by g), so the product runs on gathered operands
        shards = [(("a", i), pl(a)) for i, a in ((1, b1), (2, b2)) if isinstance(pl(a), Shard)]
        return _fallback(node, shards, "baddbmm with its product split on rows, columns or the contraction")
    segs = prod.out.segments
    ishape = Ctx.shape(inp)
    scatter = tuple((remap(p), q) for p, q in prod.scatter_in)
    copy = tuple(remap(p) for p in prod.copy_in)
    if len(ishape) == 3 and ishape[0] == Ctx.shape(node)[0]:
        scatter += ((("a", 0), Shard(0, segs)),)
    elif inp.name in ctx.requires_grad:
        copy += (("a", 0),)
    return Decision(prod.out, kind="sharded", copy_in=copy, scatter_in=scatter)


class _BmmView:
    """A baddbmm seen as its b1 @ b2, for the matmul rule."""

    def __init__(self, node, b1, b2):
        self.args, self.meta, self.name = (b1, b2), node.meta, node.name


def _einsum(ctx: Ctx, node, pl) -> Decision:
    """``torch.einsum`` with one subscript letter split: kept in the output, the output is split
    on it (replicated operands that carry it are sliced); summed over, every operand carrying it
    must be split, and the local sums are reduced by g."""
    eq, ops = node.args[0], node.args[1]
    if "..." in eq or "->" not in eq:
        return _fallback(node, [], "einsum with an ellipsis or an implicit output")
    ins, out = eq.replace(" ", "").split("->")
    specs = ins.split(",")
    paths = [(("a", 1, i), a) for i, a in enumerate(ops)]
    shards = [(path, pl(a)) for path, a in paths if isinstance(pl(a), Shard)]
    if any(isinstance(pl(a), Partial) for _, a in paths):
        return _fallback(node, [], "partial operand")
    letters = {(specs[path[2]][p.dim], p.segments) for path, p in shards}
    if len(letters) != 1:
        return _fallback(node, shards, "einsum operands split on different subscripts")
    (letter, segs), = letters
    origin = shards[0][1].origin
    scatter, copy = [], []
    for path, a in paths:
        if isinstance(pl(a), Shard):
            continue
        spec = specs[path[2]]
        if letter in spec and Ctx.shape(a)[spec.index(letter)] != 1:
            if letter not in out:  # summed over: every operand carrying it must be split already
                return _fallback(node, shards, "einsum summing over a subscript split on one operand only")
            scatter.append((path, Shard(spec.index(letter), segs)))
        elif a.name in ctx.requires_grad:  # read whole (or broadcast) by every rank: partial gradient
            copy.append(path)
    if letter in out:
        return Decision(Shard(out.index(letter), segs, origin), kind="sharded", copy_in=tuple(copy),
                        scatter_in=tuple(scatter))
    return Decision(R, kind="sharded", reduce_out=True, copy_in=tuple(copy))


def _logsumexp(node, pl) -> Decision:
    x = node.args[0]
    nd = _ndim(x)
    p = pl(x)
    dims = _norm_dims(node.args[1] if len(node.args) > 1 else node.kwargs.get("dim"), nd)
    keep = _arg(node, 2, "keepdim", False)
    if isinstance(p, Shard) and dims == [p.dim] and _contiguous(p):
        return Decision(R, kind="vocab_softmax",
                        extra={"op": "logsumexp", "dim": p.dim, "size": Ctx.shape(x)[p.dim], "keepdim": keep})
    return _reduction(node, pl, 2)


def _norm(ctx, node, pl, n_shape_arg: int, weight_paths: list[int]) -> Decision:
    x = node.args[0]
    p = pl(x)
    if not isinstance(p, Shard):
        return Decision(R) if not isinstance(p, Partial) else _fallback(node, [], "partial input")
    nd = _ndim(x)
    k = len(node.args[n_shape_arg])
    if p.dim >= nd - k:
        return _fallback(node, [(("a", 0), p)], "normalization over the sharded dim")
    copy_in = tuple(("a", i) for i in weight_paths if len(node.args) > i and isinstance(node.args[i], fx.Node)
                    and node.args[i].name in ctx.requires_grad)
    return Decision(Shard(p.dim, p.segments, p.origin), kind="sharded", copy_in=copy_in)


def _view_groups(ishape, oshape):
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


def _view(ctx: Ctx, node, pl) -> Decision:
    """A view or reshape of a value split on dim d (in pieces ``segments``).

    Within the group of input dims the view regroups (``_view_groups``), rank r
    holds, for every index of the group's dims before d and every segment, piece r
    of the segment times everything after d: a list of flat blocks, each cut t
    ways. The output keeps the split on the first output dim od of the group where
    those blocks are, row by row of the dims before od, the same list of segments
    of od, each a multiple of t times the size after od. So a split hidden size
    becomes split heads (h d -> h, d: heads divisible by t), a fused (q, k, v) in
    three segments becomes split head dims under an outer 3, and batch and split
    heads merged (b, h -> b h) become b segments of h, and back.
    """
    x = node.args[0]
    p = pl(x)
    if not isinstance(p, Shard):
        return Decision(R) if not isinstance(p, Partial) else _fallback(node, [], "partial input")
    t = ctx.tp
    ishape, oshape = Ctx.shape(x), Ctx.shape(node)
    d = p.dim
    segs = list(p.segments) if p.segments is not None else [ishape[d]]
    padded = sum(segs) != ishape[d]
    for gi, go in _view_groups(ishape, oshape):
        if d not in gi:
            continue
        outer_in = math.prod(ishape[k] for k in gi if k < d)
        inner_in = math.prod(ishape[k] for k in gi if k > d)
        if padded and (outer_in != 1 or inner_in != 1 or len([k for k in go if oshape[k] != 1]) != 1):
            return _fallback(node, [(("a", 0), p)], "view reshapes a padded vocabulary dim")
        flat = [s * inner_in for _ in range(outer_in) for s in segs]
        for od in go:
            if oshape[od] == 1:
                continue
            inner_out = math.prod(oshape[k] for k in go if k > od)
            rows = math.prod(oshape[k] for k in go if k < od)
            out_segs = _rows_of_segments(flat, rows, oshape[od] * inner_out if not padded else sum(flat))
            if out_segs is None or any(f % (inner_out * t) for f in out_segs):
                continue
            new = [f // inner_out for f in out_segs]
            new_segs = None if (len(new) == 1 and not padded) else tuple(new)
            local = list(oshape)
            local[od] = sum(s // t for s in new)
            return Decision(Shard(od, new_segs, p.origin), kind="sharded", local_shape=tuple(local))
        # a column-parallel output unflattened into (pieces, rest) that the ranks cannot share
        # by pieces (a packed (q, k, v)): the linear splits each piece instead
        if p.segments is None and p.origin is not None and p.origin in {n.name for n in ctx.column} \
                and outer_in == 1 and inner_in == 1:
            olead = [k for k in go if oshape[k] != 1]
            if len(olead) >= 2:
                pieces = oshape[olead[0]]
                size = ishape[d] // pieces
                if pieces > 1 and size % t == 0 and size * pieces == ishape[d]:
                    inner_out = math.prod(oshape[k] for k in go if k > olead[0])
                    err = (_split_error(ctx, node, x, d, ishape, oshape, olead[0], inner_out)
                           if pieces % t else None)
                    raise NeedSegments(p.origin, [size] * pieces, err)
        olead = [k for k in go if oshape[k] != 1]
        if not olead:
            return _fallback(node, [(("a", 0), p)], "view drops the sharded dim")
        od = olead[0]
        inner_out = math.prod(oshape[k] for k in go if k > od)
        err = None
        if outer_in == 1 and not padded and p.segments is None and inner_out > 1 and oshape[od] % t:
            err = _split_error(ctx, node, x, d, ishape, oshape, od, inner_out)
        return _fallback(node, [(("a", 0), p)], "view splits the sharded dim unevenly", error=err)
    return _fallback(node, [(("a", 0), p)], "view: sharded dim not found")


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


def _split_error(ctx, node, x, d, ishape, oshape, od, inner_out) -> str:
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


def _expand(ctx, node, pl) -> Decision:
    x = node.args[0]
    p = pl(x)
    if not isinstance(p, Shard):
        return Decision(R)
    in_nd, oshape = _ndim(x), Ctx.shape(node)
    od = p.dim + (len(oshape) - in_nd)
    if Ctx.shape(x)[p.dim] != oshape[od]:
        return _fallback(node, [(("a", 0), p)], "expand of the sharded dim")
    local = list(oshape)
    local[od] = sum(s // ctx.tp for s in (p.segments or (oshape[od],)))
    return Decision(Shard(od, p.segments, p.origin), kind="sharded", local_shape=tuple(local))


def _split(ctx, node, pl) -> Decision:
    x = node.args[0]
    p = pl(x)
    n_out = len(node.meta["val"])
    if not isinstance(p, Shard):
        return Decision(tuple(R for _ in range(n_out)))
    nd = _ndim(x)
    t = node.target
    dim = _arg(node, 2, "dim", 0) if t != aten.chunk.default else _arg(node, 2, "dim", 0)
    dim %= nd
    sizes = [int(v.shape[dim]) for v in node.meta["val"]]
    if dim != p.dim:
        return Decision(tuple(Shard(p.dim, p.segments, p.origin) for _ in sizes), kind="sharded")
    if len(sizes) == 1:
        return Decision((Shard(p.dim, p.segments, p.origin),), kind="sharded")
    if p.segments is not None and tuple(sizes) == tuple(p.segments):
        return Decision(tuple(Shard(p.dim, None, None) for _ in sizes), kind="sharded")
    if p.segments is None and p.origin is not None and p.origin in {n.name for n in ctx.column}:
        raise NeedSegments(p.origin, sizes)
    return _fallback(node, [(("a", 0), p)], "split of the sharded dim into unequal pieces")


def _cat(ctx, node, pl, stack: bool) -> Decision:
    tensors = node.args[0]
    dim = _arg(node, 1, "dim", 0)
    out_nd = _ndim(node)
    dim %= out_nd
    # cat skips 1-D empty tensors (an empty key/value cache concatenated with the new keys)
    operands = [(("a", 0, j), a) for j, a in enumerate(tensors)
                if stack or not (isinstance(a, fx.Node) and tuple(Ctx.shape(a)) == (0,))]
    dec = _elementwise(ctx, node, pl, operands=[(pth, a) for pth, a in operands],
                       out_nd=out_nd if not stack else out_nd - 1, concat=True)
    if dec.kind != "sharded":
        return dec
    od = dec.out.dim + (1 if stack and dim <= dec.out.dim else 0)
    if (not stack and od == dim) or dec.copy_in:
        shards = [(pth, pl(a)) for pth, a in operands if isinstance(pl(a), Shard)]
        return _fallback(node, shards, "concatenation along the sharded dim")
    return Decision(Shard(od, dec.out.segments, dec.out.origin), kind="sharded", scatter_in=dec.scatter_in)


def _matmul(ctx, node, pl) -> Decision:
    """A @ B, A (..., n, k), B (..., k, m): batch-dim, row (n), column (m) or contraction (k) sharding."""
    a, b = node.args[0], node.args[1]
    pa, pb = pl(a), pl(b)
    if not isinstance(pa, Shard) and not isinstance(pb, Shard):
        if isinstance(pa, Partial) or isinstance(pb, Partial):
            return _fallback(node, [], "partial operand")
        return Decision(R)
    na, nb, no = _ndim(a), _ndim(b), _ndim(node)
    if na < 2 or nb < 2:
        return _fallback(node, [(p_, q) for p_, q in ((("a", 0), pa), (("a", 1), pb)) if isinstance(q, Shard)], "1-D matmul")
    shards = [(p_, q) for p_, q in ((("a", 0), pa), (("a", 1), pb)) if isinstance(q, Shard)]
    if isinstance(pa, Shard) and isinstance(pb, Shard):
        if pa.dim == na - 1 and pb.dim == nb - 2 and pa.segments == pb.segments:
            return Decision(R, kind="row", reduce_out=True)
        oa, ob = pa.dim + (no - na), pb.dim + (no - nb)
        if pa.dim < na - 2 and pb.dim < nb - 2 and oa == ob and pa.segments == pb.segments:
            return Decision(Shard(oa, pa.segments, pa.origin), kind="sharded")
        return _fallback(node, shards, "matmul operands sharded on incompatible dims")
    # one side sharded, the other replicated
    sp, sn, snd, rn, ri = (pa, a, na, b, 1) if isinstance(pa, Shard) else (pb, b, nb, a, 0)
    rnd = _ndim(rn)
    rpath = ("a", ri)
    if sn is a and sp.dim == na - 2:  # rows of A
        out = Shard(no - 2, sp.segments, sp.origin)
    elif sn is b and sp.dim == nb - 1:  # columns of B
        out = Shard(no - 1, sp.segments, sp.origin)
    elif sp.dim < snd - 2:  # a batch dim
        od = sp.dim + (no - snd)
        ad = od - (no - rnd)
        if ad < 0 or ad >= rnd - 2 or rn.meta["val"].shape[ad] == 1:
            copy = (rpath,) if rn.name in ctx.requires_grad else ()
            return Decision(Shard(od, sp.segments, sp.origin), kind="sharded", copy_in=copy)
        return Decision(Shard(od, sp.segments, sp.origin), kind="sharded", scatter_in=((rpath, Shard(ad, sp.segments)),))
    else:
        return _fallback(node, shards, "contraction dim sharded on one operand only")
    copy = (rpath,) if rn.name in ctx.requires_grad else ()
    return Decision(out, kind="sharded", copy_in=copy)


def _linear(ctx: Ctx, node, pl, parts) -> Decision:
    xpath, w, b, w_out, w_in = parts
    x = _get(node, xpath)
    px = pl(x)
    demand = {w.name: R}
    if isinstance(b, fx.Node) and b.name in ctx.param_of:
        demand[b.name] = R
    if isinstance(px, Replicate) or px is None:
        if node in ctx.column:
            segs = ctx.column[node]
            demand = {w.name: Shard(w_out, segs)}
            if isinstance(b, fx.Node):
                demand[b.name] = Shard(0, segs)
            copy = (xpath,) if x.name in ctx.requires_grad else ()
            return Decision(Shard(_ndim(node) - 1, segs, node.name), kind="column", copy_in=copy, param_demand=demand)
        return Decision(R, param_demand=demand)
    if isinstance(px, Shard):
        nd = _ndim(x)
        if _is_grouped_mm(node.target) and px.dim != nd - 1:  # the group offsets count global rows
            return _fallback(node, [(xpath, px)], "grouped matmul with its rows split")
        if px.dim == nd - 1:
            if px.segments is not None and sum(px.segments) != Ctx.shape(x)[-1]:
                n = Ctx.shape(x)[-1]
                where = source_line(node)
                err = (f"tensor parallelism tp={ctx.tp} cannot split the linear pair {px.origin} -> {node.name} "
                       f"(module '{module_path(node)}'): {px.origin} has {n} output features, not divisible by "
                       f"tp={ctx.tp}; only a vocabulary (consumed by the cross-entropy) can be padded"
                       + (f" [{where}]" if where else "")
                       + f". Fix: use a tp that divides {n} (one of {[k for k in range(1, min(n, 64) + 1) if n % k == 0]}), "
                       f"or make the FFN/hidden size a multiple of tp.")
                return _fallback(node, [(xpath, px)], "row-parallel linear over a padded dim", error=err)
            demand[w.name] = Shard(w_in, px.segments)
            return Decision(R, kind="row", reduce_out=True, param_demand=demand)
        # a batch-like dim is split: the replicated weight and bias get f (partial gradients)
        # (the weight may be read through a view: an expert's W[e], a transposed stack)
        weight_read = _get(node, ("a", 1)) if len(node.args) > 1 else w
        copy_paths = [path for path, a in _operands(node)
                      if ((a is w or a is b) and a.name in ctx.requires_grad)
                      or (a is weight_read and a is not w and w.name in ctx.requires_grad)]
        return Decision(Shard(px.dim, px.segments, px.origin), kind="sharded", copy_in=tuple(copy_paths), param_demand=demand)
    return _fallback(node, [], "partial input")


def _embedding(ctx: Ctx, node, pl) -> Decision:
    w, ids = node.args[0], node.args[1]
    if isinstance(pl(ids), (Shard, Partial)):
        return _fallback(node, [(("a", 1), pl(ids))], "sharded embedding indices")
    if node.name in ctx.vocab_embeddings:
        rows = Ctx.shape(w)[0]
        segs = None if rows % ctx.tp == 0 else (-(-rows // ctx.tp) * ctx.tp,)
        padding_idx = _arg(node, 2, "padding_idx", -1)
        return Decision(R, kind="vocab_embedding", param_demand={w.name: Shard(0, segs)},
                        extra={"padding_idx": padding_idx})
    if _is_param(ctx, w):
        return Decision(R, param_demand={w.name: R})
    if isinstance(pl(w), Shard):
        return _fallback(node, [(("a", 0), pl(w))], "embedding of a sharded table")
    return Decision(R)


def _cross_entropy(ctx: Ctx, node, pl) -> Decision:
    x, target = node.args[0], node.args[1]
    px = pl(x)
    if not isinstance(px, Shard):
        return Decision(R) if not isinstance(pl(target), Shard) else _fallback(node, [(("a", 1), pl(target))], "sharded targets")
    weight = _arg(node, 2, "weight")
    reduction = _arg(node, 3, "reduction", 1)
    ignore_index = _arg(node, 4, "ignore_index", -100)
    smoothing = _arg(node, 5, "label_smoothing", 0.0)
    if target.meta["val"].is_floating_point():  # class probabilities, not indices: sliced like the logits
        pt = pl(target)
        if (px.dim == 1 and _ndim(x) == 2 and weight is None and _contiguous(px) and not _padded(x, px)
                and isinstance(pt, Replicate) and Ctx.shape(target) == Ctx.shape(x)):
            return Decision(R, kind="vocab_cross_entropy", scatter_in=((("a", 1), Shard(1, px.segments)),),
                            extra={"soft": True, "vocab_size": Ctx.shape(x)[1], "reduction": reduction,
                                   "label_smoothing": float(smoothing)})
        return _fallback(node, [(("a", 0), px)], "cross-entropy against class probabilities over a padded "
                                                 "or non-contiguous split")
    if px.dim == 1 and _ndim(x) == 2 and weight is None and _contiguous(px) and not isinstance(pl(target), Shard):
        return Decision(R, kind="vocab_cross_entropy",
                        extra={"vocab_size": Ctx.shape(x)[1], "ignore_index": ignore_index, "reduction": reduction,
                               "label_smoothing": float(smoothing)})
    return _fallback(node, [(("a", 0), px)], "cross-entropy with class weights or N-d input")


def _sdpa(ctx: Ctx, node, pl) -> Decision:
    q, k, v = node.args[0], node.args[1], node.args[2]
    mask = _arg(node, 3, "attn_mask")
    qkv = [(("a", i), a) for i, a in enumerate((q, k, v))]
    pls = [pl(a) for _, a in qkv]
    shards = [(path, p) for (path, _), p in zip(qkv, pls) if isinstance(p, Shard)]
    if not shards:
        if isinstance(mask, fx.Node) and isinstance(pl(mask), Shard):
            return _fallback(node, [(("a", 3) if len(node.args) > 3 else ("k", "attn_mask"), pl(mask))], "sharded mask")
        return Decision(R)
    dims = {(p.dim, p.segments) for _, p in shards}
    if len(dims) != 1 or next(iter(dims))[0] >= 2:
        return _fallback(node, shards, "attention sharded on a sequence or head-size dim")
    d, segs = next(iter(dims))
    scatter, copy = [], []
    for (path, a), p in zip(qkv, pls):
        if isinstance(p, Shard):
            continue
        if Ctx.shape(a)[d] % ctx.tp:
            return _fallback(node, shards, "replicated q/k/v head count not divisible by tp")
        scatter.append((path, Shard(d, segs)))
    if isinstance(mask, fx.Node):
        path = ("a", 3) if len(node.args) > 3 else ("k", "attn_mask")
        pm = pl(mask)
        if isinstance(pm, Shard):
            if pm.dim != d - (4 - _ndim(mask)):
                return _fallback(node, shards + [(path, pm)], "mask sharded differently from the heads")
        else:
            ad = d - (4 - _ndim(mask))
            if ad < 0 or mask.meta["val"].shape[ad] == 1:
                if mask.name in ctx.requires_grad:
                    copy.append(path)
            else:
                scatter.append((path, Shard(ad, segs)))
    return Decision(Shard(d, segs, shards[0][1].origin), kind="sharded", copy_in=tuple(copy), scatter_in=tuple(scatter))


def _slice_range(node: fx.Node) -> tuple[int, int, int, int]:
    """(dim, start, end, step) of an aten.slice, normalised to the input's size."""
    x = node.args[0]
    nd = _ndim(x)
    dim = _arg(node, 1, "dim", 0) % nd
    size = Ctx.shape(x)[dim]
    start, end, step = _arg(node, 2, "start"), _arg(node, 3, "end"), _arg(node, 4, "step", 1)
    start = 0 if start is None else (start + size if start < 0 else min(start, size))
    end = size if end is None else (end + size if end < 0 else min(end, size))
    return dim, start, end, step


def slice_pieces(x: fx.Node, dim: int) -> list[tuple[int, int]] | None:
    """The ranges of ``x``'s slices along ``dim`` when they cut it into contiguous pieces."""
    ranges = []
    for u in x.users:
        if u.target != aten.slice.Tensor:
            continue
        d, start, end, step = _slice_range(u)
        if d != dim or step != 1:
            return None
        ranges.append((start, end))
    ranges = sorted(set(ranges))
    size = Ctx.shape(x)[dim]
    if not ranges or ranges[0][0] != 0 or ranges[-1][1] != size:
        return None
    if any(a[1] != b[0] for a, b in zip(ranges, ranges[1:])):
        return None
    return ranges


def _slice(ctx: Ctx, node, pl) -> Decision:
    """Slices of the sharded dim that cut it into pieces (a fused QKV sliced into q, k, v), or
    that take every step-th entry of it."""
    x = node.args[0]
    p = pl(x)
    dim, start, end, step = _slice_range(node)
    size = Ctx.shape(x)[dim]
    if not isinstance(p, Shard) or p.dim != dim or (start == 0 and end >= size and step == 1):
        return _unary_dim_map(node, pl, lambda d: d, "")
    if p.segments is None and step > 1 and start < step and end >= size and (size // ctx.tp) % step == 0:
        # every step-th entry (gate and up interleaved): each rank's block starts on a multiple of
        # step, so its own every step-th entries are its block of the result
        return Decision(Shard(dim, None, p.origin), kind="sharded")
    pieces = slice_pieces(x, dim)
    if pieces is not None:
        sizes = tuple(b - a for a, b in pieces)
        if p.segments is not None and tuple(p.segments) == sizes:
            return Decision(Shard(dim, None, None), kind="sharded", extra={"slice_piece": pieces.index((start, end))})
        if p.segments is None and p.origin is not None and p.origin in {n.name for n in ctx.column}:
            raise NeedSegments(p.origin, list(sizes))
    return _fallback(node, [(("a", 0), p)], "slice of the sharded dim")


def _transpose(node, pl) -> Decision:
    nd = _ndim(node.args[0])
    a, b = node.args[1] % nd, node.args[2] % nd
    return _unary_dim_map(node, pl, lambda d: b if d == a else a if d == b else d, "")


def _permute(node, pl) -> Decision:
    nd = _ndim(node.args[0])
    dims = [x % nd for x in node.args[1]]
    return _unary_dim_map(node, pl, lambda d: dims.index(d), "")


def _unsqueeze(node, pl) -> Decision:
    k = node.args[1] % (_ndim(node.args[0]) + 1)
    return _unary_dim_map(node, pl, lambda d: d + 1 if k <= d else d, "")


def _squeeze(node, pl) -> Decision:
    ishape, nd = Ctx.shape(node.args[0]), _ndim(node.args[0])
    dims = node.args[1] if len(node.args) > 1 else None
    dims = list(range(nd)) if dims is None else _norm_dims(dims, nd)
    removed = [k for k in dims if ishape[k] == 1]
    return _unary_dim_map(node, pl, lambda d: None if d in removed else d - sum(1 for r in removed if r < d), "squeeze of the sharded dim")


def _select(node, pl) -> Decision:
    nd = _ndim(node.args[0])
    dim = node.args[1] % nd
    return _unary_dim_map(node, pl, lambda d: None if d == dim else d - (1 if dim < d else 0), "select on the sharded dim")


def _unbind(node, pl) -> Decision:
    x = node.args[0]
    nd = _ndim(x)
    dim = _arg(node, 1, "dim", 0) % nd
    n_out = len(node.meta["val"])
    dec = _unary_dim_map(node, pl, lambda d: None if d == dim else d - (1 if dim < d else 0), "unbind of the sharded dim")
    if dec.kind == "sharded":
        return Decision(tuple(dec.out for _ in range(n_out)), kind="sharded")
    if dec.kind == "replicated":
        return Decision(tuple(R for _ in range(n_out)))
    return dec


def _tril(node, pl) -> Decision:
    nd = _ndim(node.args[0])
    return _unary_dim_map(node, pl, lambda d: d if d < nd - 2 else None, "triangular mask over the sharded dim")


def _dim_arg_op(index: int, default=None):
    """Ops that act along one dim given by argument ``index`` (cumsum, flip...)."""

    def rule(node, pl):
        nd = _ndim(node.args[0])
        dims = _norm_dims(_arg(node, index, "dim", default), nd)
        return _unary_dim_map(node, pl, lambda d: None if d in dims else d, f"{node.target} along the sharded dim")

    return rule


def _pad(node, pl) -> Decision:
    nd = _ndim(node.args[0])
    pads = node.args[1]
    padded = {nd - 1 - i // 2 for i, v in enumerate(pads) if v != 0}
    return _unary_dim_map(node, pl, lambda d: None if d in padded else d, "padding of the sharded dim")


_UNARY_SAME = {
    aten.clone.default, aten._to_copy.default, aten.contiguous.default, aten.alias.default,
    aten.detach.default, aten.lift_fresh_copy.default, aten.dropout.default, aten.to.dtype,
    aten.to.dtype_layout, aten.zeros_like.default, aten.ones_like.default, aten.empty_like.default,
    aten.full_like.default, aten.native_dropout.default, aten.feature_dropout.default,
    aten.type_as.default,
}

_VIEW = {aten.view.default, aten.reshape.default, aten._unsafe_view.default}
_SPLIT = {aten.split.Tensor, aten.split_with_sizes.default, aten.chunk.default, aten.unsafe_split.Tensor,
          aten.split.sizes}

_REDUCTIONS = {
    aten.sum.dim_IntList: 2, aten.mean.dim: 2, aten.amax.default: 2, aten.amin.default: 2,
    aten.logsumexp.default: 2, aten.max.dim: 2, aten.min.dim: 2, aten.argmax.default: 2,
    aten.argmin.default: 2, aten.var.correction: 3, aten.std.correction: 3, aten.var_mean.correction: 3,
    aten.prod.dim_int: 2, aten.any.dim: 2, aten.all.dim: 2,
}
_FULL_REDUCTIONS = {aten.sum.default, aten.mean.default, aten.max.default, aten.min.default, aten.amax.default}


def _unary_same(node, pl) -> Decision:
    x = node.args[0]
    p = pl(x)
    if isinstance(p, Shard):
        if isinstance(node.meta["val"], (tuple, list)):
            return Decision(tuple(p for _ in node.meta["val"]), kind="sharded")
        return Decision(p, kind="sharded")
    if isinstance(p, Partial):
        return _fallback(node, [], "partial input")
    return Decision(R)


def _weight_view(ctx: Ctx, node: fx.Node, param: fx.Node) -> bool:
    if node.target not in (aten.transpose.int, aten.select.int) or node.args[0] is not param or not node.users:
        return False
    for u in node.users:
        parts = linear_parts(ctx, u)
        if parts is None or parts[1] is not param or _get(u, parts[0]) is node:
            return False
    return True


def decide(ctx: Ctx, node: fx.Node, pl: Callable) -> Decision:
    """The placement of ``node``'s output and the collectives around it."""
    if node.op != "call_function":
        return Decision(R)
    t = node.target
    if t is operator.getitem:
        src = pl(node.args[0])
        if isinstance(src, tuple):
            return Decision(src[node.args[1]], kind="sharded" if isinstance(src[node.args[1]], Shard) else "replicated")
        return Decision(R)
    dec = _decide(ctx, node, pl)
    # every parameter an op reads without asking for a shard is read whole, except through a
    # view that only linear-like ops use as their weight (an expert's W[e], a transposed stack):
    # those linears say how the parameter is split
    demand = dict(dec.param_demand)
    for _, a in _operands(node):
        if _is_param(ctx, a) and a.name not in demand and not _weight_view(ctx, node, a):
            demand[a.name] = R
    if demand != dec.param_demand:
        dec = Decision(**{**dec.__dict__, "param_demand": demand})
    return dec


def _decide(ctx: Ctx, node: fx.Node, pl: Callable) -> Decision:
    t = node.target
    parts = linear_parts(ctx, node)
    if parts is not None:
        return _linear(ctx, node, pl, parts)
    if t == aten.embedding.default:
        return _embedding(ctx, node, pl)
    if t == aten.cross_entropy_loss.default:
        return _cross_entropy(ctx, node, pl)
    operands = _operands(node)
    sharded = [(path, a, pl(a)) for path, a in operands if isinstance(pl(a), (Shard, Partial))]
    if not sharded:
        if isinstance(node.meta.get("val"), (tuple, list)):
            return Decision(tuple(R for _ in node.meta["val"]))
        return Decision(R)
    if t in _VIEW:
        return _view(ctx, node, pl)
    if t in (aten.flatten.using_ints, aten.unflatten.int):
        dec = _view(ctx, node, pl)  # dims-based: only unflatten's sizes need localizing
        if dec.local_shape is not None and t == aten.flatten.using_ints:
            dec = Decision(**{**dec.__dict__, "local_shape": None})
        return dec
    if t == aten.expand.default:
        return _expand(ctx, node, pl)
    if t in _SPLIT:
        return _split(ctx, node, pl)
    if t in _UNARY_SAME:
        return _unary_same(node, pl)
    if t in (aten.cat.default, aten.stack.default):
        return _cat(ctx, node, pl, stack=t == aten.stack.default)
    if t in (aten.matmul.default, aten.bmm.default, aten.mm.default):
        return _matmul(ctx, node, pl)
    if t == aten.scaled_dot_product_attention.default:
        return _sdpa(ctx, node, pl)
    if t in (aten.layer_norm.default,):
        return _norm(ctx, node, pl, 1, [2, 3])
    if t == aten.rms_norm.default:
        return _norm(ctx, node, pl, 1, [2])
    if t == aten.logsumexp.default:
        return _logsumexp(node, pl)
    if t in (aten.sum.dim_IntList, aten.mean.dim):
        return _sum(node, pl)
    if t == aten.gather.default:
        return _gather(node, pl)
    if t in (aten.nll_loss_nd.default, aten.nll_loss.default):
        return _nll(node, pl)
    if t in _REDUCTIONS:
        return _reduction(node, pl, _REDUCTIONS[t])
    if t in (aten.softmax.int, aten._softmax.default, aten.log_softmax.int, aten._log_softmax.default):
        return _softmax(node, pl)
    if t == aten.slice.Tensor:
        return _slice(ctx, node, pl)
    if t == aten.transpose.int:
        return _transpose(node, pl)
    if t == aten.einsum.default:
        return _einsum(ctx, node, pl)
    if t == aten.baddbmm.default:
        return _baddbmm(ctx, node, pl)
    if t == aten.view_as_complex.default:  # (..., n, 2) real -> (..., n) complex: rotary embeddings
        last = _ndim(node.args[0]) - 1
        return _unary_dim_map(node, pl, lambda d: None if d == last else d, "view_as_complex of the split pairs")
    if t == aten.view_as_real.default:  # (..., n) complex -> (..., n, 2) real
        return _unary_dim_map(node, pl, lambda d: d, "")
    if t == aten.t.default:
        return _unary_dim_map(node, pl, lambda d: 1 - d, "")
    if t == aten.permute.default:
        return _permute(node, pl)
    if t == aten.unsqueeze.default:
        return _unsqueeze(node, pl)
    if t in (aten.squeeze.dim, aten.squeeze.dims, aten.squeeze.default):
        return _squeeze(node, pl)
    if t == aten.select.int:
        return _select(node, pl)
    if t == aten.unbind.int:
        return _unbind(node, pl)
    if t in (aten.tril.default, aten.triu.default):
        return _tril(node, pl)
    if t in (aten.cumsum.default, aten.cumprod.default):
        return _dim_arg_op(1)(node, pl)
    if t == aten.flip.default:
        return _dim_arg_op(1)(node, pl)
    if t == aten.roll.default:
        return _dim_arg_op(2)(node, pl)
    if t == aten.constant_pad_nd.default:
        return _pad(node, pl)
    if isinstance(t, torch._ops.OpOverload) and torch.Tag.pointwise in t.tags:
        return _elementwise(ctx, node, pl)
    shards = [(path, p) for path, _, p in sharded if isinstance(p, Shard)]
    return _fallback(node, shards, f"no sharding rule for {t}")
