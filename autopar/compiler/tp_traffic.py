"""What one rank moves over its tensor-parallel group per step: the figure the summary prints.

A rank runs its own pipeline stage's chunks, not the whole model, so only
those count:

- each collective of its chunks, once per microbatch;
- the forward part again where a checkpointed region is recomputed in the
  backward. Recomputation (``torch.utils.checkpoint``, non-reentrant, early
  stop) replays a region only up to the op that saves its last tensor for the
  backward: a layer's closing all-reduce and residual add, which save nothing,
  are not replayed. Which op that is comes from running the region once on
  fake tensors with saved-tensor hooks (no memory, no communication);
- the all-gather of every boundary value that arrives as 1/t slices
  (scatter/gather): an activation into a chunk, a gradient back into the
  chunk before it.

Bytes count each buffer once, as the collective registry does. A real run
moves exactly these (``tests/compiler/test_user_errors.py`` counts them on 4 ranks).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.fx as fx
from torch._subclasses.fake_tensor import FakeTensorMode

from autopar.core.activation_recompute import Checkpointed
from autopar.core.collectives import Collective, collective_of
from autopar.core.comm import TPGroup
from passes.layers import layer_of_node

__all__ = ["tp_traffic"]

Traffic = dict[tuple[str, str], tuple[int, int]]
"""(where, what) -> (calls per microbatch, bytes per step)."""


def tp_traffic(program: Any, stage: int) -> Traffic:
    """What one rank of pipeline stage ``stage`` of ``program`` moves over its tensor-parallel group
    per step, by (where, what): 'layers' / 'outside layers' (its chunks' collectives), 'replayed by
    recompute', 'boundary' (the all-gathers of arriving slices). Empty when tp = 1."""
    out: Traffic = {}

    def add(key: tuple[str, str], nbytes: int) -> None:
        calls, total = out.get(key, (0, 0))
        out[key] = (calls + 1, total + nbytes * program.microbatches)

    if program.tp == 1:
        return out
    for chunk in program.chunks_of_stage(stage):
        for node, spec in _collectives(chunk.gm):
            where = "layers" if layer_of_node(node, program.layers) is not None else "outside layers"
            add((where, spec.name), spec.nbytes(node))
        needs_grad = _needs_grad(chunk, program.traced.param_of)
        for region in chunk.module.modules():
            if isinstance(region, Checkpointed) and isinstance(region.inner, fx.GraphModule):
                for node, spec in _replayed(region.inner, needs_grad, program.tp):
                    add(("replayed by recompute", spec.name), spec.forward_bytes(node))
    for key, nbytes in _boundary_gathers(program, stage):
        add(key, nbytes)
    return out


def _collectives(gm: fx.GraphModule) -> list[tuple[fx.Node, Collective]]:
    """(node, registered collective) of every collective call in ``gm``, in graph order."""
    found = ((n, collective_of(n.target)) for n in gm.graph.nodes if n.op == "call_function")
    return [(n, spec) for n, spec in found if spec is not None]


def _replayed(region: fx.GraphModule, needs_grad: set[str], tp: int) -> list[tuple[fx.Node, Collective]]:
    """The collectives a recomputation of ``region`` runs again in its forward: those up to the
    op that saves the region's last tensor for the backward."""
    last = _last_saving_node(region, needs_grad, tp)
    order = {n: i for i, n in enumerate(region.graph.nodes)}
    return [(n, spec) for n, spec in _collectives(region)
            if spec.forward_bytes(n) and (last is None or order[n] <= order[last])]


class _SaveTracker(fx.Interpreter):
    """Runs a graph on fake tensors and remembers the last node during which autograd saved a tensor."""

    def __init__(self, gm: fx.GraphModule, mode: FakeTensorMode):
        super().__init__(gm)
        self.mode = mode
        self.current: fx.Node | None = None
        self.last_saving: fx.Node | None = None

    def run_node(self, n: fx.Node) -> Any:
        self.current = n
        with self.mode:
            return super().run_node(n)

    def pack(self, tensor: torch.Tensor) -> torch.Tensor:
        self.last_saving = self.current
        return tensor


def _last_saving_node(region: fx.GraphModule, needs_grad: set[str], tp: int) -> fx.Node | None:
    """The node of ``region`` whose op saves the last tensor for the backward, found by running the
    region on fake tensors of its inputs' local shapes (no memory, no communication); None (all of
    it replays) if it cannot run."""
    mode = FakeTensorMode(allow_non_fake_inputs=True)
    args = []
    for node in region.graph.nodes:
        if node.op != "placeholder":
            continue
        val = node.meta.get("local_val")
        if isinstance(val, torch.Tensor):
            grad = node.name in needs_grad and val.dtype.is_floating_point
            with mode:
                args.append(torch.empty(val.shape, dtype=val.dtype, device=val.device, requires_grad=grad))
        else:
            args.append(TPGroup(0, tp, None))  # an inspection group: shapes only, no communication
    tracker = _SaveTracker(region, mode)
    try:
        with torch.enable_grad(), torch.autograd.graph.saved_tensors_hooks(tracker.pack, lambda t: t):
            tracker.run(*args)
    except Exception:  # noqa: BLE001 - an op fake tensors cannot run: count its whole forward replayed
        return None
    return tracker.last_saving


def _needs_grad(chunk, param_of: dict[str, str]) -> set[str]:
    """Names of the chunk's values that require grad: its parameters, the boundary values it receives
    that carry a gradient, and every float value computed from one of them."""
    needs = set(param_of) | {b.name for b in chunk.inputs if b.requires_grad}
    for node in chunk.gm.graph.nodes:
        if node.op == "call_function" and any(a.name in needs for a in node.all_input_nodes):
            needs.add(node.name)
    return needs


def _boundary_gathers(program: Any, stage: int) -> list[tuple[tuple[str, str], int]]:
    """The all-gathers a rank of ``stage`` runs on boundary values that arrive as 1/t slices."""
    out = []
    for chunk in program.split.chunks[1:]:
        before, after = program.stage_of_chunk(chunk.index - 1), program.stage_of_chunk(chunk.index)
        for b in chunk.inputs if before != after else ():
            if not program.sent_sliced(b):
                continue
            if after == stage:
                out.append((("boundary", "all-gather (activation in)"), b.nbytes))
            if b.requires_grad and before == stage:
                out.append((("boundary", "all-gather (gradient in)"), b.nbytes))
    return out
