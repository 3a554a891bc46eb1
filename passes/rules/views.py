"""Ops whose output dims follow their input's dims: one dimension-map table, one rule.

Each entry of ``DIM_MAPS`` reads a node and gives a ``DimMap``: the output dim
that a split input dim becomes, or None where the op mixes values along that
dim (then the op runs on the gathered input, for ``reason``). Views
(transpose, permute, squeeze, select, ...), ops along given dims (cumsum,
flip, tril, padding) and reductions (amax, var, argmax, ...) are all such
maps. Views that regroup dims (view, reshape, flatten) or cut the split dim
(split, slice) have their own rules in ``reshape.py``.
"""

from __future__ import annotations

import operator
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.fx as fx

from autopar.core.tensor_placement import Shard
from passes.rules.context import Ctx, arg, ndim, norm_dims, operands, shape
from passes.rules.decision import R, Decision, fallback, is_split, replicated
from passes.rules.registry import Placements, register_rule

__all__ = ["DimMap", "DIM_MAPS", "map_dims", "reduction_map"]

aten = torch.ops.aten


@dataclass(frozen=True)
class DimMap:
    out_dim: Callable[[int], int | None]
    """The output dim of a split input dim; None: the op mixes values along it."""
    reason: str = ""
    """Why the op falls back when ``out_dim`` gives None."""


def map_dims(node: fx.Node, pl: Placements, dim_map: DimMap) -> Decision:
    """The decision of an op on one split input (argument 0) whose output dims follow ``dim_map``."""
    p = pl[node.args[0]]
    if not isinstance(p, Shard):
        return replicated(node)
    others = [(path, a) for path, a in operands(node)[1:] if is_split(pl[a])]
    if others:
        return fallback([(("a", 0), p)] + [(path, pl[a]) for path, a in others], "several sharded operands")
    d = dim_map.out_dim(p.dim)
    if d is None:
        return fallback([(("a", 0), p)], dim_map.reason)
    out = Shard(d, p.segments, p.origin)
    if isinstance(node.meta["val"], (tuple, list)):  # max.dim, var_mean, unbind: every output alike
        return Decision(tuple(out for _ in node.meta["val"]), kind="sharded")
    return Decision(out, kind="sharded")


def _removing(dims: list[int], keep: bool) -> Callable[[int], int | None]:
    """Dims ``dims`` reduced away (kept as size 1 with ``keep``): the others shift down."""
    return lambda d: None if d in dims else d if keep else d - sum(1 for r in dims if r < d)


def _transpose(node: fx.Node) -> DimMap:
    nd = ndim(node.args[0])
    a, b = node.args[1] % nd, node.args[2] % nd
    return DimMap(lambda d: b if d == a else a if d == b else d)


def _permute(node: fx.Node) -> DimMap:
    nd = ndim(node.args[0])
    dims = [x % nd for x in node.args[1]]
    return DimMap(dims.index)


def _unsqueeze(node: fx.Node) -> DimMap:
    k = node.args[1] % (ndim(node.args[0]) + 1)
    return DimMap(lambda d: d + 1 if k <= d else d)


def _squeeze(node: fx.Node) -> DimMap:
    x = node.args[0]
    dims = norm_dims(node.args[1] if len(node.args) > 1 else None, ndim(x))
    removed = [k for k in dims if shape(x)[k] == 1]
    return DimMap(_removing(removed, keep=False), "squeeze of the sharded dim")


def _select(node: fx.Node) -> DimMap:
    dim = node.args[1] % ndim(node.args[0])
    return DimMap(_removing([dim], keep=False), "select on the sharded dim")


def _unbind(node: fx.Node) -> DimMap:
    dim = arg(node, 1, "dim", 0) % ndim(node.args[0])
    return DimMap(_removing([dim], keep=False), "unbind of the sharded dim")


