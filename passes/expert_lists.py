"""Experts written as a list of modules, stacked: one grouped computation over stacked weights.

Many mixture-of-experts layers keep their experts as a list of identical MLP
modules and apply them one by one: every expert to every token, weighted by a
gate that is zero outside the token's top k (dense routing), or expert ``e``
to its slot ``e`` of a capacity-bound dispatch tensor (E, C, H) built from
the router's choices (GShard, Switch, DeepSpeed-MoE). With static shapes
each expert's input is a fixed number of rows.

This pass finds such a list from the module tree and the graph, not from any
name: a ``ModuleList`` (or ``ModuleDict``) of at least two items of one class with the same
parameters (names, shapes, dtypes), beside a ``topk`` over as many logits as
it has items (the router). Each item's call in the graph is its region (the
nodes traced inside it), and the regions must be one computation repeated:
the same ops in the same order on the same shapes, reading one input from
outside (its rows) and the item's own parameters, giving one output, each op
row by row (linears on the item's weights, ``x @ W`` with a 2-D weight of the
item, pointwise ops, casts, splits along the features). Then the per-item regions become one:

    rows   = cat([x_0.reshape(R, in), ..., x_{E-1}.reshape(R, in)])   (E R, in)
    offs   = R, 2R, ..., E R                                          the rows per expert, summed up
    ... each linear a grouped matmul over the stacked weights (E, out, in), its bias added per row,
    ... each pointwise op once on all rows ...
    y_e    = out_rows[e R : (e+1) R].reshape(y_e's shape)             read where y_e was

which is what ``passes/experts.py`` recognises as a mixture-of-experts layer
with stacked weights: expert parallelism, the sharding analysis and the
state machinery treat it like a layer written with stacked weights. The
routing, the gates and the combine are the model's own, untouched.

The stacked parameters are new: ``{list}.*.{name}`` (``blocks.0.experts.*.0.weight``)
stacks the items' ``{list}.{e}.{name}`` (``{list}.{key}.{name}`` for a dict) along a
new first dim, in item order.
``TracedModel.stacked`` records which model parameters each one stacks, so
weights come from the model (or its initialisation, or a state dict with the
model's keys), and checkpoints, ``full_state_dict`` and the HuggingFace export
give back the model's own per-item keys. The pass runs whether or not expert
parallelism is asked for, so a checkpoint's names do not depend on the layout.

A list that looks like experts but whose items are not one row-wise
computation is left as the model wrote it (its experts split by tensor
parallelism like any MLP); ``ExpertList.refusal`` says why, and the expert
parallelism error names it.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass, field

import torch
import torch.fx as fx
import torch.nn as nn
from torch._guards import detect_fake_mode

import autopar.core.grouped_mm  # noqa: F401  (registers autopar::grouped_mm)
from autopar.core.graph import TracedModel, local_val, source_line, user_path

__all__ = ["ExpertList", "stack_expert_lists", "STACKED_MARK"]

aten = torch.ops.aten

STACKED_MARK = "*"
"""The item index in a stacked parameter's name: ``{list}.*.{name}``."""

_ROW_OPS = frozenset({aten._to_copy.default, aten.to.dtype, aten.alias.default, aten.contiguous.default,
                      aten.detach.default})
"""Ops on one value that keep its rows, beside the pointwise ones (``torch.Tag.pointwise``)."""
_SPLITS = frozenset({aten.split.Tensor, aten.split_with_sizes.default, aten.chunk.default,
                     aten.unsafe_split.Tensor})
"""Splits of the features (last dim) into parts, read through ``getitem``."""
_MATMULS = frozenset({aten.matmul.default, aten.mm.default})
"""``x @ W`` with an item's 2-D weight W (in, out), as a linear's transposed weight."""
_CHECKS = frozenset({aten._assert_tensor_metadata.default})
"""Checks hanging off a value: dropped with the region."""


