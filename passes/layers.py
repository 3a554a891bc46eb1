"""Which graph nodes belong to which repeated block (transformer layer).

A model's layers are the children of a container indexed by integers
(``h.0``, ``h.1`` ... or ``model.layers.0`` ...). We find, among all module
paths in the graph, the ``prefix.<int>`` pattern with the most distinct
indices: that prefix is the layer stack. A model that applies one block
several times (weights shared across layers, as ALBERT or a universal
transformer) has no such container: then the layers are the calls of the
module called most often (export numbers them ``block``, ``block@1``, ...).
Nothing here depends on names.
"""

from __future__ import annotations

import re
from collections import defaultdict
from dataclasses import dataclass

import torch.fx as fx

from autopar.core.graph import module_path, user_path

__all__ = ["LayerInfo", "find_layers", "layer_of_node", "layer_of_param"]

_INDEXED = re.compile(r"^(.*?)\.?(\d+)(?:\.|$)")


@dataclass(frozen=True)
class LayerInfo:
    prefix: str
    """Module path of the layer container (``h``, ``model.layers``); '' if none found."""
    count: int
    """Number of layers."""
    node_layer: dict[str, int]
    """Node name -> layer index, for nodes inside a layer."""
    by_calls: bool = False
    """The layers are the calls of one module (weights shared across layers)."""
    offset: int = 0
    """Index in the container of layer 0 (an ``nn.Sequential`` of embedding, blocks and head
    starts its blocks at 1)."""

    def label(self, i: int) -> str:
        return f"{self.prefix}.{i + self.offset}" if self.prefix else str(i + self.offset)

    def layer_at(self, index: int) -> int | None:
        """Layer number of the container's child ``index``, None if that child is not a layer."""
        i = index - self.offset
        return i if 0 <= i < self.count else None


def _indexed_prefixes(path: str) -> list[tuple[str, int]]:
    parts = path.split(".") if path else []
    return [(".".join(parts[:i]), int(p)) for i, p in enumerate(parts) if p.isdigit()]


def find_layers(gm: fx.GraphModule) -> LayerInfo:
    """Find the layer stack of a traced graph and map each node to its layer."""
    indices: dict[str, set[int]] = defaultdict(set)
    paths = {}
    for node in gm.graph.nodes:
        if node.op != "call_function":
            continue
        paths[node.name] = module_path(node)
        for prefix, idx in _indexed_prefixes(paths[node.name]):
            indices[prefix].add(idx)
    if not indices or max(len(v) for v in indices.values()) < 2:
        repeated = _repeated_calls(gm)
        if repeated is not None:
            return repeated
    if not indices:
        return LayerInfo("", 0, {})
    prefix = max(indices, key=lambda p: (len(indices[p]), -p.count(".")))
    first, last = _blocks(gm, prefix, indices[prefix])
    node_layer = {}
    for name, path in paths.items():
        for pre, idx in _indexed_prefixes(path):
            if pre == prefix:
                if first <= idx <= last:
                    node_layer[name] = idx - first
                break
    return LayerInfo(prefix, last - first + 1, node_layer, offset=first)


def _blocks(gm: fx.GraphModule, prefix: str, indices: set[int]) -> tuple[int, int]:
    """The children of the container that are the repeated block: those of its most common class,
    when they form one run (an ``nn.Sequential(embedding, *blocks, head)``); else all of them."""
    kind: dict[int, str] = {}
    for node in gm.graph.nodes:
        for path, cls in (node.meta.get("nn_module_stack") or {}).values():
            for pre, idx in _indexed_prefixes(user_path(path)):
                if pre == prefix and user_path(path) == (f"{prefix}.{idx}" if prefix else str(idx)):
                    kind.setdefault(idx, str(cls))
    counts: dict[str, int] = defaultdict(int)
    for cls in kind.values():
        counts[cls] += 1
    everything = (min(indices), max(indices))
    if not counts:
        return everything
    common = max(counts, key=counts.get)
    run = sorted(i for i, c in kind.items() if c == common)
    if len(run) >= 2 and run == list(range(run[0], run[-1] + 1)) and len(run) < len(indices):
        return run[0], run[-1]
    return everything


_CALL = re.compile(r"@(\d+)$")


def _repeated_calls(gm: fx.GraphModule) -> LayerInfo | None:
    """Layers as the calls of the module called most often (at least twice), outermost first."""
    calls: dict[str, set[int]] = defaultdict(set)
    for node in gm.graph.nodes:
        for key, (path, _) in (node.meta.get("nn_module_stack") or {}).items():
            m = _CALL.search(key)
            calls[user_path(path)].add(int(m.group(1)) if m else 0)
    calls = {p: c for p, c in calls.items() if len(c) >= 2 and p}
    if not calls:
        return None
    prefix = max(calls, key=lambda p: (len(calls[p]), -p.count(".")))
    node_layer = {}
    for node in gm.graph.nodes:
        for key, (path, _) in (node.meta.get("nn_module_stack") or {}).items():
            if user_path(path) == prefix:
                m = _CALL.search(key)
                node_layer[node.name] = int(m.group(1)) if m else 0
                break
    return LayerInfo(prefix, max(calls[prefix]) + 1, node_layer, by_calls=True)


def layer_of_node(node: fx.Node, info: LayerInfo) -> int | None:
    """Layer index of any node carrying the traced module stack (also nodes added by the passes)."""
    if info.count == 0:
        return None
    if info.by_calls:
        for key, (path, _) in (node.meta.get("nn_module_stack") or {}).items():
            if user_path(path) == info.prefix:
                m = _CALL.search(key)
                return int(m.group(1)) if m else 0
        return None
    for pre, idx in _indexed_prefixes(module_path(node)):
        if pre == info.prefix:
            return info.layer_at(idx)
    return None


def layer_of_param(name: str, info: LayerInfo) -> int | None:
    """Layer index of a parameter name like ``h.3.attn.q.weight``, or None."""
    if info.by_calls:
        return None
    m = re.match((re.escape(info.prefix) + r"\." if info.prefix else "") + r"(\d+)\.", name)
    return info.layer_at(int(m.group(1))) if m else None
