"""Cut a rank graph into p*v contiguous chunks of balanced cost.

1. Each layer's cost is the roofline cost of its nodes (``autopar/core/flops.py``:
   FLOPs, or bytes moved for memory-bound ops); the
   nodes before the first layer (embedding) count with the first layer, any
   other outside the layers with the layer before it (the final norm, head and
   loss with the last).
2. A linear partition of the layer sequence into p*v non-empty runs,
   balanced per stage under the schedule's chunk placement
   (``passes/stage_balance.py``): min-max over chunks for the interleaved
   placements; for ZB-V's V, whose stage 0 holds both the first chunk
   (embedding) and the last (head and loss), the largest stage total as small
   as it can be. Layers are never dropped or duplicated; uneven counts are
   balanced by cost.
3. Every node goes to its layer's chunk; a node outside the layers goes to
   the latest chunk among its inputs (so the embedding lands in chunk 0 and
   the head and loss in the last). Nodes that do not depend on parameters
   (position ids, masks, rotary tables, reshaped targets) are recomputed in
   every chunk that needs them from the model inputs, which every rank has,
   instead of being sent.
4. A value produced in chunk a and used in chunk b > a+1 is relayed: it is an
   output of a and an input and output of every chunk in between.
5. A higher-order op (the body of a ``no_grad`` or ``autocast`` region, a
   ``torch.cond``: torch.export puts it in a ``get_attr`` sub-module) is one
   node like any other; each chunk that runs one gets a copy of its
   ``get_attr`` node, and the chunk's GraphModule carries the sub-module. Its
   cost is that of the graph it holds; the items of a tuple it returns are
   taken in its chunk, so only tensors cross boundaries.

Chunk c's graph: placeholders ``tp``, then the parameters, model inputs,
targets and buffers it reads, then the boundary values from chunk c-1;
output: the boundary values for chunk c+1, or the loss for the last chunk.
"""

from __future__ import annotations

import operator

import torch
import torch.fx as fx

from autopar.core import comm
from autopar.core.chunks import Boundary, Chunk, PipelineSplit
from autopar.core.errors import AutoparError
from autopar.core.graph import local_val, module_path, source_line
from passes.layers import LOOKED_FOR, LayerInfo, layer_of_node
from autopar.core.flops import node_cost
from passes.sequence_parallel import SPLIT_META
from passes.stage_balance import balance, balance_stages

__all__ = ["PipelineError", "balance", "split_pipeline"]


class PipelineError(AutoparError, ValueError):
    """The model cannot be cut as asked; the message has the numbers and the fix."""


def split_pipeline(rank_gm: fx.GraphModule, n_chunks: int, param_of: dict[str, str],
                   global_shapes: dict[str, tuple], layers: LayerInfo,
                   chunk_stages: tuple[int, ...] | None = None) -> PipelineSplit:
    """Cut the (tensor-parallel) rank graph into ``n_chunks`` chunk graphs.

    ``chunk_stages``: the stage of each chunk (the schedule's placement); the cut balances the
    stages' totals under it (``passes/stage_balance.py``). None: one chunk per stage.

    ``layers``: the repeated blocks found on the traced graph; a node the
    rewrite inserted (a collective) belongs to the layer its module stack names.
    ``global_shapes``: traced node -> global shape; the rank graph's local
    values are read from ``meta["local_val"]``.
    """
    _check_regions(rank_gm)
    _check_layer_count(layers, n_chunks)
    nodes = list(rank_gm.graph.nodes)
    placeholders = [n for n in nodes if n.op == "placeholder"]
    tp_node = placeholders[0]
    param_phs = {n.name for n in placeholders if n.name in param_of}
    free = _parameter_free(nodes, param_phs)
    node_layer = {n.name: layer for n in nodes if n.op == "call_function"
                  and (layer := layers.node_layer.get(n.name, layer_of_node(n, layers))) is not None}
    if layers.count == 0:  # one chunk holds everything: nothing to cut between
        unit = [sum(_cost(n, rank_gm, param_phs) for n in nodes if n.op == "call_function" and n.name not in free)]
        chunk_of_layer: dict[int, int] = {}
    else:
        unit = _layer_costs(rank_gm, nodes, free, node_layer, layers.count, param_phs)
        starts = balance_stages(unit, chunk_stages or tuple(range(n_chunks)))
        chunk_of_layer = {layer: c for c, s in enumerate(starts)
                          for layer in range(s, starts[c + 1] if c + 1 < n_chunks else layers.count)}
    chunk_of = _assign_chunks(nodes, free, node_layer, chunk_of_layer, n_chunks)
    live = _live_values(nodes, chunk_of, n_chunks)

    loss = nodes[-1].args[0][0]
    requires_grad = _requires_grad(nodes, param_phs)
    by_name = {n.name: n for n in nodes}
    order = {n.name: i for i, n in enumerate(nodes)}
    own: list[list[fx.Node]] = [[] for _ in range(n_chunks)]
    for n in nodes:
        if n.name in chunk_of:
            own[chunk_of[n.name]].append(n)
    chunks = []
    for k in range(n_chunks):
        gm, params, feeds = _build_chunk(rank_gm, own[k], by_name, order, free, live[k],
                                         live[k + 1] if k + 1 < n_chunks else [], tp_node, param_phs,
                                         loss if k == n_chunks - 1 else None)
        ins = [_boundary(by_name[nm], requires_grad, global_shapes) for nm in live[k]]
        outs = [_boundary(by_name[nm], requires_grad, global_shapes) for nm in live[k + 1]] if k + 1 < n_chunks else []
        chunk_layers = sorted(layer for layer, c in chunk_of_layer.items() if c == k)
        cost = sum(unit[layer] for layer in chunk_layers) if layers.count else unit[0]
        chunks.append(Chunk(k, gm, params, feeds, ins, outs, chunk_layers, cost))
    return PipelineSplit(chunks, [c.layers for c in chunks], [c.cost for c in chunks])


