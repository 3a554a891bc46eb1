"""Rewrite a traced graph into the per-rank tensor-parallel program.

Input: the traced graph and a ``ShardingPlan``. Output: a graph with a first
placeholder ``tp`` (a ``TPGroup``) in which

- parameters are the local shards (the engine feeds them),
- every view/reshape/expand/split on a sharded value uses local sizes,
- f (``copy_to_tp``) sits before each column-parallel region (one per source
  value: Q, K and V share one), g (``reduce_from_tp``) after each row-parallel
  linear, whose bias is then added once,
- embeddings and the cross-entropy over a split vocabulary are replaced by
  their vocabulary-parallel versions (``passes/vocab_parallel.py``),
- ops without a rule get their sharded inputs all-gathered (fallbacks),
- random ops on sharded values (attention dropout) draw from a per-rank
  stream (``comm.tp_rng_call``); replicated ones share the default stream.

The graph is the same on every tensor-parallel rank; ranks differ only in the
``TPGroup`` they pass, so ``program.code(rank)`` prints it with the rank's
shard ranges.
"""

from __future__ import annotations

import copy

import torch
import torch.fx as fx

from autopar.core import comm
from autopar.core.placement import Shard
from autopar.core.graph import TracedModel
from passes.merge_reductions import merge_parallel_reductions
from passes.sharding import ShardingPlan
from passes.sharding_rules import Ctx, linear_parts
from passes.vocab_parallel import rewrite_cross_entropy, rewrite_embedding, rewrite_softmax

__all__ = ["apply_tensor_parallel"]

aten = torch.ops.aten


def _set(node: fx.Node, path: tuple, value) -> None:
    if path[0] == "k":
        kw = dict(node.kwargs)
        kw[path[1]] = value
        node.kwargs = kw
        return
    args = list(node.args)
    if len(path) == 3:
        inner = list(args[path[1]])
        inner[path[2]] = value
        args[path[1]] = type(node.args[path[1]])(inner) if isinstance(node.args[path[1]], tuple) else inner
    else:
        args[path[1]] = value
    node.args = tuple(args)


def _get(node: fx.Node, path: tuple):
    if path[0] == "k":
        return node.kwargs[path[1]]
    a = node.args[path[1]]
    return a[path[2]] if len(path) == 3 else a


def _copy_meta(new: fx.Node, like: fx.Node) -> fx.Node:
    for key in ("nn_module_stack", "stack_trace"):
        if key in like.meta:
            new.meta[key] = like.meta[key]
    new.meta["autopar"] = "inserted"
    return new


def apply_tensor_parallel(traced: TracedModel, plan: ShardingPlan) -> fx.GraphModule:
    """Return a new GraphModule: the rank program (same for every tp rank)."""
    gm = fx.GraphModule(traced.gm, copy.deepcopy(traced.gm.graph))
    graph = gm.graph
    first = next(iter(graph.nodes))
    with graph.inserting_before(first):
        tp = graph.placeholder("tp")
    tp.meta["autopar"] = "tp group"
    t = plan.tp
    ctx = Ctx(t, traced.param_of, set(), set(), set())

    f_cache: dict[str, fx.Node] = {}
    scatter_cache: dict[tuple, fx.Node] = {}
    gather_cache: dict[tuple, fx.Node] = {}

    for node in list(graph.nodes):
        if node.op != "call_function" or node.name not in plan.decisions:
            continue
        dec = plan.decisions[node.name]
        for path in dec.copy_in:
            src = _get(node, path)
            if src.name not in f_cache:
                # after a computed value; a parameter's f goes before its first such consumer,
                # so the graph's placeholders stay together at its start
                with graph.inserting_before(node) if src.op == "placeholder" else graph.inserting_after(src):
                    f_cache[src.name] = _copy_meta(graph.call_function(comm.copy_to_tp, (src, tp)), node)
            _set(node, path, f_cache[src.name])
        for path, sh in dec.scatter_in:
            src = _get(node, path)
            key = (src.name, sh.dim, sh.segments)
            if key not in scatter_cache:
                with graph.inserting_before(node):
                    scatter_cache[key] = _copy_meta(
                        graph.call_function(comm.scatter_to_tp, (src, tp, sh.dim, sh.segments)), node)
            _set(node, path, scatter_cache[key])
        for path, sh in dec.gather_in:
            src = _get(node, path)
            key = (src.name, sh.dim, sh.segments)
            if key not in gather_cache:
                size = int(src.meta["val"].shape[sh.dim])
                segs = sh.segments
                with graph.inserting_before(node):
                    gather_cache[key] = _copy_meta(
                        graph.call_function(comm.gather_from_tp, (src, tp, sh.dim, segs, size)), node)
            _set(node, path, gather_cache[key])
        if dec.local_shape is not None:
            if node.target == aten.unflatten.int:
                dim = node.args[1] % len(node.args[0].meta["val"].shape)  # a dim of the input
                _set(node, ("a", 2), list(dec.local_shape[dim : dim + len(node.args[2])]))
            else:
                _set(node, ("a", 1), list(dec.local_shape))
        _localize_split(node, plan)
        if "slice_piece" in dec.extra:
            _localize_slice(node, plan, dec.extra["slice_piece"])
        if dec.kind == "vocab_gather":
            node.args = (node.args[0], tp, dec.extra["dim"], node.args[2])
            node.kwargs = {}
            node.target = comm.vocab_parallel_gather
            _reduce_after(graph, node, tp)
        elif dec.kind == "row":
            _rewrite_row(graph, node, dec, ctx, tp)
        elif dec.reduce_out:
            if dec.extra.get("mean_over_ranks"):  # local mean / t on each rank, summed by g
                with graph.inserting_after(node):
                    scaled = _copy_meta(graph.call_function(aten.div.Tensor, (node, t)), node)
                node.replace_all_uses_with(scaled, delete_user_cb=lambda u: u is not scaled)
                _reduce_after(graph, scaled, tp)
            else:
                _reduce_after(graph, node, tp)
        elif dec.kind == "vocab_embedding":
            rewrite_embedding(graph, node, tp, dec.extra.get("padding_idx", -1))
        elif dec.kind == "vocab_cross_entropy":
            rewrite_cross_entropy(graph, node, tp, dec.extra)
        elif dec.kind == "vocab_softmax":
            rewrite_softmax(graph, node, tp, dec.extra)
        elif dec.kind == "vocab_nll":
            node.args = (node.args[0], node.args[1], tp, dec.extra["reduction"], dec.extra["ignore_index"])
            node.kwargs = {}
            node.target = comm.vocab_parallel_nll_loss
        elif _random_on_shard(node, dec):
            node.args = (node.target, tp, *node.args)
            node.target = comm.tp_rng_call
    merge_parallel_reductions(graph)
    graph.eliminate_dead_code()
    graph.lint()
    gm.recompile()
    return gm


