"""Which graph nodes belong to which repeated block (transformer layer).

A layer is one module call whose run of nodes repeats: the same module
classes called in the same order on the same shapes. The traced graph records,
for every node, the stack of module calls it ran in
(``node.meta["nn_module_stack"]``: call key -> (module path, class); a module
called again gets the key ``path@1``, ``path@2`` ...). Every module call gets
a signature from its nodes (op, classes of the calls below it, shape); calls
sharing a signature, at least two of them, each a block (two ops or more, one
of them a contraction: a lone linear or norm repeated is not a layer), are a
candidate stack. The stack is the candidate covering the most nodes: the
outermost repetition, since what repeats inside a block (heads, experts, the
two norms of a block) covers less; then the one with more calls, then the
outermost.

Calls of another structure join the stack as layers of their own kind when
they sit beside its calls (same parent call, same depth) and are blocks like
them: they run a sub-block (a call of two ops or more holding a contraction,
an attention or an MLP) of the same signature as one inside the stack's
blocks (a dense first layer before mixture-of-experts layers, a local-attention
block between global ones, a different last block, held as a plain attribute
or in a called ``nn.Sequential``), or they are children of the container
holding the stack when nothing calls that container (a ModuleList or
ModuleDict whose first block differs entirely, as T5's first block). The
embedding, the final norm and the head share no sub-block with the layers
and stay outside. So the blocks may sit anywhere: a ModuleList, a ModuleDict
with any keys, separate attributes, nested containers, an ``nn.Sequential``
with the embedding and head around them, or one block called several times
(weights shared across layers, as ALBERT). Layer i is the i-th call met in
graph order. Nothing here depends on names or container types.

A hybrid stack where no structure repeats (every block one of a few kinds:
attention, a state-space mixer, an MLP, experts, all behind one block class)
is found as the calls of one module class side by side (same parent call,
same depth), each a block returning a value of the shape of one it reads (on
the residual stream), in two structures or more; it competes with the
repeated structures by the nodes it covers. Calls of one class that each hold
a repeated block themselves (an encoder stack and a decoder stack) are stacks,
not layers, and are not such a group.
"""

from __future__ import annotations

import os
from collections import defaultdict
from dataclasses import dataclass, field

import torch
import torch.fx as fx

from autopar.core.graph import user_path

__all__ = ["LOOKED_FOR", "LayerInfo", "find_layers", "layer_of_node", "layer_of_param"]

LOOKED_FOR = ("a module call repeated at least twice with the same module classes called in the same order on "
              "the same shapes, each running two ops or more with a matmul among them (blocks held in any "
              "container or attribute, or one block called repeatedly), or calls of one module class side by side in two "
              "structures or more (a hybrid stack)")
"""What ``find_layers`` looks for, for the messages of the features that need layers."""


@dataclass(frozen=True)
class LayerInfo:
    prefix: str
    """Module path the layers share (``h``, ``model.layers``); '' if they share none or none was found."""
    count: int
    """Number of layers."""
    node_layer: dict[str, int]
    """Node name -> layer index, for nodes inside a layer."""
    by_calls: bool = False
    """The layers are calls of one module (weights shared across layers)."""
    offset: int = 0
    """Index in the container of layer 0 when the layers are ``prefix.<int>`` children (an
    ``nn.Sequential`` of embedding, blocks and head starts its blocks at 1); else 0."""
    paths: tuple[str, ...] = ()
    """Module path of each layer, in layer order (the same path repeated when one block is called again)."""
    keys: dict[str, int] = field(default_factory=dict)
    """Module-call key of ``nn_module_stack`` -> layer index (nodes added by later passes carry the keys)."""
    kinds: tuple[int, ...] = ()
    """Per layer, which structure it has: layers of one kind are the same module classes on the same
    shapes (a stack of one block has one kind; alternating or a different first block, several)."""

    def stands_for(self, i: int) -> int:
        """The first layer of layer i's kind: the one the summary shows for every layer alike."""
        if not self.kinds:
            return 0
        return self.kinds.index(self.kinds[i])

    def label(self, i: int) -> str:
        """Layer i as the user's model names it (its module path)."""
        if self.paths:
            return self.paths[i]
        return f"{self.prefix}.{i + self.offset}" if self.prefix else str(i + self.offset)

    def layer_at(self, index: int) -> int | None:
        """Layer number of the container's child ``index``, None if that child is not a layer."""
        i = index - self.offset
        return i if 0 <= i < self.count else None

    def describe(self) -> str:
        """What was found, in words (the summary's header)."""
        if self.count == 0:
            return f"no repeated layers (looked for {LOOKED_FOR})"
        where = f"'{self.paths[0]}' .. '{self.paths[-1]}'" if self.paths else f"'{self.prefix}'"
        shared = ", one block called repeatedly" if self.by_calls else ""
        firsts = sorted(set(self.kinds))
        kinds = "" if len(firsts) < 2 else f"; {len(firsts)} structures: " + ", ".join(
            f"{self.kinds.count(f)} like '{self.label(f)}'" for f in firsts)
        return f"{self.count} layers ({where}{shared}{kinds})"


