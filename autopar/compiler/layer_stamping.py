"""A deep stack of identical blocks traced from four of them, the rest stamped from the trace.

torch.export spends the same time on every block of a stack (about 90 ms per
block of the paper's 1T model: 11 s for its 128 blocks), and every block of a
stack of identical blocks gives the same run of graph nodes up to names. So a
model whose blocks sit in one list of identical modules is traced with the list
cut short, and the missing blocks are copied in:

- **The stack.** An ``nn.ModuleList`` (or a numbered ``nn.Sequential``) of at
  least ``STAMP_FROM`` blocks, all of the same module classes, parameter and
  buffer shapes, public attributes and hooks, no parameter shared with
  anything else. Found from the modules, not their names.
- **Traced short.** The list is cut to its first three blocks and the model
  traced; then to four. The first trace's block 1 ``period`` (its first node
  up to block 2's first node: what the forward does per block, the loop's own
  ops between blocks included) is copied in after itself, block by block,
  each copy with its block's parameters, buffers and module paths, and
  reading from the copy before it what block 1 read from block 0.
- **Checked.** The three-block trace stamped to four blocks must equal the
  four-block trace node for node: op, arguments, names, shapes, module paths,
  source lines, placeholders. A forward that treats the blocks unequally in a
  way a four-block trace shows (the list's length in the math, a block
  reading one two back) fails the check, and the model is traced whole.
- **Stamped.** The three-block trace is stamped to the list's length; the last
  block keeps its place at the end with what follows it, so a last block made
  special through ``len`` of the list comes out right.

What four blocks cannot show is a forward keyed to a count held elsewhere, say
``if i == config.n_layer - 1`` for a special last block: the short traces never
reach it. Setting ``AUTOPAR_TRACE=whole`` traces every block; the plan
summary's first lines say when a graph was stamped. A failed short trace (a
forward that indexes the list by a count of its own) is not an error: the
model is traced whole.
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable
from dataclasses import dataclass

import torch.fx as fx
import torch.nn as nn

from autopar.compiler.trace_error import TraceError
from autopar.compiler.module_state import module_state
from autopar.core.graph import WRAPPER_PREFIX, TracedModel

__all__ = ["Stamping", "STAMP_FROM", "stamped_trace", "same_trace"]

STAMP_FROM = 16
"""The fewest blocks a stack has for stamping to be worth its two short traces."""
TRACED = 3
"""Blocks traced before stamping (the check traces one more)."""


@dataclass(frozen=True)
class Stamping:
    """How a trace was made from a short one: the stack's path, its length, the blocks traced."""

    path: str
    blocks: int
    traced: int = TRACED

    def describe(self) -> str:
        return (f"{self.traced} of the {self.blocks} blocks of {self.path} traced, {self.blocks - self.traced} "
                f"stamped from them (checked against a {self.traced + 1}-block trace; AUTOPAR_TRACE=whole "
                "traces every block)")


def stamped_trace(model: nn.Module, trace_whole: Callable[[nn.Module], TracedModel]
                  ) -> tuple[TracedModel, Stamping] | None:
    """The model's trace stamped from short ones, or None where the model must be traced whole
    (no long stack of identical blocks, a short trace failed, or the check found a difference)."""
    if os.environ.get("AUTOPAR_TRACE", "") == "whole":
        return None
    found = _identical_stack(model)
    if found is None:
        return None
    path, parent, attr, stack = found
    try:
        short = _traced_with(parent, attr, stack, TRACED, model, trace_whole)
        check = _traced_with(parent, attr, stack, TRACED + 1, model, trace_whole)
    except TraceError:
        return None
    four = _stamped(short, model, path, TRACED + 1)
    if four is None or same_trace(four, check) is not None:
        return None
    full = _stamped(short, model, path, len(stack))
    return (full, Stamping(path=path, blocks=len(stack))) if full is not None else None


