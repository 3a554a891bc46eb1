"""Fake-tensor results reused across the nodes of a graph that repeat an op on values of the same metadata.

Running a rank graph on fake tensors (``local_shapes.py``) costs a dispatch per
aten op, and a composite op (``linear``, ``scaled_dot_product_attention``) runs
its whole decomposition. In a model of repeated layers nearly every node
repeats one met before: the same op, the same non-tensor arguments, inputs of
the same shapes, strides and dtypes. What a built-in aten op that is no view
returns then depends on that metadata alone, so a repeat's value is rebuilt
from it: a new tensor of the same size, strides and dtype, or a view of a new
one where the op returned a view of a temporary (as ``linear`` does on a 3-D
input).

A result is reused only when rebuilding it gives back what the op returned,
checked when it is first computed: containers, plain values, each tensor's
geometry (and its base's), and which storages the tensors share with the
inputs and with each other. Views (a single dispatch already), ops that mutate
or return data-dependent shapes, ops not built in, and values that carry
constants or symbolic sizes are always run.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.utils._pytree as pytree
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode, unset_fake_temporarily
from torch.multiprocessing.reductions import StorageWeakRef

__all__ = ["FakeOpMemo", "new_fake"]

_BUILT_IN = frozenset({"aten", "prims"})
_SKIPPED_TAGS = frozenset({torch.Tag.data_dependent_output, torch.Tag.dynamic_output_shape, torch.Tag.inplace_view})
_PLAIN = (bool, int, float, complex, str, type(None), torch.dtype, torch.device, torch.layout, torch.memory_format)
_UNKEYED = object()
"""What ``_key`` returns for an argument it cannot describe, and ``recipes`` for a key never met."""


class FakeOpMemo:
    """Per op and argument metadata, how to rebuild the op's result; one per fake run (what it
    rebuilds belongs to that run's mode)."""

    def __init__(self, mode: FakeTensorMode) -> None:
        self.mode = mode
        self.recipes: dict[tuple, tuple | None] = {}
        """Key -> (the output's tree spec, one step per leaf), or None when the result is not rebuilt."""

    def call(self, target: Any, args: tuple, kwargs: dict, run: Callable[[], Any]) -> Any:
        """``run()`` (``target(*args, **kwargs)`` under the fake mode), or its result rebuilt when a call
        with the same key came before."""
        if not _reusable(target):
            return run()
        inputs: list[FakeTensor] = []
        key = _key((target, args, tuple(kwargs.items())), inputs)
        recipe = None if key is _UNKEYED else self.recipes.get(key, _UNKEYED)
        if recipe is None:
            return run()
        if recipe is not _UNKEYED:
            return _rebuild(recipe, self.mode)
        result = run()
        recipe = _recipe(result)
        if recipe is not None and not _same(_rebuild(recipe, self.mode), result, inputs):
            recipe = None
        self.recipes[key] = recipe
        return result


def new_fake(mode: FakeTensorMode, size: tuple[int, ...], dtype: torch.dtype, device: torch.device,
             stride: tuple[int, ...] | None = None) -> FakeTensor:
    """A new fake tensor of ``mode`` on ``device`` (contiguous unless ``stride`` is given; no other
    shares its storage), made as the mode makes its own cached results: a meta tensor of that
    geometry, wrapped. It costs a fifth of a factory call dispatched to the mode."""
    with unset_fake_temporarily():
        meta = (torch.empty(size, dtype=dtype, device="meta") if stride is None
                else torch.empty_strided(size, stride, dtype=dtype, device="meta"))
    return FakeTensor(mode, meta, device)


def _reusable(target: Any) -> bool:
    """A built-in aten op that is no view, mutates nothing, and whose output shapes follow from its
    inputs' (a view is one dispatch already: rebuilding it would cost as much)."""
    return (isinstance(target, torch._ops.OpOverload) and target.namespace in _BUILT_IN and not target.is_view
            and not target._schema.is_mutable and _SKIPPED_TAGS.isdisjoint(target.tags))


