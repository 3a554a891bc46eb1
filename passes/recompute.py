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

from collections.abc import Callable

import torch
import torch.fx as fx
import torch.nn as nn
from torch.fx.passes.split_module import split_module
from torch.utils.checkpoint import checkpoint

from passes.layers import LayerInfo, layer_of_node

__all__ = ["Checkpointed", "checkpoint_layers", "with_recompute"]


class Checkpointed(nn.Module):
    """Runs ``inner`` under a non-reentrant checkpoint; reports the bytes of the inputs it keeps."""

    def __init__(self, inner: nn.Module, on_keep: Callable[[int], None] | None = None):
        super().__init__()
        self.inner = inner
        self.on_keep = on_keep

    def forward(self, *args):
        if self.on_keep is not None and torch.is_grad_enabled():
            self.on_keep(sum(a.numel() * a.element_size() for a in args
                             if isinstance(a, torch.Tensor) and not isinstance(a, nn.Parameter)))
        return checkpoint(self.inner, *args, use_reentrant=False)


def checkpoint_layers(gm: fx.GraphModule, layers: LayerInfo,
                      on_keep: Callable[[int], None] | None = None) -> fx.GraphModule:
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
    layer_parts = {2 * k + 1 for k in order.values()}
    split = split_module(gm, gm, lambda n: parts[n.name], keep_original_order=True)
    for name, sub in list(split.named_children()):
        idx = int(name.rsplit("_", 1)[-1])
        if idx in layer_parts:
            setattr(split, name, Checkpointed(sub, on_keep))
    return split


def with_recompute(gm: fx.GraphModule, mode: str, layers: LayerInfo,
                   on_keep: Callable[[int], None] | None = None) -> nn.Module:
    """The chunk program to run for recompute ``mode`` ('none', 'chunk' or 'layer')."""
    if mode == "none":
        return gm
    if mode == "chunk":
        return Checkpointed(gm, on_keep)
    if mode == "layer":
        return checkpoint_layers(gm, layers, on_keep)
    raise ValueError(f"unknown recompute mode {mode!r}")
