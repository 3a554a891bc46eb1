"""The matmul family: linears whose weight is a parameter (split column- or row-wise), and
products of activations, all decided by the einsum rule (``einsum.contract``).

A *linear-like* node multiplies an activation x (..., k) by a weight parameter:
``linear(x, W)`` (W (n, k), or one expert ``W[e]`` of a stacked (E, n, k)),
``x @ W`` / ``mm`` / ``addmm`` (W (k, n)), or a grouped matmul of a
mixture-of-experts layer reading a stacked W (E, k, n). The analysis tries it
column-parallel (``Ctx.column``: W split on n, output split on n) and, where x
arrives split on k, it becomes row-parallel (W split on k, output a partial
sum, g after it, the bias added once).
"""

from __future__ import annotations

from dataclasses import replace
from typing import NamedTuple

import torch
import torch.fx as fx

from autopar.core.graph import module_path, source_line
from autopar.core.tensor_placement import Replicate, Shard
from passes.rules.context import Ctx, Path, arg, arg_path, is_param, ndim, operand, operands, shape
from passes.rules.decision import R, Decision, fallback, is_split, replicated
from passes.rules.einsum import BADDBMM, EINSUM, MATMUL, Equation, contract, equation_of, linear_equation
from passes.rules.registry import Placements, register_rule

__all__ = ["GROUPED_MM_OPS", "LinearParts", "linear_parts", "weight_of", "out_features"]

aten = torch.ops.aten

GROUPED_MM_OPS = ("aten::_grouped_mm", "transformers::grouped_mm_fallback", "autopar::grouped_mm")
"""Grouped matmuls of mixture-of-experts layers: x (S, K) @ W (E, K, N), rows grouped by expert
(by name: a library registers its op when the model's module is imported; ``autopar::grouped_mm``
is the reference MoE model's, ``autopar/core/grouped_mm.py``)."""


class LinearParts(NamedTuple):
    x_path: Path
    weight: fx.Node
    """The weight parameter (2-D, or a stacked 3-D one)."""
    bias: fx.Node | None
    w_out: int
    """The weight parameter's output-feature dim."""
    w_in: int
    """The weight parameter's input-feature dim."""
    equation: Equation
    """x times the weight as read (through a view), plus the bias."""


def _is_grouped_mm(target) -> bool:
    return isinstance(target, torch._ops.OpOverload) and target._schema.name in GROUPED_MM_OPS


def _expert_weight(ctx: Ctx, w) -> tuple[fx.Node, bool] | None:
    """(3-D parameter, transposed) when ``w`` is a stacked expert weight or its transpose(-2, -1)."""
    if is_param(ctx, w) and ndim(w) == 3:
        return w, False
    if (isinstance(w, fx.Node) and w.op == "call_function" and w.target == aten.transpose.int
            and is_param(ctx, w.args[0]) and ndim(w.args[0]) == 3 and sorted(d % 3 for d in w.args[1:3]) == [1, 2]):
        return w.args[0], True
    return None


def linear_parts(ctx: Ctx, node: fx.Node) -> LinearParts | None:
    """The parts of a linear-like node (see the module docstring), or None if it is not one; kept in
    ``ctx.linear_parts``."""
    try:
        return ctx.linear_parts[node]
    except KeyError:
        parts = ctx.linear_parts[node] = _linear_parts(ctx, node)
        return parts


def _linear_parts(ctx: Ctx, node: fx.Node) -> LinearParts | None:
    if node.op != "call_function":
        return None
    target = node.target
    if _is_grouped_mm(target):
        got = _expert_weight(ctx, node.args[1])
        if got is None:
            return None
        w, transposed = got  # the op reads (E, K, N): W stored (E, N, K) and transposed, or as is
        w_out, w_in = (1, 2) if transposed else (2, 1)
        return LinearParts(("a", 0), w, None, w_out, w_in, linear_equation(node, ("a", 0), ("a", 1), "ekn", None))
    if target == aten.linear.default:
        w, bias = node.args[1], arg(node, 2, "bias")
        if isinstance(w, fx.Node) and w.target == aten.select.int:  # one expert: W[e] (out, in) of W (E, out, in)
            stacked = w.args[0]
            if is_param(ctx, stacked) and ndim(stacked) == 3 and w.args[1] % 3 == 0 and bias is None:
                return LinearParts(("a", 0), stacked, None, 1, 2,
                                   linear_equation(node, ("a", 0), ("a", 1), "nk", None))
            return None
        if is_param(ctx, w) and ndim(w) == 2:
            return LinearParts(("a", 0), w, bias, 0, 1,
                               linear_equation(node, ("a", 0), ("a", 1), "nk", arg_path(node, 2, "bias")))
    elif target == aten.addmm.default:
        w = node.args[2]
        if is_param(ctx, w) and ndim(w) == 2 and arg(node, 3, "beta", 1) == 1 and arg(node, 4, "alpha", 1) == 1:
            return LinearParts(("a", 1), w, node.args[0], 1, 0,
                               linear_equation(node, ("a", 1), ("a", 2), "kn", ("a", 0)))
    elif target in (aten.mm.default, aten.matmul.default):
        w = node.args[1]
        if is_param(ctx, w) and ndim(w) == 2:
            return LinearParts(("a", 0), w, None, 1, 0, linear_equation(node, ("a", 0), ("a", 1), "kn", None))
    return None