RUN_REGIONS = (torch.ops.higher_order.wrap_with_set_grad_enabled, torch.ops.higher_order.wrap_with_autocast)
"""The higher-order ops the engine runs (checked at tp=2 x pp=2 against one device): ``no_grad`` /
``enable_grad`` and ``autocast`` regions. Others (``torch.cond``, ``while_loop``, ``invoke_subgraph``,
flex attention, ...) are refused by ``_check_regions``."""


def _check_regions(gm: fx.GraphModule) -> None:
    """Refuse a higher-order op (a node running a sub-module of the graph) the engine does not run,
    naming it, its node, its module and the model's line."""
    for n in gm.graph.nodes:
        subs = [a for a in n.all_input_nodes if a.op == "get_attr" and isinstance(_attr(gm, a), fx.GraphModule)]
        if n.op != "call_function" or not subs or n.target in RUN_REGIONS:
            continue
        inner = [m for a in subs for m in _attr(gm, a).graph.nodes if m.op == "call_function"]
        where = source_line(n) or next((line for m in inner if (line := source_line(m))), "")
        name = getattr(n.target, "__name__", str(n.target))
        raise PipelineError(
            f"higher-order op {name} (graph node {n.name}, module '{module_path(n)}'"
            f"{f', at {where}' if where else ''}) runs a sub-graph the engine does not run: it runs no_grad "
            f"and autocast regions only. Fix: write that part without {name} (for torch.cond: compute both "
            f"branches and choose with torch.where)")


def _attr(gm: fx.GraphModule, node: fx.Node):
    """What a get_attr node reads (a dotted path: ``blocks.0.w``, ``submod_3``)."""
    return operator.attrgetter(node.target)(gm)


def _check_layer_count(layers: LayerInfo, n_chunks: int) -> None:
    """One chunk needs no layers; more need at least one layer each."""
    if n_chunks == 1:
        return
    if layers.count == 0:
        raise PipelineError(
            f"pipeline parallelism (pp * virtual_stages = {n_chunks} chunks) cuts between repeated layers, and "
            f"none were found: looked for {LOOKED_FOR}. Fix: use pp=1 and virtual_stages=1 (tensor and data "
            f"parallelism need no layers), or give the model a stack of blocks of one structure")
    if layers.count < n_chunks:
        raise PipelineError(
            f"the model has {layers.describe()} but pp * virtual_stages = "
            f"{n_chunks} chunks need at least one layer each. Fix: use pp * virtual_stages <= {layers.count}"
            f" (e.g. pp={layers.count}, virtual_stages=1)"
        )