def _stamped(short: TracedModel, model: nn.Module, path: str, n: int) -> TracedModel | None:
    """``short`` stamped to ``n`` blocks, with each block's constants; None where it cannot be."""
    t = _stamp(short, WRAPPER_PREFIX + path, path, n)
    if t is not None:
        t.constants = _block_constants(short.constants, model, path, n)
    return t if t is not None and t.constants is not None else None


def _block_constants(constants: dict, model: nn.Module, path: str, n: int) -> dict | None:
    """The trace's constant values for ``n`` blocks: those outside the stack as traced, and each
    block's (its non-persistent buffers: the export keeps their values here) read from the model, at
    the place the stack's took; None when one is not a buffer of the block."""
    head = f"{WRAPPER_PREFIX}{path}."
    suffixes = [k[len(head):].split(".", 1)[1] for k in constants if k.startswith(head + "0.")]
    out: dict = {}
    for key, value in constants.items():
        if not key.startswith(head):
            out[key] = value
        elif not any(k.startswith(head) for k in out):
            for i in range(n):
                for suffix in suffixes:
                    try:
                        out[f"{head}{i}.{suffix}"] = model.get_buffer(f"{path}.{i}.{suffix}")
                    except AttributeError:
                        return None
    return out


def _traced_with(parent: nn.Module, attr: str, stack: nn.Module, n: int, model: nn.Module,
                 trace_whole: Callable[[nn.Module], TracedModel]) -> TracedModel:
    """The model traced with the stack cut to its first ``n`` blocks (put back afterwards)."""
    blocks = list(stack)[:n]
    short = nn.ModuleList(blocks) if isinstance(stack, nn.ModuleList) else nn.Sequential(*blocks)
    setattr(parent, attr, short)
    try:
        return trace_whole(model)
    finally:
        setattr(parent, attr, stack)


def _identical_stack(model: nn.Module) -> tuple[str, nn.Module, str, nn.Module] | None:
    """The longest list of at least ``STAMP_FROM`` identical blocks: (its path, its parent, its
    attribute name, the list), or None."""
    owners: dict[int, int] = {}
    for _, p in model.named_parameters(remove_duplicate=False):
        owners[id(p)] = owners.get(id(p), 0) + 1
    best = None
    for path, parent in model.named_modules():
        for attr, child in parent.named_children():
            if type(child) not in (nn.ModuleList, nn.Sequential) or len(child) < STAMP_FROM:
                continue
            if [name for name, _ in child.named_children()] != [str(i) for i in range(len(child))]:
                continue
            if best is not None and len(child) <= len(best[3]):
                continue
            if any(owners[id(p)] != 1 for p in child.parameters()):
                continue  # a block's weight shared with another block or with the rest of the model
            first = _block_state(child[0])
            if all(_block_state(b) == first for b in list(child)[1:]):
                best = (f"{path}.{attr}" if path else attr, parent, attr, child)
    return best


def _block_state(block: nn.Module) -> tuple:
    """What a block's trace depends on: its modules' classes, modes, parameter and buffer shapes,
    public attributes (``module_state``) and hooks."""
    hooks = tuple(tuple(tuple(d.values()) for d in (m._forward_pre_hooks, m._forward_hooks,
                                                     m._backward_hooks, m._backward_pre_hooks))
                  for m in block.modules())
    return module_state(block), hooks


def _block_of(node: fx.Node, prefix: str) -> int | None:
    """The stack's block a node was traced in (its module path under ``prefix.i``), or None."""
    for path, _ in (node.meta.get("nn_module_stack") or {}).values():
        if path.startswith(prefix + "."):
            head = path[len(prefix) + 1:].split(".", 1)[0]
            if head.isdigit():
                return int(head)
    return None


def _renumber(text: str, prefix: str, old: int, new: int) -> str:
    """``text`` with the block path ``prefix.old`` (as a whole path component) made ``prefix.new``."""
    return re.sub(re.escape(f"{prefix}.{old}") + r"(?=$|[.@])", f"{prefix}.{new}", text)


