"""``decide``: the decision for one node, from the rule the registry finds for its target."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

import torch
import torch.fx as fx

from autopar.core.tensor_placement import Partial, Shard
from passes.rules.context import Ctx, is_param, operand, operands
from passes.rules.decision import R, Decision, fallback, is_split, replicated
from passes.rules.matmul import linear_parts
from passes.rules.registry import RULES

__all__ = ["decide"]

_aten = torch.ops.aten


def decide(ctx: Ctx, node: fx.Node, placement_of: Callable[[fx.Node], object]) -> Decision:
    """The placement of ``node``'s output and the collectives around it.

    A node none of whose inputs is split is replicated, unless its rule asks to
    decide that case too (``replicated_inputs``). A node with a split input and
    no rule runs replicated on gathered inputs (a fallback).
    """
    if node.op != "call_function":
        return Decision(R)
    pl = {a: placement_of(a) for a in node.all_input_nodes}
    entry = RULES.lookup(node.target)
    if entry is not None and entry.replicated_inputs:
        dec = entry(ctx, node, pl)
    elif not any(is_split(p) for p in pl.values()):
        dec = replicated(node)
    elif any(isinstance(p, Partial) for p in pl.values()):  # no rule reads partial sums (none makes them)
        dec = fallback([], "partial input")
    elif entry is None:
        shards = [(path, pl[a]) for path, a in operands(node) if isinstance(pl[a], Shard)]
        dec = fallback(shards, f"no sharding rule for {node.target}")
    else:
        dec = entry(ctx, node, pl)
    return _whole_parameters(ctx, node, dec)


def _whole_parameters(ctx: Ctx, node: fx.Node, dec: Decision) -> Decision:
    """Every parameter an op reads without asking for a shard is read whole, except through a
    view that only linear-like ops use as their weight (an expert's W[e], a transposed stack):
    those linears say how the parameter is split."""
    demand = dict(dec.param_demand)
    for _, a in operands(node):
        if is_param(ctx, a) and a.name not in demand and not _weight_view(ctx, node, a):
            demand[a.name] = R
    if demand == dec.param_demand:
        return dec
    return replace(dec, param_demand=demand)


def _weight_view(ctx: Ctx, node: fx.Node, param: fx.Node) -> bool:
    if node.target not in (_aten.transpose.int, _aten.select.int) or node.args[0] is not param or not node.users:
        return False
    for u in node.users:
        parts = linear_parts(ctx, u)
        if parts is None or parts.weight is not param or operand(u, parts.x_path) is node:
            return False
    return True