def _view_as_complex(node: fx.Node) -> DimMap:
    """(..., n, 2) real -> (..., n) complex: rotary embeddings."""
    last = ndim(node.args[0]) - 1
    return DimMap(lambda d: None if d == last else d, "view_as_complex of the split pairs")


def _triangular(node: fx.Node) -> DimMap:
    nd = ndim(node.args[0])
    return DimMap(lambda d: d if d < nd - 2 else None, "triangular mask over the sharded dim")


def _along(index: int, name: str) -> Callable[[fx.Node], DimMap]:
    """Ops that mix values along the dims given by argument ``index`` (cumsum, flip, roll)."""

    def dim_map(node: fx.Node) -> DimMap:
        dims = norm_dims(arg(node, index, name), ndim(node.args[0]))
        return DimMap(lambda d: None if d in dims else d, f"{node.target} along the sharded dim")

    return dim_map


def _pad(node: fx.Node) -> DimMap:
    nd = ndim(node.args[0])
    padded = {nd - 1 - i // 2 for i, v in enumerate(node.args[1]) if v != 0}
    return DimMap(lambda d: None if d in padded else d, "padding of the sharded dim")


def reduction_map(keepdim_index: int) -> Callable[[fx.Node], DimMap]:
    """A reduction over ``dim`` (argument 1; none or empty: all) keeping them with ``keepdim``."""

    def dim_map(node: fx.Node) -> DimMap:
        dims = norm_dims(node.args[1] if len(node.args) > 1 else node.kwargs.get("dim"), ndim(node.args[0]))
        keep = arg(node, keepdim_index, "keepdim", False)
        return DimMap(_removing(dims, keep), f"reduction over the sharded dim {dims}")

    return dim_map


DIM_MAPS: dict[torch._ops.OpOverload, Callable[[fx.Node], DimMap]] = {
    # views
    aten.transpose.int: _transpose,
    aten.t.default: lambda node: DimMap(lambda d: 1 - d),
    aten.permute.default: _permute,
    aten.unsqueeze.default: _unsqueeze,
    aten.squeeze.dim: _squeeze,
    aten.squeeze.dims: _squeeze,
    aten.squeeze.default: _squeeze,
    aten.select.int: _select,
    aten.unbind.int: _unbind,
    aten.view_as_complex.default: _view_as_complex,
    aten.view_as_real.default: lambda node: DimMap(lambda d: d),  # (..., n) complex -> (..., n, 2) real
    # ops along some dims
    aten.tril.default: _triangular,
    aten.triu.default: _triangular,
    aten.cumsum.default: _along(1, "dim"),
    aten.cumprod.default: _along(1, "dim"),
    aten.flip.default: _along(1, "dims"),
    aten.roll.default: _along(2, "dims"),
    aten.constant_pad_nd.default: _pad,
    # reductions (sum, mean, logsumexp: own rules that fall back to reduction_map(2))
    **{op: reduction_map(keepdim_index) for op, keepdim_index in (
        (aten.amax.default, 2), (aten.amin.default, 2), (aten.max.dim, 2), (aten.min.dim, 2),
        (aten.argmax.default, 2), (aten.argmin.default, 2), (aten.prod.dim_int, 2), (aten.any.dim, 2),
        (aten.all.dim, 2), (aten.var.correction, 3), (aten.std.correction, 3), (aten.var_mean.correction, 3))},
}
"""Op -> its dimension map."""


@register_rule(*DIM_MAPS)
def dim_map_rule(ctx: Ctx, node: fx.Node, pl: Placements) -> Decision:
    return map_dims(node, pl, DIM_MAPS[node.target](node))


@register_rule(operator.getitem, replicated_inputs=True)
def getitem(ctx: Ctx, node: fx.Node, pl: Placements) -> Decision:
    """One output of a multi-output op: its placement."""
    src = pl[node.args[0]]
    if isinstance(src, tuple):
        out = src[node.args[1]]
        return Decision(out, kind="sharded" if isinstance(out, Shard) else "replicated")
    return Decision(R)