@dataclass(frozen=True)
class ExpertList:
    """A list of expert modules the graph applies one by one."""

    path: str
    """The list's module path."""
    experts: int
    """E: its items, and the router's logits."""
    stacked: dict[str, tuple[str, ...]] = field(default_factory=dict)
    """Stacked parameter -> the items' parameters it stacks, in item order ({} when refused)."""
    refusal: str | None = None
    """Why the items were left as written (None: stacked)."""

    @property
    def summary(self) -> str:
        if self.refusal:
            return f"a list of {self.experts} expert modules at {self.path}, left as written: {self.refusal}"
        return f"a list of {self.experts} expert modules at {self.path}, stacked into {len(self.stacked)} parameters"


def stack_expert_lists(traced: TracedModel, model: nn.Module) -> list[ExpertList]:
    """Rewrite every list of expert modules of ``traced`` into one grouped computation (module
    docstring), recording the stacked parameters in ``traced.stacked``; one ``ExpertList`` per list
    found, stacked or (with the reason) not."""
    found = []
    lists = _expert_lists(traced.gm, model)
    inside = _nodes_by_module(traced.gm) if lists else {}
    for path, items in lists:
        regions = [inside.get(f"{path}.{key}", []) for key, _ in items]
        members = _members(traced, path, items)
        refusal = members if isinstance(members, str) else _refusal(regions, members, traced)
        if refusal is not None:
            found.append(ExpertList(path, len(items), refusal=refusal))
            continue
        stacked = _stack(traced, path, regions, members, items[0][0])
        found.append(ExpertList(path, len(items), stacked=stacked))
    if any(not x.refusal for x in found):
        traced.gm.graph.lint()
        traced.gm.recompile()
    return found


def _expert_lists(gm: fx.GraphModule, model: nn.Module) -> list[tuple[str, list[tuple[str, nn.Module]]]]:
    """(path, its (key, item) pairs in order) of each ModuleList or ModuleDict of >= 2 items of one
    class with equal parameters, beside a top-k over as many logits (module docstring)."""
    routers = [(_path(n), int(local_val(n.args[0]).shape[-1])) for n in gm.graph.nodes
               if n.op == "call_function" and n.target == aten.topk.default]
    out = []
    for path, m in model.named_modules():
        if not (isinstance(m, (nn.ModuleList, nn.ModuleDict)) and len(m) > 1
                and len({type(c) for c in m.children()}) == 1):
            continue
        keyed = list(m.named_children())
        if len(keyed) != len(m):  # one module at two places of the list
            continue
        shapes = {tuple((k, tuple(p.shape), p.dtype) for k, p in c.named_parameters()) for _, c in keyed}
        if len(shapes) != 1 or not next(iter(shapes)):
            continue
        parent = path.rsplit(".", 1)[0] if "." in path else ""
        beside = [e for r, e in routers if not (r == path or r.startswith(path + "."))
                  and (not parent or r == parent or r.startswith(parent + "."))]
        if len(m) in beside:
            out.append((path, keyed))
    return out


def _path(node: fx.Node) -> str:
    stack = node.meta.get("nn_module_stack") or {}
    return user_path(list(stack.values())[-1][0]) if stack else ""


def _nodes_by_module(gm: fx.GraphModule) -> dict[str, list[fx.Node]]:
    """Module path -> the nodes traced inside it (its submodules' included), in graph order, checks
    left out: each item's region."""
    out: dict[str, list[fx.Node]] = {}
    for n in gm.graph.nodes:
        if n.op == "call_function" and n.target not in _CHECKS:
            for path in {user_path(p) for p, _ in (n.meta.get("nn_module_stack") or {}).values()}:
                out.setdefault(path, []).append(n)
    return out