def weight_of(ctx: Ctx, node: fx.Node) -> fx.Node:
    """The weight parameter of a linear-like node."""
    return linear_parts(ctx, node).weight


def out_features(ctx: Ctx, node: fx.Node) -> int:
    """The output features of a linear-like node (its weight's output-feature dim)."""
    parts = linear_parts(ctx, node)
    return shape(parts.weight)[parts.w_out]


def parallel_linear(ctx: Ctx, node: fx.Node, pl: Placements, parts: LinearParts) -> Decision:
    """A linear-like node: column-parallel when tried so (x replicated), row-parallel when x
    arrives split on its input features, split alike when x is split on a batch-like dim."""
    x_path, w, bias = parts.x_path, parts.weight, parts.bias
    x = operand(node, x_path)
    px = pl[x]
    (_, x_spec), (w_path, w_spec) = parts.equation.factors
    w_read = operand(node, w_path)
    demand = {w.name: R}
    if is_param(ctx, bias):
        demand[bias.name] = R
    if isinstance(px, Replicate):
        if node not in ctx.column:
            return Decision(R, param_demand=demand)
        return _column(ctx, node, pl, parts, w_read, w_spec)
    if _is_grouped_mm(node.target) and px.dim != ndim(x) - 1:  # the group offsets count global rows
        return fallback([(x_path, px)], "grouped matmul with its rows split")
    if px.dim != ndim(x) - 1:  # a batch-like dim: the weight is read whole (f: partial gradients)
        return replace(contract(ctx, node, pl, parts.equation, MATMUL), param_demand=demand)
    if px.segments is not None and sum(px.segments) != shape(x)[-1]:
        return fallback([(x_path, px)], "row-parallel linear over a padded dim",
                        error=_padded_row_error(ctx, node, x, px))
    demand[w.name] = Shard(parts.w_in, px.segments)
    row = contract(ctx, node, pl, parts.equation, MATMUL, override={w_read: Shard(w_spec.index("k"), px.segments)})
    return replace(row, param_demand=demand)


def _column(ctx: Ctx, node: fx.Node, pl: Placements, parts: LinearParts, w_read: fx.Node, w_spec: str) -> Decision:
    """Column-parallel: the weight (and a bias parameter) split on the output features, each in
    the linear's segments; x read whole (f)."""
    segs = ctx.column[node]
    override = {w_read: Shard(w_spec.index("n"), segs, node.name)}
    demand = {parts.weight.name: Shard(parts.w_out, segs)}
    if is_param(ctx, parts.bias):
        bias_spec = parts.equation.addend[1]
        override[parts.bias] = demand[parts.bias.name] = Shard(bias_spec.index("n"), segs)
    dec = contract(ctx, node, pl, parts.equation, MATMUL, override=override)
    if dec.kind != "sharded":
        return dec
    return replace(dec, kind="column", param_demand=demand)


def _padded_row_error(ctx: Ctx, node: fx.Node, x: fx.Node, px: Shard) -> str:
    n = shape(x)[-1]
    where = source_line(node)
    return (f"tensor parallelism tp={ctx.tp} cannot split the linear pair {px.origin} -> {node.name} "
            f"(module '{module_path(node)}'): {px.origin} has {n} output features, not divisible by "
            f"tp={ctx.tp}; only a vocabulary (consumed by the cross-entropy) can be padded"
            + (f" [{where}]" if where else "")
            + f". Fix: use a tp that divides {n} (one of {[k for k in range(1, min(n, 64) + 1) if n % k == 0]}), "
            f"or make the FFN/hidden size a multiple of tp.")


@register_rule(aten.linear.default, aten.addmm.default, aten.mm.default, aten.matmul.default, *GROUPED_MM_OPS,
               replicated_inputs=True)
def matmul_family(ctx: Ctx, node: fx.Node, pl: Placements) -> Decision:
    """A linear-like node (its weight a parameter) is a parallel linear; otherwise a product of
    activations, decided by its einsum equation once some operand is split."""
    parts = linear_parts(ctx, node)
    if parts is not None:
        return parallel_linear(ctx, node, pl, parts)
    if not any(is_split(p) for p in pl.values()):
        return replicated(node)
    eq = equation_of(node)
    if isinstance(eq, str):  # a 1-D matmul; a grouped matmul of activations
        reason = eq if not _is_grouped_mm(node.target) else f"no sharding rule for {node.target}"
        return fallback(_split_operands(node, pl), reason)
    return contract(ctx, node, pl, eq, MATMUL)


def _split_operands(node: fx.Node, pl: Placements) -> list:
    return [(path, pl[a]) for path, a in operands(node) if isinstance(pl[a], Shard)]


@register_rule(aten.bmm.default)
def bmm(ctx: Ctx, node: fx.Node, pl: Placements) -> Decision:
    return contract(ctx, node, pl, equation_of(node), MATMUL)


@register_rule(aten.baddbmm.default)
def baddbmm(ctx: Ctx, node: fx.Node, pl: Placements) -> Decision:
    return contract(ctx, node, pl, equation_of(node), BADDBMM)


@register_rule(aten.einsum.default)
def einsum(ctx: Ctx, node: fx.Node, pl: Placements) -> Decision:
    """``torch.einsum`` with one subscript letter split (see ``einsum.py``)."""
    eq = equation_of(node)
    if isinstance(eq, str):  # an ellipsis or an implicit output
        return fallback(_split_operands(node, pl), eq)
    return contract(ctx, node, pl, eq, EINSUM)
