"""Chunk graphs that create their tensors on the engine's device.

Tracing records the device of every tensor a graph makes from nothing
(``aten.arange`` for position ids, ``aten.full``/``zeros`` for masks,
``aten._to_copy`` for an explicit ``.to(device)``) as a ``device=`` keyword,
or as a positional argument (``aten.to.device(x, device, dtype)``, HF's
rotary embedding's ``inv_freq.to(x.device)``): the device of the example
inputs (the CPU), or the meta device for a model built there. Run on a GPU as
traced, those ops would make CPU tensors that then meet CUDA weights; run
anywhere, meta ones have no data. ``on_device`` rewrites every such device of a chunk's
graphs (the chunk's own and those inside its checkpointed regions) to the
engine's device, on a copy: the program stays as compiled, and a CPU engine of
a CPU-traced program gets the module itself, untouched.
"""

from __future__ import annotations

import copy

import torch
import torch.fx as fx
import torch.nn as nn

__all__ = ["on_device", "foreign_devices"]


def _devices_of(node: fx.Node) -> list[torch.device]:
    """The devices a node names: its ``device=`` keyword and its positional ``torch.device`` arguments."""
    named = node.kwargs.get("device")
    out = [torch.device(named)] if isinstance(named, (torch.device, str)) else []
    return out + [a for a in node.args if isinstance(a, torch.device)]


def _device_nodes(module: nn.Module):
    for gm in module.modules():
        if isinstance(gm, fx.GraphModule):
            for node in gm.graph.nodes:
                if _devices_of(node):
                    yield gm, node


def foreign_devices(module: nn.Module, device: torch.device) -> list[str]:
    """Names of the nodes of ``module``'s graphs that create tensors on a device other than ``device``."""
    return [node.name for _, node in _device_nodes(module) if any(d != device for d in _devices_of(node))]


def on_device(module: nn.Module, device: torch.device) -> nn.Module:
    """``module`` with every device its graphs name set to ``device`` (a copy when any differs)."""
    if not foreign_devices(module, device):
        return module
    module = copy.deepcopy(module)
    changed = set()
    for gm, node in _device_nodes(module):
        if any(d != device for d in _devices_of(node)):
            if "device" in node.kwargs:
                node.kwargs = {**node.kwargs, "device": device}
            node.args = tuple(device if isinstance(a, torch.device) else a for a in node.args)
            changed.add(gm)
    for gm in changed:
        gm.recompile()
    return module