def _members(traced: TracedModel, path: str, items: list[tuple[str, nn.Module]]) -> dict[str, list[str]] | str:
    """Each item parameter's name within its item -> the placeholders holding it, item by item; or
    why the items' parameters cannot be stacked (one tied to another's, or not read)."""
    placeholder = {name: ph for ph, name in traced.param_of.items()}
    canonical = {alias: name for name, names in traced.aliases.items() for alias in names}
    out: dict[str, list[str]] = {}
    for key, item in items:
        for rel, _ in item.named_parameters():
            full = f"{path}.{key}.{rel}"
            if canonical.get(full, full) != full or len(traced.aliases.get(full, [full])) > 1:
                return f"{full} is tied to another parameter"
            if full not in placeholder:
                return f"{full} is not read by the traced graph"
            out.setdefault(rel, []).append(placeholder[full])
    return out


def _refusal(regions: list[list[fx.Node]], members: dict[str, list[str]], traced: TracedModel) -> str | None:
    """Why the items' regions are not one row-wise computation repeated, or None."""
    if any(not r for r in regions):
        return "an item is never called"
    rel_of = {ph: rel for rel, phs in members.items() for ph in phs}
    shapes = []
    for region in regions:
        inputs = _inputs(region)
        outside = [i for i in inputs if i.name not in rel_of]
        if len(outside) != 1:
            return (f"each item must read one value from outside it (its rows); {_where(region[0])} reads "
                    f"{len(outside)} ({', '.join(i.name for i in outside)})")
        if len(_outputs(region)) != 1:
            return f"each item must give one value; {_where(region[0])} gives {len(_outputs(region))}"
        shapes.append(_signature(region, outside[0], rel_of))
    if any(s != shapes[0] for s in shapes[1:]):
        e = next(i for i, s in enumerate(shapes) if s != shapes[0])
        return f"item {e} does not compute what item 0 does (ops or shapes differ at {_where(regions[e][0])})"
    return _row_wise(regions[0], _inputs_outside(regions[0], rel_of), rel_of)


def _inputs(region: list[fx.Node]) -> list[fx.Node]:
    inside = set(region)
    return list(dict.fromkeys(i for n in region for i in n.all_input_nodes if i not in inside))


def _inputs_outside(region: list[fx.Node], rel_of: dict[str, str]) -> fx.Node:
    return next(i for i in _inputs(region) if i.name not in rel_of)


def _outputs(region: list[fx.Node]) -> list[fx.Node]:
    inside = set(region)
    return [n for n in region if any(u not in inside and u.target not in _CHECKS for u in n.users)]


def _signature(region: list[fx.Node], x: fx.Node, rel_of: dict[str, str]) -> tuple:
    index = {n: i for i, n in enumerate(region)}

    def token(a):
        if isinstance(a, fx.Node):
            return ("x",) if a is x else ("p", rel_of[a.name]) if a.name in rel_of else ("n", index.get(a))
        if isinstance(a, (list, tuple)):
            return tuple(token(b) for b in a)
        return a

    def val(n):
        v = n.meta.get("val")
        return (tuple(v.shape), v.dtype) if isinstance(v, torch.Tensor) else None

    return (val(x), tuple((n.target, token(n.args), tuple(sorted((k, token(v)) for k, v in n.kwargs.items())),
                           val(n)) for n in region))