def _localize_split(node: fx.Node, plan: ShardingPlan) -> None:
    """A split along the sharded dim (fused QKV): piece sizes become local."""
    if node.target not in (aten.split.Tensor, aten.split_with_sizes.default, aten.unsafe_split.Tensor):
        return
    src = node.args[0]
    p = plan.decisions.get(src.name)
    if p is None or not isinstance(p.out, Shard):
        return
    nd = len(src.meta["val"].shape)
    dim = (node.args[2] if len(node.args) > 2 else node.kwargs.get("dim", 0)) % nd
    if dim != p.out.dim:
        return
    sizes = node.args[1]
    local = [s // plan.tp for s in sizes] if isinstance(sizes, (list, tuple)) else sizes // plan.tp
    _set(node, ("a", 1), local)


def _random_on_shard(node: fx.Node, dec) -> bool:
    """A random op (dropout, attention with dropout) whose output is split across tp ranks."""
    t = node.target
    if not isinstance(t, torch._ops.OpOverload) or torch.Tag.nondeterministic_seeded not in t.tags:
        return False
    if not isinstance(dec.out, Shard) and not (isinstance(dec.out, tuple) and any(isinstance(p, Shard) for p in dec.out)):
        return False
    if t == aten.scaled_dot_product_attention.default:
        p = node.args[4] if len(node.args) > 4 else node.kwargs.get("dropout_p", 0.0)
        return p != 0.0
    if t in (aten.dropout.default, aten.native_dropout.default):
        p, train = node.args[1], node.args[2] if len(node.args) > 2 else node.kwargs.get("train", True)
        return p != 0.0 and train is not False
    return True


def _localize_slice(node: fx.Node, plan: ShardingPlan, piece: int) -> None:
    """A slice taking one segment of a sharded dim: its bounds become the local segment's."""
    src = node.args[0]
    segs = plan.decisions[src.name].out.segments
    start = sum(s // plan.tp for s in segs[:piece])
    args = list(node.args) + [None] * (5 - len(node.args))
    args[2], args[3] = start, start + segs[piece] // plan.tp
    node.args = tuple(args[:4]) if args[4] is None else tuple(args)


def _reduce_after(graph: fx.Graph, node: fx.Node, tp: fx.Node) -> fx.Node:
    with graph.inserting_after(node):
        red = _copy_meta(graph.call_function(comm.reduce_from_tp, (node, tp)), node)
    node.replace_all_uses_with(red, delete_user_cb=lambda u: u is not red)
    return red


def _rewrite_row(graph: fx.Graph, node: fx.Node, dec, ctx: Ctx, tp: fx.Node) -> None:
    """Row-parallel linear: Z = sum_i Y_i B_i computed as local matmul, g, then the bias once."""
    parts = linear_parts(ctx, node) if node.target in (aten.linear.default, aten.addmm.default) else None
    bias = parts[2] if parts is not None else None
    if bias is not None:
        if node.target == aten.linear.default:
            node.args = (node.args[0], node.args[1])
            node.kwargs = {}
        else:  # addmm(bias, x, w) -> mm(x, w)
            node.target = aten.mm.default
            node.args = (node.args[1], node.args[2])
    red = _reduce_after(graph, node, tp)
    if bias is not None:
        with graph.inserting_after(red):
            add = _copy_meta(graph.call_function(aten.add.Tensor, (red, bias)), node)
        red.replace_all_uses_with(add, delete_user_cb=lambda u: u is not add)
