"""Which graph nodes belong to which repeated block (transformer layer).

A model's layers are the children of a container indexed by integers
(``h.0``, ``h.1`` ... or ``model.layers.0`` ...). We find, among all module
paths in the graph, the ``prefix.<int>`` pattern with the most distinct
indices: that prefix is the layer stack. Nothing here depends on names.
"""

from __future__ import annotations

import re
from collections import defaultdict
from dataclasses import dataclass

import torch.fx as fx

from autopar.trace import module_path

__all__ = ["LayerInfo", "find_layers", "layer_of_param"]

_INDEXED = re.compile(r"^(.*?)\.?(\d+)(?:\.|$)")


@dataclass(frozen=True)
class LayerInfo:
    prefix: str
    """Module path of the layer container (``h``, ``model.layers``); '' if none found."""
    count: int
    """Number of layers."""
    node_layer: dict[str, int]
    """Node name -> layer index, for nodes inside a layer."""

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


def layer_of_param(name: str, info: LayerInfo) -> int | None:
    """Layer index of a parameter name like ``h.3.attn.q.weight``, or None."""
    if not info.prefix:
        return None
    m = re.match(re.escape(info.prefix) + r"\.(\d+)\.", name)
    return int(m.group(1)) if m else None