def _signature(node: fx.Node, depth: int) -> tuple:
    stack = list((node.meta.get("nn_module_stack") or {}).values())
    val = node.meta.get("val")
    shape = tuple(val.shape) if isinstance(val, torch.Tensor) else type(val).__name__
    return str(node.target), tuple(str(cls) for _, cls in stack[depth + 1:]), shape


CONTRACTIONS = frozenset(getattr(torch.ops.aten, name).default for name in (
    "linear", "mm", "matmul", "bmm", "addmm", "baddbmm", "einsum", "scaled_dot_product_attention", "_grouped_mm")
    if hasattr(torch.ops.aten, name))
"""Ops that contract a dimension (the weight GEMMs and attention): a block holds at least one."""


@dataclass
class _Calls:
    """The module calls of a traced graph: per call key, its nodes, signature, path, class, depth and parent."""

    members: dict[str, list[fx.Node]] = field(default_factory=lambda: defaultdict(list))
    sigs: dict[str, list[tuple]] = field(default_factory=lambda: defaultdict(list))
    call: dict[str, tuple[str, str, int]] = field(default_factory=dict)
    parent: dict[str, str] = field(default_factory=dict)
    kind: dict[str, int] = field(default_factory=dict)
    """Call key -> its structure: calls of one kind have one class and one signature."""
    children: dict[str, list[str]] = field(default_factory=lambda: defaultdict(list))

    def is_block(self, key: str) -> bool:
        """Two ops or more, a contraction among them: a lone linear, a norm or an activation is not."""
        nodes = self.members[key]
        return len(nodes) >= 2 and any(n.target in CONTRACTIONS for n in nodes)

    def sub_blocks(self, key: str) -> set[int]:
        """The kinds of the blocks called inside this call (its attention, its MLP)."""
        out, todo = set(), list(self.children.get(key, ()))
        while todo:
            k = todo.pop()
            if self.is_block(k):
                out.add(self.kind[k])
            todo.extend(self.children.get(k, ()))
        return out


def _module_calls(gm: fx.GraphModule) -> _Calls:
    calls = _Calls()
    for node in gm.graph.nodes:
        if node.op != "call_function":
            continue
        stack = list((node.meta.get("nn_module_stack") or {}).items())
        for depth, (key, (path, cls)) in enumerate(stack):
            if not user_path(path):
                continue  # the traced wrapper and the model itself
            calls.call.setdefault(key, (user_path(path), str(cls), depth))
            calls.parent.setdefault(key, stack[depth - 1][0])
            calls.members[key].append(node)
            calls.sigs[key].append(_signature(node, depth))
    groups: dict[tuple, list[str]] = defaultdict(list)
    for key, sig in calls.sigs.items():
        groups[(calls.call[key][1], tuple(sig))].append(key)
    calls.kind = {key: g for g, keys in enumerate(groups.values()) for key in keys}
    for key, up in calls.parent.items():
        calls.children[up].append(key)
    return calls


def find_layers(gm: fx.GraphModule) -> LayerInfo:
    """Find the layer stack of a traced graph and map each node to its layer."""
    calls = _module_calls(gm)
    groups: dict[int, list[str]] = defaultdict(list)
    for key, kind in calls.kind.items():
        groups[kind].append(key)
    candidates = [keys for keys in groups.values() if len(keys) >= 2 and calls.is_block(keys[0])]
    candidates += _mixed_stacks(calls)
    if not candidates:
        return LayerInfo("", 0, {})
    size, depth = (lambda ks: sum(len(calls.members[k]) for k in ks)), (lambda k: calls.call[k][2])
    best = max(candidates, key=lambda ks: (size(ks), len(ks), -depth(ks[0])))
    order = {n.name: i for i, n in enumerate(gm.graph.nodes)}
    start = lambda k: order[calls.members[k][0].name]  # noqa: E731
    best = sorted(best + _beside(best, calls), key=start)
    node_layer = {n.name: i for i, key in enumerate(best) for n in calls.members[key]}
    paths = tuple(calls.call[k][0] for k in best)
    prefix, offset = _container(paths)
    first = {calls.kind[k]: i for i, k in reversed(list(enumerate(best)))}  # kind -> its first layer
    return LayerInfo(prefix, len(best), node_layer, by_calls=len(set(paths)) < len(paths), offset=offset,
                     paths=paths, keys={k: i for i, k in enumerate(best)},
                     kinds=tuple(first[calls.kind[k]] for k in best))


