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

from autopar.trace import module_path, user_path

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

    def label(self, i: int) -> str:
        return f"{self.prefix}.{i}" if self.prefix else str(i)


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
    node_layer = {}
    for name, path in paths.items():
        for pre, idx in _indexed_prefixes(path):
            if pre == prefix:
                node_layer[name] = idx
                break
    return LayerInfo(prefix, max(indices[prefix]) + 1, node_layer)


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
    if not info.prefix:
        return None
    if info.by_calls:
        for key, (path, _) in (node.meta.get("nn_module_stack") or {}).items():
            if user_path(path) == info.prefix:
                m = _CALL.search(key)
                return int(m.group(1)) if m else 0
        return None
    path = module_path(node)
    if path.startswith(info.prefix + "."):
        head = path[len(info.prefix) + 1 :].split(".")[0]
        return int(head) if head.isdigit() else None
    return None


def layer_of_param(name: str, info: LayerInfo) -> int | None:
    """Layer index of a parameter name like ``h.3.attn.q.weight``, or None."""
    if not info.prefix:
        return None
    m = re.match(re.escape(info.prefix) + r"\.(\d+)\.", name)
    return int(m.group(1)) if m else None