def _stamp(t: TracedModel, prefix: str, path: str, n: int) -> TracedModel | None:
    """``t`` (a trace of the stack's first ``TRACED`` blocks) with blocks added up to ``n``: block
    1's period copied for blocks 2 .. n-2, the last block renumbered to n-1; None when block 0's
    and block 1's periods differ in length or ops, or a period holds what a copy cannot take
    (a lifted constant, a submodule call)."""
    nodes = list(t.gm.graph.nodes)
    last = TRACED - 1
    body = [i for i, nd in enumerate(nodes) if nd.op != "placeholder"]
    first = {}
    for i in body:
        b = _block_of(nodes[i], prefix)
        if b is not None:
            first.setdefault(b, i)
    if sorted(first) != list(range(TRACED)):
        return None
    before, period = nodes[first[0]:first[1]], nodes[first[1]:first[2]]
    if len(before) != len(period) or any(a.op != b.op or a.target != b.target for a, b in zip(before, period)):
        return None
    if any(nd.op in ("get_attr", "call_module") for nd in period):
        return None
    index_before = {nd: j for j, nd in enumerate(before)}
    own = {**t.param_of, **t.buffer_of}
    block_ph = {b: [nd for nd in nodes if nd.op == "placeholder" and _owned_by(own.get(nd.name), path, b)]
                for b in (1, last)}
    used = {a for nd in period for a in nd.all_input_nodes if a.op == "placeholder"}
    if any(a.name in t.constant_of for a in used):
        return None

    g = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    param_of, buffer_of = {}, {}

    def placeholder(template: fx.Node, block: int, new_block: int) -> fx.Node:
        old_name = own[template.name]
        new_name = _renumber_name(old_name, path, block, new_block)
        ph_name = template.name.replace(_sanitized(f"{prefix}.{block}_"), _sanitized(f"{prefix}.{new_block}_"), 1)
        node = g.placeholder(ph_name, type_expr=template.type)
        node.meta = dict(template.meta)
        (param_of if template.name in t.param_of else buffer_of)[node.name] = new_name
        return node

    after: dict[fx.Node, list[fx.Node]] = {}  # the last of block 1's parameters (buffers) -> all of them
    for kind in (t.param_of, t.buffer_of):
        group = [p for p in block_ph[1] if p.name in kind]
        if group:
            after[group[-1]] = group
    copies_ph: dict[int, dict[fx.Node, fx.Node]] = {m: {} for m in range(2, n - 1)}
    for nd in nodes:
        if nd.op != "placeholder":
            break
        if nd in block_ph[last]:
            env[nd] = placeholder(nd, last, n - 1)
        else:
            env[nd] = g.placeholder(nd.name, type_expr=nd.type)
            env[nd].meta = dict(nd.meta)
            for table, out in ((t.param_of, param_of), (t.buffer_of, buffer_of)):
                if nd.name in table:
                    out[env[nd].name] = table[nd.name]
        for m in range(2, n - 1):  # the copies' own placeholders, in the model's order
            for p in after.get(nd, ()):
                copies_ph[m][p] = placeholder(p, 1, m)

    def copy(nd: fx.Node, mapping: Callable[[fx.Node], fx.Node], block: int | None, new_block: int) -> fx.Node:
        # named as export names: the op's name, numbered by the graph in order of creation
        new = g.create_node(nd.op, nd.target, fx.map_arg(nd.args, mapping), fx.map_arg(nd.kwargs, mapping),
                            name=re.sub(r"_\d+$", "", nd.name), type_expr=nd.type)
        new.meta = dict(nd.meta)
        if block is not None and block != new_block and "nn_module_stack" in nd.meta:
            new.meta["nn_module_stack"] = renumbered(nd.meta["nn_module_stack"], block, new_block)
        return new

    paths: dict[tuple[str, int, int], str] = {}  # a block's nodes repeat its module paths: each renumbered once

    def renumbered(stack: dict, block: int, new_block: int) -> dict:
        def one(text: str) -> str:
            key = (text, block, new_block)
            if key not in paths:
                paths[key] = _renumber(text, prefix, block, new_block)
            return paths[key]

        return {one(k): (one(p), cls) for k, (p, cls) in stack.items()}

    for nd in nodes:
        if nd.op == "placeholder":
            continue
        if nd is nodes[first[2]]:
            previous = [env[x] for x in period]
            for m in range(2, n - 1):
                made: dict[fx.Node, fx.Node] = {}

                def mapping(a: fx.Node, made=made, previous=previous, m=m) -> fx.Node:
                    if a in made:
                        return made[a]
                    if a in index_before:
                        return previous[index_before[a]]
                    if a in copies_ph[m]:
                        return copies_ph[m][a]
                    return env[a]

                for x in period:
                    made[x] = copy(x, mapping, 1 if _block_of(x, prefix) == 1 else None, m)
                previous = [made[x] for x in period]
            for x, y in zip(period, previous):
                env[x] = y
        block = _block_of(nd, prefix)
        env[nd] = copy(nd, env.__getitem__, last if block == last else None, n - 1)

    gm = fx.GraphModule(t.gm, g)
    logits = None
    if t.logits is not None:
        logits = next(env[nd].name for nd in nodes if nd.name == t.logits)
    user = {nd.name: env[nd].name for nd in nodes if nd.op == "placeholder"}
    return TracedModel(
        gm=gm, param_of=param_of, buffer_of=buffer_of,
        constant_of={user[k]: v for k, v in t.constant_of.items()},
        input_names=[user[k] for k in t.input_names], target_names=[user[k] for k in t.target_names],
        constants=dict(t.constants), aliases=dict(t.aliases), model_name=t.model_name, logits=logits)


