"""One rank's shapes of every value of the tensor-parallel rank graph.

The traced graph's ``meta["val"]`` holds global shapes; the rank graph's
values are one rank's slices. ``propagate_local_shapes`` runs the rank graph
on fake tensors (no memory, no communication: an inspection ``TPGroup``
only gives collectives their output shapes) and returns every node's local
value; ``annotate_local_shapes`` stores them as ``meta["local_val"]``, which
the pipeline cut (boundary buffers, chunk costs) and the plan read.
``meta["val"]`` is never overwritten.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.fx as fx
from torch._subclasses.fake_tensor import FakeTensorMode

from autopar.compiler.fake_op_memo import FakeOpMemo, new_fake
from autopar.core.comm import TPGroup
from autopar.core.tensor_placement import Replicate, Shard, local_size

__all__ = ["propagate_local_shapes", "annotate_local_shapes", "param_local_shape"]


def param_local_shape(full_shape: tuple[int, ...], spec: Replicate | Shard, tp: int) -> tuple[int, ...]:
    """A parameter's shape on one tensor-parallel rank: its sharded dim cut t ways (padding included)."""
    shape = list(full_shape)
    if isinstance(spec, Shard):
        shape[spec.dim] = local_size(shape[spec.dim], spec, tp)
    return tuple(shape)


class _FakeRun(fx.Interpreter):
    """Runs a graph under a fake mode and records each node's value, leaving the graph untouched; an
    aten op repeated on inputs of the same metadata (the next layer's) has its value rebuilt
    (``fake_op_memo.py``) instead of dispatched again."""

    def __init__(self, gm: fx.GraphModule, mode: FakeTensorMode):
        super().__init__(gm)
        self.mode = mode
        self.values: dict[str, Any] = {}
        self.memo = FakeOpMemo(mode)

    def run_node(self, n: fx.Node) -> Any:
        with self.mode:
            result = super().run_node(n)
        self.values[n.name] = result
        return result

    def call_function(self, target: Any, args: tuple, kwargs: dict) -> Any:
        return self.memo.call(target, args, kwargs, lambda: super(_FakeRun, self).call_function(target, args, kwargs))


def propagate_local_shapes(rank_gm: fx.GraphModule, tp_rank: int, tp: int, param_of: dict[str, str],
                           local_shape: Callable[[str], tuple[int, ...]],
                           inputs: dict[str, tuple[int, ...]] | None = None) -> dict[str, Any]:
    """Every node's value on tensor-parallel rank ``tp_rank`` (fake tensors), by node name.

    ``param_of``: placeholder -> parameter name; ``local_shape(name)`` gives a
    parameter's local shape. Other placeholders (inputs, buffers) are whole, but for those in
    ``inputs`` (placeholder -> its shape on one rank: a batch tensor split along its sequence by
    context parallelism).
    """
    inputs = inputs or {}
    mode = FakeTensorMode(allow_non_fake_inputs=True)
    args: list[Any] = [TPGroup(tp_rank, tp, None)]
    for node in list(rank_gm.graph.nodes)[1:]:
        if node.op != "placeholder":
            break
        val = node.meta["val"]
        shape = local_shape(param_of[node.name]) if node.name in param_of else inputs.get(node.name, tuple(val.shape))
        args.append(new_fake(mode, shape, val.dtype, torch.device("meta" if val.device.type == "meta" else "cpu")))
    run = _FakeRun(rank_gm, mode)
    run.run(*args)
    return run.values


def annotate_local_shapes(rank_gm: fx.GraphModule, tp: int, param_of: dict[str, str],
                          local_shape: Callable[[str], tuple[int, ...]],
                          inputs: dict[str, tuple[int, ...]] | None = None) -> fx.GraphModule:
    """Store rank 0's local value of every node as ``meta["local_val"]`` (shapes equal on every rank)."""
    values = propagate_local_shapes(rank_gm, 0, tp, param_of, local_shape, inputs)
    for node in rank_gm.graph.nodes:
        if node.name in values:
            node.meta["local_val"] = values[node.name]
    return rank_gm