def _mixed_stacks(calls: _Calls) -> list[list[str]]:
    """Blocks of one module class side by side (same parent call, same depth) in two structures or more,
    as a hybrid stack whose every block is one of a few kinds (attention, state-space mixer, MLP,
    mixture of experts behind one block class), where no single structure need repeat; each returns a
    value of the shape of one it reads, as a block on the residual stream does. A group whose
    every member holds a repeated block itself is a group of stacks (an encoder and a decoder), not of
    layers."""
    by_class: dict[tuple, list[str]] = defaultdict(list)
    for key, (_, cls, depth) in calls.call.items():
        if calls.is_block(key) and _keeps_shape(key, calls):
            by_class[(cls, calls.parent[key], depth)].append(key)
    return [keys for keys in by_class.values()
            if len(keys) >= 2 and len({calls.kind[k] for k in keys}) >= 2
            and not all(_holds_repeat(k, calls) for k in keys)]


def _keeps_shape(key: str, calls: _Calls) -> bool:
    """The call returns a float value of the shape of one it reads from the graph (a block on the residual
    stream; a projection to another width, as a fused QKV linear, is not one)."""
    members = set(calls.members[key])
    reads = {a for n in members for a in n.all_input_nodes if a not in members and a.op != "placeholder"}
    gives = {n for n in members if any(u not in members for u in n.users)}

    def shapes(nodes):
        vals = (n.meta.get("val") for n in nodes)
        return {tuple(v.shape) for v in vals if isinstance(v, torch.Tensor) and v.dtype.is_floating_point}

    return bool(shapes(reads) & shapes(gives))


def _holds_repeat(key: str, calls: _Calls) -> bool:
    """Two calls or more of one block structure run inside this call."""
    seen, todo = set(), list(calls.children.get(key, ()))
    while todo:
        k = todo.pop()
        if calls.is_block(k):
            if calls.kind[k] in seen:
                return True
            seen.add(calls.kind[k])
        todo.extend(calls.children.get(k, ()))
    return False


def _beside(stack: list[str], calls: _Calls) -> list[str]:
    """Calls of another structure that are layers too: beside the stack's calls (same parent call, same
    depth) and running a sub-block like the stack's, or children of the container holding the stack when
    nothing calls it."""
    parents, depth = {calls.parent[k] for k in stack}, calls.call[stack[0]][2]
    shared = set().union(*(calls.sub_blocks(k) for k in stack))
    paths = [calls.call[k][0] for k in stack]
    holder = _container(tuple(paths))[0] if len(set(paths)) == len(paths) else ""
    if holder and any(path == holder for path, _, _ in calls.call.values()):
        holder = ""  # a called container (an nn.Sequential) holds the embedding and head too
    out = []
    for key, (path, _, d) in calls.call.items():
        if key in stack or d != depth or calls.parent[key] not in parents:
            continue
        alike = calls.is_block(key) and bool(calls.sub_blocks(key) & shared)
        held = bool(holder) and path.rpartition(".")[0] == holder
        if alike or held:
            out.append(key)
    return out


def _container(paths: tuple[str, ...]) -> tuple[str, int]:
    """The module path the layers share, and the index of layer 0 when they are its integer children."""
    if len(set(paths)) == 1:
        return paths[0], 0
    split = [p.split(".") for p in paths]
    common = os.path.commonprefix(split)
    prefix = ".".join(common)
    rest = [s[len(common):] for s in split]
    if all(len(r) == 1 and r[0].isdigit() for r in rest):
        return prefix, int(rest[0][0])
    return prefix, 0


def layer_of_node(node: fx.Node, info: LayerInfo) -> int | None:
    """Layer index of any node carrying the traced module stack (also nodes added by the passes)."""
    if info.count == 0:
        return None
    for key in node.meta.get("nn_module_stack") or {}:
        if key in info.keys:
            return info.keys[key]
    return None


def layer_of_param(name: str, info: LayerInfo) -> int | None:
    """Layer index of a parameter name like ``h.3.attn.q.weight`` (the first layer whose module
    holds it), or None: outside the layers, or held by a block every layer calls."""
    if info.by_calls:
        return None
    for i, path in enumerate(info.paths):
        if name.startswith(path + "."):
            return i
    return None
