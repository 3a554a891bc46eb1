"""Activation recomputation: run chunks or layers under ``torch.utils.checkpoint``.

- ``chunk``: the whole chunk graph is one checkpoint; only its inputs are
  kept between a microbatch's forward and backward.
- ``layer``: the chunk graph is split by layer (``fx.passes.split_module``)
  into a parent graph calling one submodule per layer; each layer submodule is
  a checkpoint, so only each layer's inputs are kept. Nodes outside the layers
  (embedding, head, loss) run normally.

The recomputed forward replays the same ops, collectives included, under the
same RNG and autocast state, so losses and gradients are unchanged.
"""

from __future__ import annotations

import torch.fx as fx
import torch.nn as nn
from torch.fx.passes.split_module import split_module

from autopar.core.activation_recompute import Checkpointed
from autopar.core.errors import AutoparError
from passes.layers import LOOKED_FOR, LayerInfo, layer_of_node

__all__ = ["RecomputeError", "checkpoint_layers", "with_recompute"]


class RecomputeError(AutoparError, ValueError):
    """Recomputation cannot be applied as asked; the message says why and what to use instead."""


def checkpoint_layers(gm: fx.GraphModule, layers: LayerInfo) -> fx.GraphModule:
    """Split ``gm`` into per-layer submodules and checkpoint each of them."""
    # partitions in graph order: 0 before the first layer, 2k+1 the k-th layer met,
    # 2k+2 what follows it outside any layer (final norm, head, loss)
    order: dict[int, int] = {}
    parts: dict[str, int] = {}
    current = 0
    for node in gm.graph.nodes:
        if node.op in ("placeholder", "output"):
            continue
        layer = layer_of_node(node, layers)
        if layer is not None:
            current = 2 * order.setdefault(layer, len(order)) + 1
            parts[node.name] = current
        else:
            parts[node.name] = current + 1 if current % 2 == 1 else current
    layer_parts = {2 * k + 1: layer for layer, k in order.items()}
    split = split_module(gm, gm, lambda n: parts[n.name], keep_original_order=True)
    for name, sub in list(split.named_children()):
        idx = int(name.rsplit("_", 1)[-1])
        if idx in layer_parts:
            setattr(split, name, Checkpointed(sub, f"layer {layer_parts[idx]}"))
    return split


def with_recompute(gm: fx.GraphModule, mode: str, layers: LayerInfo) -> nn.Module:
    """The chunk program to run for recompute ``mode`` ('none', 'chunk' or 'layer')."""
    if mode == "none":
        return gm
    if mode == "chunk":
        return Checkpointed(gm, "chunk")
    if mode == "layer":
        if layers.count == 0:
            raise RecomputeError(
                f"recompute='layer' checkpoints each repeated layer, and none were found: looked for {LOOKED_FOR}. "
                f"Fix: use recompute='chunk' (one checkpoint per pipeline chunk) or recompute='none'")
        return checkpoint_layers(gm, layers)
    raise RecomputeError(f"unknown recompute mode {mode!r}")