def _key(value: Any, inputs: list[FakeTensor]) -> Any:
    """``value`` as a hashable description: a tensor by its metadata (collected in ``inputs``), a
    scalar with its type (``1`` and ``1.0`` promote apart); ``_UNKEYED`` for anything else."""
    if isinstance(value, torch.Tensor):
        if not isinstance(value, FakeTensor) or value.constant is not None or not _static(value.shape):
            return _UNKEYED
        inputs.append(value)
        return _geometry(value)
    if isinstance(value, (tuple, list)):
        items = tuple(_key(v, inputs) for v in value)
        return _UNKEYED if any(i is _UNKEYED for i in items) else (type(value), items)
    if isinstance(value, _PLAIN):
        return type(value), value
    if isinstance(value, torch._ops.OpOverload):
        return value
    return _UNKEYED


def _recipe(result: Any) -> tuple | None:
    """How to make ``result`` again: per leaf, the plain value, or a new tensor (or a view of one) of
    its geometry; None for a leaf that is neither a plain value nor a fake tensor of static geometry."""
    leaves, spec = pytree.tree_flatten(result)
    steps = []
    for leaf in leaves:
        if not isinstance(leaf, torch.Tensor):
            if not isinstance(leaf, _PLAIN):
                return None
            steps.append(("value", leaf))
        elif not isinstance(leaf, FakeTensor) or leaf.constant is not None or not _static(
                (*leaf.shape, *leaf.stride(), leaf.storage_offset())):
            return None
        elif leaf._is_view():
            base = leaf._base
            steps.append(("view", tuple(base.shape), base.stride(), leaf.dtype, leaf.device, tuple(leaf.shape),
                          leaf.stride(), leaf.storage_offset()))
        else:
            steps.append(("new", tuple(leaf.shape), leaf.dtype, leaf.device, leaf.stride()))
    return spec, tuple(steps)


def _rebuild(recipe: tuple, mode: FakeTensorMode) -> Any:
    """The result ``recipe`` describes, made anew under ``mode``."""
    spec, steps = recipe
    leaves = []
    for step in steps:
        if step[0] == "value":
            leaves.append(step[1])
        elif step[0] == "view":
            _, base_size, base_stride, dtype, device, size, stride, offset = step
            leaves.append(new_fake(mode, base_size, dtype, device, base_stride).as_strided(size, stride, offset))
        else:
            _, size, dtype, device, stride = step
            leaves.append(new_fake(mode, size, dtype, device, stride))
    return pytree.tree_unflatten(leaves, spec)


def _same(rebuilt: Any, result: Any, inputs: list[FakeTensor]) -> bool:
    """``rebuilt`` is ``result`` again: the same containers and plain values, tensors of the same
    geometry (and their bases'), sharing storage with the inputs and with each other as
    ``result``'s do (a result that is, or views, an input is never rebuilt)."""
    got, got_spec = pytree.tree_flatten(rebuilt)
    want, want_spec = pytree.tree_flatten(result)
    if got_spec != want_spec or type(rebuilt) is not type(result) or _sharing(got, inputs) != _sharing(want, inputs):
        return False
    for a, b in zip(got, want, strict=True):
        if isinstance(b, torch.Tensor):
            if _meta(a) != _meta(b) or (b._is_view() and _meta(a._base) != _meta(b._base)):
                return False
        elif type(a) is not type(b) or a != b:
            return False
    return True


def _sharing(leaves: list, inputs: list[FakeTensor]) -> list[int]:
    """For each tensor leaf, the first of ``inputs`` and then ``leaves`` whose storage it shares."""
    storages = [StorageWeakRef(t.untyped_storage()) for t in (*inputs, *leaves) if isinstance(t, torch.Tensor)]
    return [storages.index(StorageWeakRef(t.untyped_storage())) for t in leaves if isinstance(t, torch.Tensor)]


def _static(sizes) -> bool:
    return all(type(d) is int for d in sizes)


def _geometry(t: torch.Tensor) -> tuple:
    return (tuple(t.shape), t.stride(), t.storage_offset(), t.dtype, t.device, t.layout, t.requires_grad,
            t.is_conj(), t.is_neg())


def _meta(t: torch.Tensor) -> tuple:
    """What a value of a fake run is, storage identity aside."""
    return (type(t), getattr(t, "fake_mode", None), _geometry(t), t._is_view(), t.untyped_storage().nbytes())
