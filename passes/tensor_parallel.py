"""Rewrite a traced graph into the per-rank tensor-parallel program.

Input: the traced graph and a ``ShardingPlan``. Output: a graph with a first
placeholder ``tp`` (a ``TPGroup``) in which

- parameters are the local shards (the engine feeds them),
- every view/reshape/expand/split/slice on a split value uses local sizes,
- f (``copy_to_tp``) sits before each column-parallel region (one per source
  value: Q, K and V share one), g (``reduce_from_tp``) after each row-parallel
  linear, whose bias is then added once,
- ops a rule replaces are replaced (the embedding and losses over a split
  vocabulary by their vocabulary-parallel kernels, ``passes/vocab_parallel.py``),
- ops without a rule get their split inputs all-gathered (fallbacks),
- random ops on split values (attention dropout) draw from a per-rank
  stream (``comm.tp_rng_call``); replicated ones share the default stream.

Everything to insert is read from each node's ``Decision``: this pass knows
no op by name. The graph is the same on every tensor-parallel rank; ranks
differ only in the ``TPGroup`` they pass, so ``program.code(rank)`` prints it
with the rank's shard ranges.
"""

from __future__ import annotations

import copy

import torch
import torch.fx as fx

from autopar.core import comm
from autopar.core.graph import TracedModel
from autopar.core.tensor_placement import Shard
from passes.merge_reductions import merge_parallel_reductions
from passes.rules import Decision
from passes.rules.context import Path, operand
from passes.sharding import ShardingPlan
from passes.vocab_parallel import apply_rewrite, copy_meta

__all__ = ["apply_tensor_parallel", "random_on_shard", "set_operand"]

aten = torch.ops.aten


def set_operand(node: fx.Node, path: Path, value) -> None:
    """Set the argument of ``node`` at ``path`` (a positional one past the end: the ones between None)."""
    if path[0] == "k":
        node.kwargs = {**node.kwargs, path[1]: value}
        return
    args = list(node.args)
    if len(path) == 3:
        inner = list(args[path[1]])
        inner[path[2]] = value
        args[path[1]] = type(node.args[path[1]])(inner) if isinstance(node.args[path[1]], tuple) else inner
    else:
        args += [None] * (path[1] + 1 - len(args))
        args[path[1]] = value
    node.args = tuple(args)


class _Inputs:
    """The f, scatters and gathers inserted before ops, one per source value and layout."""

    def __init__(self, graph: fx.Graph, tp: fx.Node):
        self.graph, self.tp = graph, tp
        self.copies: dict[str, fx.Node] = {}
        self.scatters: dict[tuple, fx.Node] = {}
        self.gathers: dict[tuple, fx.Node] = {}

    def insert(self, node: fx.Node, dec: Decision) -> None:
        graph, tp = self.graph, self.tp
        for path in dec.copy_in:
            src = operand(node, path)
            if src.name not in self.copies:
                # after a computed value; a parameter's f goes before its first such consumer,
                # so the graph's placeholders stay together at its start
                with graph.inserting_before(node) if src.op == "placeholder" else graph.inserting_after(src):
                    self.copies[src.name] = copy_meta(graph.call_function(comm.copy_to_tp, (src, tp)), node)
            set_operand(node, path, self.copies[src.name])
        for path, sh in dec.scatter_in:
            src = operand(node, path)
            key = (src.name, sh.dim, sh.segments)
            if key not in self.scatters:
                with graph.inserting_before(node):
                    self.scatters[key] = copy_meta(
                        graph.call_function(comm.scatter_to_tp, (src, tp, sh.dim, sh.segments)), node)
            set_operand(node, path, self.scatters[key])
        for path, sh in dec.gather_in:
            src = operand(node, path)
            key = (src.name, sh.dim, sh.segments)
            if key not in self.gathers:
                size = int(src.meta["val"].shape[sh.dim])
                with graph.inserting_before(node):
                    self.gathers[key] = copy_meta(
                        graph.call_function(comm.gather_from_tp, (src, tp, sh.dim, sh.segments, size)), node)
            set_operand(node, path, self.gathers[key])


def apply_tensor_parallel(traced: TracedModel, plan: ShardingPlan) -> fx.GraphModule:
    """Return a new GraphModule: the rank program (same for every tp rank)."""
    gm = fx.GraphModule(traced.gm, copy.deepcopy(traced.gm.graph))
    graph = gm.graph
    with graph.inserting_before(next(iter(graph.nodes))):
        tp = graph.placeholder("tp")
    tp.meta["autopar"] = "tp group"
    inputs = _Inputs(graph, tp)
    for node in list(graph.nodes):
        if node.op != "call_function" or node.name not in plan.decisions:
            continue
        dec = plan.decisions[node.name]
        inputs.insert(node, dec)
        for path, value in dec.local_args:
            set_operand(node, path, value)
        added = operand(node, dec.add_after_reduce) if dec.add_after_reduce is not None else None
        out = apply_rewrite(graph, node, dec.rewrite, tp) if dec.rewrite is not None else node
        if dec.reduce_out:
            _reduce(graph, out, dec, plan.tp, tp, added)
        elif dec.rewrite is None and random_on_shard(node, dec):
            node.args = (node.target, tp, *node.args)
            node.target = comm.tp_rng_call
    merge_parallel_reductions(graph)
    graph.eliminate_dead_code()
    graph.lint()
    gm.recompile()
    return gm


def _reduce(graph: fx.Graph, node: fx.Node, dec: Decision, t: int, tp: fx.Node, added: fx.Node | None) -> None:
    """g after a partial sum (divided by t first for a mean over the ranks), then ``added`` (a
    row-parallel linear's bias) once."""
    if dec.mean_over_ranks:  # local mean / t on each rank, summed by g
        with graph.inserting_after(node):
            scaled = copy_meta(graph.call_function(aten.div.Tensor, (node, t)), node)
        node.replace_all_uses_with(scaled, delete_user_cb=lambda u: u is not scaled)
        node = scaled
    with graph.inserting_after(node):
        red = copy_meta(graph.call_function(comm.reduce_from_tp, (node, tp)), node)
    node.replace_all_uses_with(red, delete_user_cb=lambda u: u is not red)
    if added is not None:
        with graph.inserting_after(red):
            add = copy_meta(graph.call_function(aten.add.Tensor, (red, added)), node)
        red.replace_all_uses_with(add, delete_user_cb=lambda u: u is not add)


def random_on_shard(node: fx.Node, dec: Decision) -> bool:
    """A random op (dropout, attention with dropout) whose output is split across tp ranks."""
    target = node.target
    if not isinstance(target, torch._ops.OpOverload) or torch.Tag.nondeterministic_seeded not in target.tags:
        return False
    if not isinstance(dec.out, Shard) and not (isinstance(dec.out, tuple) and any(isinstance(p, Shard) for p in dec.out)):
        return False
    if target == aten.scaled_dot_product_attention.default:
        p = node.args[4] if len(node.args) > 4 else node.kwargs.get("dropout_p", 0.0)
        return p != 0.0
    if target in (aten.dropout.default, aten.native_dropout.default):
        p, train = node.args[1], node.args[2] if len(node.args) > 2 else node.kwargs.get("train", True)
        return p != 0.0 and train is not False
    return True