def _row_wise(region: list[fx.Node], x: fx.Node, rel_of: dict[str, str]) -> str | None:
    """Why an op of the region is not row by row (the grouped form needs that), or None."""
    lead = tuple(local_val(x).shape[:-1])
    for n in region:
        params = [a for a in n.all_input_nodes if a.name in rel_of]
        if n.target == aten.linear.default:
            w = n.args[1]
            b = n.args[2] if len(n.args) > 2 else None
            if w.name not in rel_of or (b is not None and b.name not in rel_of) or n.args[0].name in rel_of:
                return f"{_where(n)} is a linear whose weight is not the item's own"
        elif n.target in _MATMULS:
            w = n.args[1]
            if not (isinstance(w, fx.Node) and w.name in rel_of and local_val(w).dim() == 2) or \
                    n.args[0].name in rel_of:
                return f"{_where(n)} multiplies by something other than one of the item's 2-D weights"
        elif n.target == operator.getitem:
            if n.args[0].target not in _SPLITS:
                return f"{_where(n)} takes a part of a value that is not a split of the features"
            continue
        elif n.target in _SPLITS:
            dim = n.args[2] if len(n.args) > 2 else n.kwargs.get("dim", 0)
            if dim % local_val(n.args[0]).dim() != local_val(n.args[0]).dim() - 1:
                return f"{_where(n)} splits dim {dim}, not the features"
            continue
        elif n.target in _ROW_OPS or torch.Tag.pointwise in getattr(n.target, "tags", ()):
            if any(local_val(p).dim() > 1 for p in params):
                return f"{_where(n)} reads an item parameter of more than one dim in a pointwise op"
            tensors = [a for a in n.all_input_nodes if a.name not in rel_of]
            if any(tuple(local_val(a).shape) != tuple(local_val(n).shape) for a in tensors):
                return f"{_where(n)} broadcasts across rows"
        else:
            return (f"{_where(n)} is {n.target}, not a linear, a product with an item's weight, a pointwise op, a "
                    f"cast or a split of the features: "
                    f"the items cannot run as one grouped computation")
        v = local_val(n)
        if not isinstance(v, torch.Tensor) or tuple(v.shape[:-1]) != lead:
            return f"{_where(n)} changes the rows {lead}"
    return None


def _where(n: fx.Node) -> str:
    return f"{n.name} ({source_line(n) or 'no source line'})"


class _Builder:
    """New nodes with their traced values (computed on the graph's fake tensors) and the item's place
    in the module tree (the list's, not item 0's)."""

    def __init__(self, graph: fx.Graph, before: fx.Node, list_stack: dict, stack_trace: str | None):
        self.graph, self.before, self.stack, self.trace = graph, before, list_stack, stack_trace
        self.mode = detect_fake_mode([n.meta.get("val") for n in graph.nodes if isinstance(n.meta.get("val"),
                                                                                              torch.Tensor)])

    def __call__(self, target, *args, **kwargs) -> fx.Node:
        with self.graph.inserting_before(self.before):
            node = self.graph.call_function(target, args, kwargs)
        vals = fx.node.map_arg((args, kwargs), lambda a: a.meta["val"])
        with self.mode:
            node.meta["val"] = target(*vals[0], **vals[1])
        node.meta["nn_module_stack"] = self.stack
        if self.trace:
            node.meta["stack_trace"] = self.trace
        node.meta["autopar_expert_list"] = True
        return node


