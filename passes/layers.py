"""Which graph nodes belong to which repeated block (transformer layer).

A layer is one module call whose run of nodes repeats: the same module
classes called in the same order on the same shapes. The traced graph records,
for every node, the stack of module calls it ran in
(``node.meta["nn_module_stack"]``: call key -> (module path, class); a module
called again gets the key ``path@1``, ``path@2`` ...). Every module call gets
a signature from its nodes (op, classes of the calls below it, shape); calls
sharing a signature, at least two of them, are a candidate stack. The stack is
the candidate covering the most nodes (then the one with more calls, then the
outermost). Calls of another structure join the stack as layers of their own
kind when they sit beside its calls: under the same parent call and between
the stack's first and last call (blocks of two kinds that alternate; a call
holding fewer than a quarter of a block's nodes, a norm between blocks, does
not), or in the same container when nothing calls that container (a ModuleList
or ModuleDict whose first or last block differs). So the blocks may sit anywhere: a ModuleList, a ModuleDict with
any keys, separate attributes, nested containers, an ``nn.Sequential`` with
the embedding and head around them, or one block called several times
(weights shared across layers, as ALBERT). Layer i is the i-th call met in
graph order. Nothing here depends on names or container types.
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
              "the same shapes (blocks held in any container or attribute, or one block called repeatedly)")
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
        return f"{self.count} layers ({where}{shared})"


def _signature(node: fx.Node, depth: int) -> tuple:
    stack = list((node.meta.get("nn_module_stack") or {}).values())
    val = node.meta.get("val")
    shape = tuple(val.shape) if isinstance(val, torch.Tensor) else type(val).__name__
    return str(node.target), tuple(str(cls) for _, cls in stack[depth + 1:]), shape


def find_layers(gm: fx.GraphModule) -> LayerInfo:
    """Find the layer stack of a traced graph and map each node to its layer."""
    members: dict[str, list[str]] = defaultdict(list)  # call key -> its node names, in graph order
    sigs: dict[str, list[tuple]] = defaultdict(list)
    call: dict[str, tuple[str, str, int]] = {}  # call key -> (path, class, depth)
    parent: dict[str, str] = {}  # call key -> the key of the call it ran in
    for node in gm.graph.nodes:
        if node.op != "call_function":
            continue
        stack = list((node.meta.get("nn_module_stack") or {}).items())
        for depth, (key, (path, cls)) in enumerate(stack):
            if not user_path(path):
                continue  # the traced wrapper and the model itself
            call.setdefault(key, (user_path(path), str(cls), depth))
            parent.setdefault(key, stack[depth - 1][0])
            members[key].append(node.name)
            sigs[key].append(_signature(node, depth))
    groups: dict[tuple, list[str]] = defaultdict(list)
    for key, sig in sigs.items():
        groups[(call[key][1], tuple(sig))].append(key)
    kind_of = {key: g for g, keys in enumerate(groups.values()) for key in keys}
    candidates = [keys for keys in groups.values() if len(keys) >= 2]
    if not candidates:
        return LayerInfo("", 0, {})
    best = max(candidates, key=lambda ks: (len(ks) * len(members[ks[0]]), len(ks), -call[ks[0]][2]))
    order = {n.name: i for i, n in enumerate(gm.graph.nodes)}
    best = sorted(best + _beside(best, call, parent, members, order), key=lambda k: order[members[k][0]])
    node_layer = {name: i for i, key in enumerate(best) for name in members[key]}
    paths = tuple(call[k][0] for k in best)
    prefix, offset = _container(paths)
    kinds = {kind_of[k]: i for i, k in reversed(list(enumerate(best)))}  # kind -> its first layer
    return LayerInfo(prefix, len(best), node_layer, by_calls=len(set(paths)) < len(paths), offset=offset,
                     paths=paths, keys={k: i for i, k in enumerate(best)},
                     kinds=tuple(kinds[kind_of[k]] for k in best))


def _beside(stack: list[str], call: dict, parent: dict, members: dict, order: dict) -> list[str]:
    """Calls of another structure that are layers too: beside the stack's calls (same parent call,
    same depth) and between its first and last call, or children of the container holding them
    when nothing calls it."""
    first, last = order[members[stack[0]][0]], order[members[stack[-1]][-1]]
    parents, depth = {parent[k] for k in stack}, call[stack[0]][2]
    paths = [call[k][0] for k in stack]
    holder = _container(tuple(paths))[0] if len(set(paths)) == len(paths) else ""
    if holder and any(path == holder for path, _, _ in call.values()):
        holder = ""  # a called container (an nn.Sequential) holds the embedding and head too
    size = len(members[stack[0]])
    out = []
    for key, (path, _, d) in call.items():
        if key in stack or d != depth or parent[key] not in parents:
            continue
        inside = first < order[members[key][0]] < last and 4 * len(members[key]) >= size
        held = bool(holder) and path.rpartition(".")[0] == holder
        if inside or held:
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
