"""Mixture-of-experts layers, found in the graph: the router, the stacked experts, the grouped region.

A mixture-of-experts layer, as a graph with static shapes, is:

- a **router**: a linear over the tokens to E logits, a softmax (or sigmoid),
  a ``topk`` choosing k experts per token; its indices, sorted, make the
  cumulative rows per expert ``offs`` (E,) (``histc``/``bincount`` then
  ``cumsum``);
- the **experts**: stacked 3-D weight parameters (E, ., .) multiplied by the
  token rows sorted by expert, group by group: grouped matmuls whose group
  offsets are ``offs`` (``torch._grouped_mm``, or a library's grouped-matmul op
  such as transformers' fallback);
- the **expert region**: the grouped matmuls and every op on a path from one
  of them to the last (activation, gating; a gate's and an up projection's
  grouped matmuls side by side), row by row;
- the **combine**: the region's output weighted by the router's probabilities
  and summed back per token (outside the region: it is the same under expert
  parallelism).

Nothing here reads a module's name: the experts are the 3-D parameters a
grouped matmul reads, the router is the ``topk`` its offsets come from. Dense
layers beside them (a shared expert, a gate on it) are ordinary linears,
split by tensor parallelism.

``find_experts`` returns one ``ExpertLayer`` per offsets node; ``refusal`` says
why one cannot be split across ranks (and the model still trains with ep=1).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.fx as fx

from autopar.core.errors import AutoparError
from autopar.core.graph import local_val, module_path, source_line
from passes.rules.matmul import GROUPED_MM_OPS

__all__ = ["ExpertLayer", "ExpertError", "find_experts", "grouped_weight", "expert_candidates", "LOOKED_FOR"]

aten = torch.ops.aten

LOOKED_FOR = ("grouped matmuls (torch._grouped_mm or a library's grouped-matmul op) that multiply token rows "
              "sorted by expert by stacked 3-D expert weights (E, in, out), their group offsets counted from "
              "a router's top-k over E logits; or a list of E identical expert modules beside such a router, "
              "each applied row by row to its own input")
"""What expert parallelism looks for, as the error messages say it."""

_WEIGHT_VIEWS = (aten.transpose.int, aten.permute.default, aten.t.default, aten._to_copy.default, aten.to.dtype,
                 aten.alias.default, aten.detach.default, aten.contiguous.default)
"""Ops between a stacked expert weight and the grouped matmul reading it (a transpose, a cast)."""


class ExpertError(AutoparError, ValueError):
    """Expert parallelism asked for where the graph has no mixture-of-experts layer it can split, or
    an expert count it does not divide."""


@dataclass(frozen=True)
class ExpertLayer:
    """One mixture-of-experts layer of the graph."""

    module: str
    """The module the grouped matmuls run in (the experts)."""
    experts: int
    """E: the stacked weights' first dim, and the router's logits."""
    top_k: int | None
    """k: experts per token (the router's ``topk``), None where the offsets come from no top-k."""
    router: str | None
    """The module of the router's ``topk``."""
    params: tuple[str, ...]
    """Placeholders of the stacked expert weights (E, ., .)."""
    grouped: tuple[str, ...]
    """The grouped matmul nodes, in graph order."""
    offsets: str
    """The node of the group offsets (E,) the grouped matmuls share."""
    region: tuple[str, ...]
    """The nodes from the first grouped matmul to the last (the weights' views included), in graph order."""
    rows_in: tuple[str, ...]
    """Nodes outside the region whose rows it reads (the sorted token rows; a bias gathered per row)."""
    output: str
    """The region's one value read outside it (the last grouped matmul's rows)."""
    rows: int
    """S: rows of the grouped matmuls (tokens x k)."""
    line: str
    """The model's source line of the first grouped matmul."""
    refusal: str | None = None
    """Why this layer cannot be split by expert parallelism (None: it can)."""


def _is_grouped(node: fx.Node) -> bool:
    return (node.op == "call_function" and isinstance(node.target, torch._ops.OpOverload)
            and node.target._schema.name in GROUPED_MM_OPS)


def _offsets(node: fx.Node):
    return node.kwargs.get("offs", node.args[2] if len(node.args) > 2 else None)


def grouped_weight(node: fx.Node, param_of: dict[str, str]) -> tuple[fx.Node, list[fx.Node]] | None:
    """(the 3-D parameter placeholder, the view nodes between) a grouped matmul multiplies by, or None."""
    w, chain = node.args[1], []
    while isinstance(w, fx.Node) and w.op == "call_function" and w.target in _WEIGHT_VIEWS:
        chain.append(w)
        w = w.args[0]
    if isinstance(w, fx.Node) and w.op == "placeholder" and w.name in param_of and local_val(w).dim() == 3:
        return w, chain
    return None


def _router(offs: fx.Node) -> fx.Node | None:
    """The ``topk`` the offsets are counted from (the nearest one upstream), or None."""
    seen, todo = set(), [offs]
    while todo:
        n = todo.pop(0)
        if n in seen:
            continue
        seen.add(n)
        if n.op == "call_function" and n.target == aten.topk.default:
            return n
        todo.extend(n.all_input_nodes)
    return None


def _gating_router(out: fx.Node, experts: int, reach: int = 32) -> fx.Node | None:
    """The ``topk`` over ``experts`` logits whose choices weigh the region's output on its way on
    (experts run on every token, gated after: the offsets come from no top-k), or None: the first one
    among what the ``reach`` nodes nearest downstream of ``out`` also read."""
    seen, todo = set(), [out]
    while todo and len(seen) < reach:
        n = todo.pop(0)
        for u in n.users:
            if u in seen:
                continue
            seen.add(u)
            todo.append(u)
            for a in u.all_input_nodes:
                if a is not n:
                    found = _router(a)
                    if found is not None and int(local_val(found.args[0]).shape[-1]) == experts:
                        return found
    return None


def _between(starts: list[fx.Node], last: fx.Node, order: dict[fx.Node, int]) -> set[fx.Node]:
    """Nodes on a path from one of ``starts`` to ``last`` (both included)."""
    first = min(starts, key=order.__getitem__)
    down, todo = set(), list(starts)
    while todo:
        n = todo.pop()
        if n in down or order[n] > order[last]:
            continue
        down.add(n)
        todo.extend(n.users)
    up, todo = set(), [last]
    while todo:
        n = todo.pop()
        if n in up or order[n] < order[first]:
            continue
        up.add(n)
        todo.extend(n.all_input_nodes)
    return down & up


def find_experts(gm: fx.GraphModule, param_of: dict[str, str]) -> list[ExpertLayer]:
    """Every mixture-of-experts layer of ``gm`` (see the module docstring), in graph order."""
    nodes = list(gm.graph.nodes)
    order = {n: i for i, n in enumerate(nodes)}
    by_offsets: dict[fx.Node, list[fx.Node]] = {}
    for n in nodes:
        if _is_grouped(n) and grouped_weight(n, param_of) is not None and isinstance(_offsets(n), fx.Node):
            by_offsets.setdefault(_offsets(n), []).append(n)
    return [_layer(gms, offs, order, param_of) for offs, gms in by_offsets.items()]


def _layer(gms: list[fx.Node], offs: fx.Node, order: dict[fx.Node, int], param_of: dict[str, str]) -> ExpertLayer:
    first, last = gms[0], gms[-1]
    weights = [grouped_weight(g, param_of) for g in gms]
    params = tuple(dict.fromkeys(w.name for w, _ in weights))
    sizes = {local_val(w).shape[0] for w, _ in weights}
    experts = int(next(iter(sizes)))
    region = _between(gms, last, order)  # every grouped matmul's way to the last (a gate's and an up's)
    for _, chain in weights:
        region.update(chain)
    region.update(u for n in list(region) for u in n.users  # a check hanging off a region value
                  if u.op == "call_function" and not u.users and u.target == aten._assert_tensor_metadata.default)
    rows = int(local_val(first.args[0]).shape[0])
    inputs = {i for n in region for i in n.all_input_nodes if i not in region}
    param_nodes = {w for w, _ in weights}
    rows_in = sorted((i for i in inputs if i is not offs and i not in param_nodes), key=order.__getitem__)
    escaping = [n for n in region if n is not last and any(u not in region for u in n.users)]
    topk = _router(offs) or _gating_router(last, experts)
    top_k = int(topk.args[1]) if topk is not None else None
    refusal = _refusal(sizes, experts, topk, rows_in, escaping, region, rows, first)
    return ExpertLayer(module=module_path(first), experts=experts, top_k=top_k,
                       router=module_path(topk) if topk is not None else None, params=params,
                       grouped=tuple(g.name for g in gms), offsets=offs.name,
                       region=tuple(n.name for n in sorted(region, key=order.__getitem__)),
                       rows_in=tuple(i.name for i in rows_in), output=last.name, rows=rows,
                       line=source_line(first), refusal=refusal)


def _refusal(sizes, experts: int, topk, rows_in, escaping, region, rows: int, first: fx.Node) -> str | None:
    """Why the region cannot run on another rank's rows, or None."""
    if len(sizes) > 1:
        return f"its grouped matmuls read stacked weights of different expert counts {sorted(sizes)}"
    if topk is not None and int(local_val(topk.args[0]).shape[-1]) != experts:
        return (f"its router's top-k chooses among {int(local_val(topk.args[0]).shape[-1])} logits, but the "
                f"stacked weights hold {experts} experts")
    odd = [i for i in rows_in if not isinstance(local_val(i), torch.Tensor) or local_val(i).dim() == 0
           or int(local_val(i).shape[0]) != rows]
    if odd:
        return (f"the expert region reads {odd[0].name} ({source_line(odd[0]) or 'no source line'}), which is not "
                f"one row per grouped-matmul row ({rows} rows): only row-wise values can travel with the rows")
    if escaping:
        return (f"{escaping[0].name} ({source_line(escaping[0]) or 'no source line'}) inside the expert region "
                f"is read outside it: only the last grouped matmul's rows can come back")
    fixed = [n for n in region if n is not first and _mentions(n.args, rows)]
    if fixed:
        return (f"{fixed[0].name} ({source_line(fixed[0]) or 'no source line'}) fixes the row count {rows}: the "
                f"region must run on any number of rows")
    return None


def _mentions(args, value: int) -> bool:
    """Whether ``value`` appears as an int among ``args`` (nested lists included)."""
    for a in args:
        if isinstance(a, (list, tuple)):
            if _mentions(a, value):
                return True
        elif type(a) is int and a == value:
            return True
    return False


def expert_candidates(traced, lists) -> list[str]:
    """What in the traced graph looks like part of a mixture of experts, for the message when no layer
    is found: lists of expert modules left as written (``passes/expert_lists.py``, with the reason),
    3-D parameters and what reads them, top-k nodes."""
    gm, param_of = traced.gm, traced.param_of
    out = [x.summary for x in lists if x.refusal]
    for n in gm.graph.nodes:
        if n.op == "placeholder" and n.name in param_of and n.meta["val"].dim() == 3:
            readers = sorted({str(u.target).split(".")[-2] if "." in str(u.target) else str(u.target) for u in n.users})
            out.append(f"3-D parameter {param_of[n.name]} {tuple(n.meta['val'].shape)} read by {', '.join(readers)}")
        elif n.op == "call_function" and n.target == aten.topk.default:
            out.append(f"a top-k in {module_path(n) or 'the model'} ({source_line(n) or 'no source line'})")
    return out[:6]