def _stack(traced: TracedModel, path: str, regions: list[list[fx.Node]], members: dict[str, list[str]],
           first_key: str) -> dict[str, tuple[str, ...]]:
    gm, graph = traced.gm, traced.gm.graph
    E = len(regions)
    nodes = {n.name: n for n in graph.nodes}
    rel_of = {ph: rel for rel, phs in members.items() for ph in phs}
    first = regions[0]
    xs = [_inputs_outside(r, rel_of) for r in regions]
    ys = [_outputs(r)[0] for r in regions]
    # the new parameters: one stacked placeholder per item parameter, where item 0's was
    stacked, params = {}, {}
    for rel, phs in members.items():
        old = [nodes[p] for p in phs]
        name = f"{path}.{STACKED_MARK}.{rel}"
        with graph.inserting_before(old[0]):
            ph = graph.placeholder(_placeholder_name(gm, name))
        with detect_fake_mode([old[0].meta["val"]]) or torch._subclasses.FakeTensorMode():
            ph.meta["val"] = torch.stack([o.meta["val"] for o in old])
        params[rel], stacked[name] = ph, tuple(traced.param_of[p] for p in phs)
        traced.param_of[ph.name] = name
    list_stack = _list_stack(first[0], f"{path}.{first_key}")
    make = _Builder(graph, _after_inputs(graph, xs), list_stack, first[0].meta.get("stack_trace"))
    inp = int(local_val(xs[0]).shape[-1])
    R = local_val(xs[0]).numel() // inp
    rows = make(aten.cat.default, [make(aten.reshape.default, x, [R, inp]) for x in xs])
    # made from nothing (the engine puts it on its device): the offsets depend on no routing
    offs = make(aten.arange.start_step, R, (E + 1) * R, R, dtype=torch.int32, device=local_val(xs[0]).device)
    per_row: dict[str, fx.Node] = {}

    def param_rows(rel: str) -> fx.Node:  # (E, n) or (E,) -> one copy per row of its expert: (E R, n or 1)
        if rel not in per_row:
            p = params[rel]
            if p.meta["val"].dim() == 1:
                p = make(aten.unsqueeze.default, p, 1)
            n = int(p.meta["val"].shape[1])
            per_row[rel] = make(aten.reshape.default,
                                make(aten.expand.default, make(aten.unsqueeze.default, p, 1), [E, R, n]), [E * R, n])
        return per_row[rel]

    env: dict[fx.Node, fx.Node] = {xs[0]: rows}

    def arg(a):
        if isinstance(a, fx.Node):
            return param_rows(rel_of[a.name]) if a.name in rel_of else env[a]
        return a

    for n in first:
        if n.target == aten.linear.default:
            w = params[rel_of[n.args[1].name]]
            out = make(torch.ops.autopar.grouped_mm.default, env[n.args[0]], make(aten.transpose.int, w, 1, 2), offs)
            if len(n.args) > 2 and n.args[2] is not None:
                out = make(aten.add.Tensor, out, param_rows(rel_of[n.args[2].name]))
        elif n.target in _MATMULS:  # x @ W, W (in, out): the stacked (E, in, out) as it is
            out = make(torch.ops.autopar.grouped_mm.default, env[n.args[0]], params[rel_of[n.args[1].name]], offs)
        elif n.target in _SPLITS:
            args = list(n.args)
            if len(args) > 2:
                args[2] = -1
            kwargs = {k: (-1 if k == "dim" else v) for k, v in n.kwargs.items()}
            out = make(n.target, env[args[0]], *args[1:], **kwargs)
        else:
            out = make(n.target, *[fx.node.map_aggregate(a, arg) for a in n.args],
                       **{k: fx.node.map_aggregate(v, arg) for k, v in n.kwargs.items()})
        env[n] = out
    out_rows = env[ys[0]]
    for e, y in enumerate(ys):
        part = make(aten.slice.Tensor, out_rows, 0, e * R, (e + 1) * R)
        back = make(aten.reshape.default, part, list(local_val(y).shape))
        y.replace_all_uses_with(back)
    for region in reversed(regions):
        for n in reversed(region):
            for u in list(n.users):
                if u.target in _CHECKS:
                    graph.erase_node(u)
            graph.erase_node(n)
    for phs in members.values():
        for p in phs:
            graph.erase_node(nodes[p])
            del traced.param_of[p]
    traced.stacked.update(stacked)
    return stacked


def _order(graph: fx.Graph) -> dict[fx.Node, int]:
    return {n: i for i, n in enumerate(graph.nodes)}


def _after_inputs(graph: fx.Graph, xs: list[fx.Node]) -> fx.Node:
    """The node before which the grouped form goes: right after the last item input (the grouped
    form reads only the inputs and placeholders, and every reader of an item's output comes later)."""
    order = _order(graph)
    last = max(xs, key=order.__getitem__)
    return last.next


def _placeholder_name(gm: fx.GraphModule, name: str) -> str:
    base = "p_" + name.replace(STACKED_MARK, "stacked").replace(".", "_")
    taken = {n.name for n in gm.graph.nodes}
    out, i = base, 1
    while out in taken:
        out, i = f"{base}_{i}", i + 1
    return out


def _list_stack(node: fx.Node, item: str) -> dict:
    """``node``'s module stack cut at the list (the entries down to the list, not into ``item``)."""
    out = {}
    for key, (p, cls) in (node.meta.get("nn_module_stack") or {}).items():
        if user_path(p) == item or user_path(p).startswith(f"{item}."):
            out[key + "_list"] = (p.rsplit(".", 1)[0], nn.ModuleList)
            break
        out[key] = (p, cls)
    return out