def _parameter_free(nodes: list[fx.Node], param_phs: set[str]) -> set[str]:
    """Nodes that depend on no parameter (position ids, masks, rotary tables, flattened
    targets): recomputed in each chunk that needs them from the model inputs, which every
    rank has, instead of being placed once and sent."""
    anchored: set[str] = set(param_phs)
    for n in nodes:
        if n.op == "call_function" and any(a.name in anchored for a in n.all_input_nodes):
            anchored.add(n.name)
    return {n.name for n in nodes if n.op == "call_function" and n.name not in anchored}


def _layer_costs(gm: fx.GraphModule, nodes: list[fx.Node], free: set[str], node_layer: dict[str, int], count: int,
                 param_phs: set[str]) -> list[float]:
    """Roofline cost of each layer; what comes before the first layer (embedding) counts with
    the first, what follows a layer outside any (between two layers, or the final norm, head and
    loss after the last) with the latest layer before it, the layer whose chunk it lands in."""
    layer_cost = [0.0] * count
    pre = 0.0
    latest = None
    for n in nodes:
        if n.op != "call_function" or n.name in free:
            continue
        c = _cost(n, gm, param_phs)
        if n.name in node_layer:
            latest = node_layer[n.name]
            layer_cost[latest] += c
        elif latest is not None:
            layer_cost[latest] += c
        else:
            pre += c
    layer_cost[0] += pre
    return layer_cost


def _cost(node: fx.Node, gm: fx.GraphModule, params: set[str]) -> float:
    """A node's roofline cost (``node_cost``); a higher-order op (``torch.cond``, a ``no_grad`` or
    ``autocast`` region, ...) adds that of the costliest graph it holds (get_attr sub-modules: a
    cond's branches, of which one runs), a third of it for a ``no_grad`` region (no backward)."""
    cost = node_cost(node, params)
    subs = [_attr(gm, a) for a in node.all_input_nodes if a.op == "get_attr"]
    held = max((sum(_cost(n, sub, frozenset()) for n in sub.graph.nodes)
                for sub in subs if isinstance(sub, fx.GraphModule)), default=0.0)
    # forward costs stand for forward + backward (about 2x the forward); a no_grad region has no backward
    return cost + (held / 3 if _grad_off(node) else held)


def _assign_chunks(nodes: list[fx.Node], free: set[str], node_layer: dict[str, int],
                   chunk_of_layer: dict[int, int], n_chunks: int) -> dict[str, int]:
    """Node -> chunk: its layer's chunk, or for a node outside the layers the latest chunk
    among its inputs (so the embedding lands in chunk 0 and the head and loss in the last)."""
    chunk_of: dict[str, int] = {}
    for n in nodes:
        if n.op != "call_function" or n.name in free:
            continue
        if n.target is operator.getitem and isinstance(local_val(n.args[0]), (tuple, list)):
            # an item of a tuple (a higher-order op's, a split's) is taken where the tuple is made:
            # what crosses a boundary is then the tensor, never the tuple
            chunk_of[n.name] = chunk_of.get(n.args[0].name, 0)
        elif n.name in node_layer:
            chunk_of[n.name] = chunk_of_layer[node_layer[n.name]]
        else:
            chunk_of[n.name] = max([chunk_of.get(a.name, 0) for a in n.all_input_nodes], default=0)
        for a in n.all_input_nodes:
            if chunk_of.get(a.name, 0) > chunk_of[n.name]:
                raise PipelineError(f"node {n.name} in chunk {chunk_of[n.name]} uses {a.name} from a later chunk "
                                    f"{chunk_of[a.name]}: the layers are not a sequence")
    loss = nodes[-1].args[0][0]
    if chunk_of.get(loss.name) != n_chunks - 1:
        raise PipelineError("the loss is not computed after the last layer")
    return chunk_of


def _live_values(nodes: list[fx.Node], chunk_of: dict[str, int], n_chunks: int) -> list[list[str]]:
    """live[k]: the values crossing from chunk k-1 into chunk k (produced before k, used at or
    after k), in graph order; a value used two chunks later is relayed through the one between."""
    last_use: dict[str, int] = {}
    for n in nodes:
        if n.name not in chunk_of:
            continue
        for a in n.all_input_nodes:
            if a.name in chunk_of:
                last_use[a.name] = max(last_use.get(a.name, -1), chunk_of[n.name])
    live: list[list[str]] = [[] for _ in range(n_chunks)]
    for n in nodes:  # in graph order, so each list is too
        if n.name in chunk_of:
            for k in range(chunk_of[n.name] + 1, last_use.get(n.name, -1) + 1):
                live[k].append(n.name)
    return live


