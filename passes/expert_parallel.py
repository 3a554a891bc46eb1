"""Expert parallelism: each rank of an expert group holds E/ep whole experts; the rows travel to them.

For every mixture-of-experts layer ``find_experts`` found, the rank graph is
rewritten around the expert region (the grouped matmuls and what lies between
them), which itself is left as the model wrote it:

    route  = expert_route(tp, offs, E, ep, site)        every rank's offsets, gathered
    rows'  = expert_dispatch(tp, rows, route, ep, how)  this rank's experts' rows, from all
    offs'  = expert_offsets(tp, route, ep, how, S)      their offsets over the local experts
    ... the region, unchanged, on rows', offs' and this rank's E/ep experts ...
    out    = expert_combine(tp, out', route, ep, how, S) the results back where the rows came from

The stacked expert weights become this rank's E/ep experts (their first dim
cut ep ways: ``expert_params``), which the engine feeds like any shard. The
router, the sort, the weighting and the sum per token stay as they are, on
this rank's own tokens, so the auxiliary load-balancing loss and any z-loss
are the model's own. Tensor parallelism inside the region (each expert's
MLP split over tp) is untouched: the exchange runs over the expert group of
ranks with the same tp rank. With whole experts (``expert_tp=1``, the region
left unsplit by the sharding analysis) the tp ranks of a replica share its
rows first:

    rows_t = scatter_to_tp(rows, tp, 0)                 this tp rank's block of the sorted rows
    offs_t = expert_tp_offsets(tp, offs, block)         the offsets cut to that block
    ... route, dispatch, region, combine as above, on rows_t and offs_t ...
    out    = gather_from_tp(out_t, tp, 0, size=S)       every block back on every tp rank

See ``comm/expert_dispatch.py`` for the two dispatchers and why both are exact.
"""

from __future__ import annotations

import torch.fx as fx

from autopar.core.comm import expert_dispatch as xd
from autopar.core.comm.tp_mappings import gather_from_tp, scatter_to_tp
from passes.experts import LOOKED_FOR, ExpertError, ExpertLayer

__all__ = ["apply_expert_parallel", "expert_params", "expert_parallel_errors"]


def expert_params(layers: list[ExpertLayer], param_of: dict[str, str], ep: int) -> dict[str, int]:
    """Parameter name -> its expert count E, for the stacked expert weights split ep ways ({} for ep=1)."""
    if ep == 1:
        return {}
    return {param_of[ph]: layer.experts for layer in layers for ph in layer.params}


def expert_parallel_errors(layers: list[ExpertLayer], ep: int, model_name: str, candidates: list[str]) -> list[str]:
    """What keeps ``ep`` from splitting these layers, each with where and the fix ([] when nothing)."""
    if ep == 1:
        return []
    if not layers:
        seen = "; ".join(candidates) if candidates else "no 3-D parameter and no top-k"
        return [f"ep={ep} asks for expert parallelism, but {model_name} has no mixture-of-experts layer autopar "
                f"can split. Looked for {LOOKED_FOR}. Found: {seen}. The model trains without expert "
                f"parallelism: use ep=1 (its experts are then split like any MLP by tp)"]
    errs = []
    for layer in layers:
        where = f"{layer.module or 'the model'} ({layer.line or 'no source line'})"
        if layer.refusal:
            errs.append(f"ep={ep}: the experts at {where} cannot be split across ranks: {layer.refusal}. "
                        f"Use ep=1 (the model trains without expert parallelism)")
        elif layer.experts % ep:
            fits = [e for e in range(1, layer.experts + 1) if layer.experts % e == 0]
            errs.append(f"ep={ep} does not divide the {layer.experts} experts at {where}: each rank of an expert "
                        f"group holds E/ep whole experts. Fix: ep in {fits}")
    return errs


def apply_expert_parallel(gm: fx.GraphModule, layers: list[ExpertLayer], ep: int, dispatcher: str,
                          rows_split: int = 1) -> None:
    """Rewrite ``gm`` (a rank graph whose first placeholder is ``tp``) in place, as the module docstring
    shows, for every layer; nothing for ep=1. ``rows_split``: t when the experts are whole under
    tensor parallelism (the tp ranks share the rows), else 1. ``expert_parallel_errors`` must have
    passed."""
    if ep == 1:
        return
    nodes = {n.name: n for n in gm.graph.nodes}
    tp = next(n for n in gm.graph.nodes if n.op == "placeholder")
    for layer in layers:
        _rewrite(gm.graph, nodes, tp, layer, ep, dispatcher, rows_split)
    gm.graph.lint()
    gm.recompile()


def _first_user_in(node: fx.Node, region: set[fx.Node]) -> fx.Node:
    order = {n: i for i, n in enumerate(node.graph.nodes)}
    return min((u for u in node.users if u in region), key=order.__getitem__)


def _rewrite(graph: fx.Graph, nodes: dict[str, fx.Node], tp: fx.Node, layer: ExpertLayer, ep: int,
             dispatcher: str, split: int) -> None:
    region = {nodes[n] for n in layer.region}
    offs, out = nodes[layer.offsets], nodes[layer.output]
    first = nodes[layer.grouped[0]]
    block = -(-layer.rows // split)  # this tp rank's rows (the last block padded with zero rows)
    offs_in = offs
    if split > 1:
        with graph.inserting_after(offs):
            offs_in = graph.call_function(xd.expert_tp_offsets, (tp, offs, block))
        _copy_meta(offs_in, offs, "expert_tp_offsets")
    with graph.inserting_after(offs_in):
        route = graph.call_function(xd.expert_route, (tp, offs_in, layer.experts, ep, layer.module))
    with graph.inserting_before(first):
        local_offs = graph.call_function(xd.expert_offsets, (tp, route, ep, dispatcher, block))
    _copy_meta(route, offs, "expert_route")
    _copy_meta(local_offs, offs, "expert_offsets")
    swaps = {offs: local_offs}
    for name in layer.rows_in:  # each sits with its first reader in the region (its layer, its line)
        x = nodes[name]
        user = _first_user_in(x, region)
        with graph.inserting_before(user):
            rows = x
            if split > 1:
                rows = graph.call_function(scatter_to_tp, (x, tp, 0, (block * split,)))
                _copy_meta(rows, user, "expert_tp_scatter")
            swaps[x] = graph.call_function(xd.expert_dispatch, (tp, rows, route, ep, dispatcher, split))
        _copy_meta(swaps[x], user, "expert_dispatch")
    for n in region:
        for old, new in swaps.items():
            if old in n.all_input_nodes:
                n.replace_input_with(old, new)
    outside = [u for u in out.users if u not in region]
    with graph.inserting_after(out):
        back = graph.call_function(xd.expert_combine, (tp, out, route, ep, dispatcher, block, split))
    _copy_meta(back, out, "expert_combine")
    if split > 1:
        with graph.inserting_after(back):
            gathered = graph.call_function(gather_from_tp, (back, tp, 0, (block * split,), layer.rows))
        _copy_meta(gathered, out, "expert_tp_gather")
        back = gathered
    for u in outside:
        u.replace_input_with(out, back)


def _copy_meta(new: fx.Node, like: fx.Node, what: str) -> None:
    """The new node sits where ``like`` is: its module and its source line
    (its shapes come from the local-shape pass, which runs next)."""
    for key in ("nn_module_stack", "stack_trace"):
        if key in like.meta:
            new.meta[key] = like.meta[key]
    new.meta["autopar_expert"] = what