def _owned_by(name: str | None, path: str, block: int) -> bool:
    return name is not None and name.startswith(f"{path}.{block}.")


def _renumber_name(name: str, path: str, old: int, new: int) -> str:
    return f"{path}.{new}." + name[len(f"{path}.{old}."):]


def _sanitized(path: str) -> str:
    return re.sub(r"[^0-9a-zA-Z_]", "_", path)


def same_trace(a: TracedModel | None, b: TracedModel) -> str | None:
    """None when two traces are the same graph (ops, arguments, names, shapes, module paths, source
    lines) with the same placeholders; otherwise the first difference, in words."""
    if a is None:
        return "the three-block trace could not be stamped"
    for field in ("param_of", "buffer_of", "constant_of", "input_names", "target_names", "logits"):
        if getattr(a, field) != getattr(b, field):
            return f"{field} differs"
    if list(a.constants) != list(b.constants) or any(_val(a.constants[k]) != _val(b.constants[k]) for k in a.constants):
        return "constants differ"
    na, nb = list(a.gm.graph.nodes), list(b.gm.graph.nodes)
    if len(na) != len(nb):
        return f"{len(na)} nodes against {len(nb)}"
    for x, y in zip(na, nb):
        if (x.op, x.name, str(x.target)) != (y.op, y.name, str(y.target)):
            return f"node {x.name} ({x.target}) against {y.name} ({y.target})"
        if _args(x.args) != _args(y.args) or _args(x.kwargs) != _args(y.kwargs):
            return f"arguments of {x.name}: {x.args} against {y.args}"
        for key in ("nn_module_stack", "stack_trace"):
            if x.meta.get(key) != y.meta.get(key):
                return f"{key} of {x.name}"
        vx, vy = x.meta.get("val"), y.meta.get("val")
        if _val(vx) != _val(vy):
            return f"value of {x.name}: {_val(vx)} against {_val(vy)}"
    return None


def _args(args) -> object:
    return fx.map_arg(args, lambda nd: ("node", nd.name))


def _val(v) -> object:
    if hasattr(v, "shape") and hasattr(v, "dtype"):
        return tuple(v.shape), v.dtype
    if isinstance(v, (tuple, list)):
        return tuple(_val(x) for x in v)
    return repr(v)