def _requires_grad(nodes: list[fx.Node], param_phs: set[str]) -> set[str]:
    """Values a gradient flows back through: floats computed from a parameter (a tuple of them too,
    as a higher-order op returns: its items follow), except what a ``no_grad`` region returns."""
    rg = set(param_phs)
    for n in nodes:
        if n.op == "call_function" and any(a.name in rg for a in n.all_input_nodes) and not _grad_off(n):
            val = local_val(n)
            items = val if isinstance(val, (tuple, list)) else (val,)
            if any(isinstance(v, torch.Tensor) and v.dtype.is_floating_point for v in items):
                rg.add(n.name)
    return rg


def _grad_off(node: fx.Node) -> bool:
    """A region traced under ``torch.no_grad()`` (export wraps it in ``wrap_with_set_grad_enabled(False,
    ...)``): what it returns carries no gradient."""
    return node.target is torch.ops.higher_order.wrap_with_set_grad_enabled and node.args[0] is False


def _boundary(node: fx.Node, requires_grad: set[str], global_shapes: dict[str, tuple]) -> Boundary:
    val = local_val(node)
    if not isinstance(val, torch.Tensor):
        where = source_line(node)
        raise PipelineError(
            f"value {node.name} ({node.target}{f' at {where}' if where else ''}, module '{module_path(node)}') "
            f"crosses a pipeline boundary and is not a tensor ({type(val).__name__}): only tensors are sent "
            f"between stages. Fix: return tensors from the module that makes it, or use fewer stages "
            f"(pp * virtual_stages)")
    shape = tuple(int(s) for s in val.shape)
    if node.target is comm.scatter_to_tp or node.meta.get(SPLIT_META) is not None:
        replicated = False  # a slice, or tokens split by sequence parallelism: 1/t of the value already
    elif node.name in global_shapes:
        replicated = tuple(global_shapes[node.name]) == shape
    else:  # inserted by the tensor-parallel rewrite: g, its bias add, gathers: all replicated
        replicated = True
    return Boundary(node.name, shape, val.dtype, node.name in requires_grad, replicated)


def _build_chunk(rank_gm, own, by_name, order, free, inputs, outputs, tp_node, param_phs, loss):
    """Chunk graph of the nodes ``own`` (in graph order), reading the boundary values ``inputs`` and
    returning ``outputs`` (or the loss when ``loss`` is given); placeholders and copied nodes in the
    rank graph's order (``order``: node name -> position)."""
    g = fx.Graph()
    env: dict[str, fx.Node] = {}
    tp = g.placeholder("tp")
    tp.meta.update(tp_node.meta)
    env[tp_node.name] = tp
    # what this chunk reads: its own nodes' inputs, and what it relays onwards
    wanted: set[str] = set()
    stack = [a for n in own for a in n.all_input_nodes]
    stack += [by_name[nm] for nm in outputs]
    needed_free: set[str] = set()
    while stack:
        a = stack.pop()
        if a.name in wanted:
            continue
        wanted.add(a.name)
        if a.name in free:
            needed_free.add(a.name)
            stack.extend(a.all_input_nodes)
    read = sorted((by_name[nm] for nm in wanted), key=lambda n: order[n.name])
    params, feeds = [], []
    for n in read:
        if n.op == "placeholder" and n is not tp_node:
            p = g.placeholder(n.name)
            p.meta.update(n.meta)
            env[n.name] = p
            (params if n.name in param_phs else feeds).append(n.name)
    for nm in inputs:
        p = g.placeholder(nm)
        p.meta.update(by_name[nm].meta)
        env[nm] = p
    # a sub-module a higher-order op runs (get_attr): copied into each chunk that reads it, and
    # GraphModule(rank_gm, ...) below carries the sub-module itself
    copied = [n for n in read if n.op == "get_attr" or n.name in needed_free] + own
    for n in sorted(copied, key=lambda n: order[n.name]):
        env[n.name] = g.node_copy(n, lambda a: env[a.name])
    if loss is not None:
        g.output((env[loss.name],))
    else:
        g.output(tuple(env[nm] for nm in outputs))
    g.eliminate_dead_code()
    g.lint()
    gm = fx.GraphModule(rank_gm, g)
    return gm, params, feeds
