"""transformers' checkpoint conversion mapping, applied without reading: names mapped, fused tensors sliced.

transformers (5.x) renames and fuses checkpoint tensors as it loads them
(``conversion_mapping.get_model_conversion_mapping``: ``WeightRenaming``s,
and ``WeightConverter``s whose operations stack, concatenate, chunk or
transpose tensors; the ``legacy`` renames ``LayerNorm.gamma``/``beta``), and
``save_pretrained`` writes the reverse (``revert_weight_conversion``). So a
checkpoint on the Hub, or one ``save_pretrained`` wrote, may name a parameter
otherwise than the model does: GPT-NeoX's LM head is stored as ``embed_out``,
an old BERT's LayerNorms as ``gamma``/``beta``, a Mixtral's experts as one
tensor per expert where the model holds them stacked.

Here transformers' own mapping code and operations run on ``Lazy`` stand-ins
instead of tensors: each knows its shape and dtype (a meta tensor) and how to
read any region of itself from regions of the stored tensors (its leaves).
Operations that only re-arrange (``cat``, ``stack``, ``chunk``, ``split``,
``transpose``, ``contiguous``) are sliced: a rank's rows of a stacked or
concatenated parameter are read as the needed rows of each stored tensor. Any
other operation is deferred: its shape comes from running it on meta tensors,
and a read evaluates it on its inputs read whole (``Lazy.sliceable`` says
which; the reader logs it per parameter).

``load_view`` gives the model's names -> Lazy over a checkpoint's stored
tensors, as ``from_pretrained`` maps them; ``saved_view`` the names
``save_pretrained`` writes -> Lazy over the model's own tensors.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import torch
import torch.nn as nn

from autopar.runtime.checkpoint.errors import CheckpointError

__all__ = ["Lazy", "Leaf", "Reads", "Region", "full_region", "region_slices", "is_hf_model", "load_view",
           "saved_view"]

Region = tuple[tuple[int, int], ...]
"""``[start, stop)`` along every dim."""


def full_region(shape) -> Region:
    return tuple((0, int(n)) for n in shape)


def region_slices(region: Region) -> tuple[slice, ...]:
    """``region`` as an index of a tensor (or of a safetensors slice)."""
    return tuple(slice(a, b) for a, b in region)


class Reads:
    """How a read reaches the leaves: ``fetch(leaf, region)`` (``region`` None: the whole tensor),
    and the last deferred operation's result (the pieces of one shard, or the targets of one
    fused tensor, re-use it instead of evaluating it again)."""

    def __init__(self, fetch: Callable[[Leaf, Region | None], torch.Tensor]):
        self.fetch = fetch
        self._last: tuple[object, Any] = (None, None)

    def evaluated(self, node: _Deferred):
        if self._last[0] is not node:
            self._last = (None, None)  # the previous result goes before the next is made
            self._last = (node, node.evaluate(self))
        return self._last[1]


class Lazy:
    """A tensor not read yet: its meta tensor (shape, dtype) and how to read a region of it."""

    def __init__(self, meta: torch.Tensor):
        self.meta = meta

    # ------------------------------------------------------------ what ops may ask
    @property
    def shape(self) -> torch.Size:
        return self.meta.shape

    @property
    def dtype(self) -> torch.dtype:
        return self.meta.dtype

    @property
    def ndim(self) -> int:
        return self.meta.dim()

    @property
    def device(self) -> torch.device:
        return self.meta.device

    def dim(self) -> int:
        return self.meta.dim()

    def size(self, dim: int | None = None):
        return self.meta.size() if dim is None else self.meta.size(dim)

    def numel(self) -> int:
        return self.meta.numel()

    def contiguous(self, *args, **kwargs) -> Lazy:
        return self

    def __getitem__(self, index) -> Any:
        return _apply(torch.Tensor.__getitem__, (self, index), {})

    def __getattr__(self, name: str):
        """Any other tensor method: deferred."""
        attr = getattr(torch.Tensor, name, None) if not name.startswith("__") else None
        if attr is None or not callable(attr):
            raise AttributeError(name)
        return lambda *args, **kwargs: _apply(attr, (self, *args), kwargs)

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        return _apply(func, args, kwargs or {})

    # ------------------------------------------------------------ reads
    def children(self) -> list[Lazy]:
        return []

    def leaves(self) -> list[Leaf]:
        """The stored tensors this one reads, in order, each once."""
        out: dict[int, Leaf] = {}
        stack: list[Lazy] = [self]
        while stack:
            node = stack.pop()
            if isinstance(node, Leaf):
                out.setdefault(id(node), node)
            stack.extend(reversed(node.children()))
        return list(out.values())

    def deferred(self) -> list[str]:
        """The names of the operations that cannot be sliced, of this tensor and its inputs."""
        names, stack = [], [self]
        while stack:
            node = stack.pop()
            if isinstance(node, _Deferred):
                names.append(node.name)
            stack.extend(node.children())
        return list(dict.fromkeys(names))

    @property
    def sliceable(self) -> bool:
        return not self.deferred()

    def read(self, region: Region, reads: Reads) -> torch.Tensor:
        raise NotImplementedError

    def whole(self, reads: Reads) -> torch.Tensor:
        return self.read(full_region(self.shape), reads)


class Leaf(Lazy):
    """A stored tensor (a checkpoint's, or a model's) under its name."""

    def __init__(self, key: str, meta: torch.Tensor, info: Any = None):
        super().__init__(meta)
        self.key = key
        self.info = info
        """What its owner needs to read it (a checkpoint's file entry, a model's state source)."""

    @classmethod
    def of_shape(cls, key: str, shape, dtype: torch.dtype, info: Any = None) -> Leaf:
        """The stored tensor ``key`` of ``shape`` and ``dtype`` (its meta tensor made here)."""
        return cls(key, torch.empty(tuple(shape), dtype=dtype, device="meta"), info)

    def read(self, region: Region, reads: Reads) -> torch.Tensor:
        return reads.fetch(self, None if region == full_region(self.shape) else region)

    def __repr__(self) -> str:
        return f"Leaf({self.key!r}, {tuple(self.shape)})"


class _Cat(Lazy):
    def __init__(self, parts: list[Lazy], dim: int, meta: torch.Tensor):
        super().__init__(meta)
        self.parts, self.dim = parts, dim

    def children(self) -> list[Lazy]:
        return list(self.parts)

    def read(self, region: Region, reads: Reads) -> torch.Tensor:
        lo, hi = region[self.dim]
        pieces, at = [], 0
        for part in self.parts:
            n = part.shape[self.dim]
            a, b = max(lo, at), min(hi, at + n)
            if a < b:
                sub = list(region)
                sub[self.dim] = (a - at, b - at)
                pieces.append(part.read(tuple(sub), reads))
            at += n
        return pieces[0] if len(pieces) == 1 else torch.cat(pieces, dim=self.dim)


class _Stack(_Cat):
    """The parts stacked along a new ``dim``: a region of it reads the parts it spans."""

    def read(self, region: Region, reads: Reads) -> torch.Tensor:
        lo, hi = region[self.dim]
        rest = region[:self.dim] + region[self.dim + 1:]
        return torch.stack([self.parts[i].read(rest, reads) for i in range(lo, hi)], dim=self.dim)


class _OneInput(Lazy):
    """A re-arrangement of one tensor, ``base``."""

    def __init__(self, base: Lazy, meta: torch.Tensor):
        super().__init__(meta)
        self.base = base

    def children(self) -> list[Lazy]:
        return [self.base]


class _Narrow(_OneInput):
    def __init__(self, base: Lazy, dim: int, start: int, meta: torch.Tensor):
        super().__init__(base, meta)
        self.dim, self.start = dim, start

    def read(self, region: Region, reads: Reads) -> torch.Tensor:
        sub = list(region)
        a, b = region[self.dim]
        sub[self.dim] = (a + self.start, b + self.start)
        return self.base.read(tuple(sub), reads)


class _Transpose(_OneInput):
    def __init__(self, base: Lazy, d0: int, d1: int, meta: torch.Tensor):
        super().__init__(base, meta)
        self.d0, self.d1 = d0, d1

    def read(self, region: Region, reads: Reads) -> torch.Tensor:
        sub = list(region)
        sub[self.d0], sub[self.d1] = region[self.d1], region[self.d0]
        return self.base.read(tuple(sub), reads).transpose(self.d0, self.d1)


class _Deferred(Lazy):
    """An operation that cannot be sliced: its inputs read whole, then run."""

    def __init__(self, func, args, kwargs, meta):
        super().__init__(meta if isinstance(meta, torch.Tensor) else torch.empty(0, device="meta"))
        self.func, self.args, self.kwargs = func, args, kwargs
        self.name = getattr(func, "__name__", repr(func))

    def children(self) -> list[Lazy]:
        found: list[Lazy] = []
        _map((self.args, self.kwargs), lambda lazy: found.append(lazy) or lazy)
        return found

    def evaluate(self, reads: Reads):
        args, kwargs = _map((self.args, self.kwargs), lambda lazy: lazy.whole(reads))
        return self.func(*args, **kwargs)

    def read(self, region: Region, reads: Reads) -> torch.Tensor:
        return reads.evaluated(self)[region_slices(region)]


class _Pick(Lazy):
    """Item ``i`` of a deferred operation that returns several tensors."""

    def __init__(self, node: _Deferred, i: int, meta: torch.Tensor):
        super().__init__(meta)
        self.node, self.i = node, i

    def children(self) -> list[Lazy]:
        return [self.node]

    def read(self, region: Region, reads: Reads) -> torch.Tensor:
        return reads.evaluated(self.node)[self.i][region_slices(region)]


def _map(tree, fn: Callable[[Lazy], Any]):
    """``tree`` (nested lists, tuples, dicts) with each Lazy replaced by ``fn(lazy)``."""
    if isinstance(tree, Lazy):
        return fn(tree)
    if isinstance(tree, (list, tuple)):
        return type(tree)(_map(x, fn) for x in tree)
    if isinstance(tree, dict):
        return {k: _map(v, fn) for k, v in tree.items()}
    return tree


def _arg(args, kwargs, i: int, name: str, default=None):
    return args[i] if len(args) > i else kwargs.get(name, default)


_CAT = {torch.cat, torch.concat, torch.concatenate}
_CHUNK_SPLIT = {torch.chunk, torch.Tensor.chunk, torch.split, torch.Tensor.split}
_TRANSPOSE = {torch.transpose, torch.Tensor.transpose}


def _apply(func, args: tuple, kwargs: dict):
    """``func`` on Lazy arguments: a sliceable node for a re-arrangement, else a deferred one."""
    metas = _map((args, kwargs), lambda lazy: lazy.meta)
    out = func(*metas[0], **metas[1])  # shapes and the op's own checks, on the meta device
    if func in _CAT or func is torch.stack:
        parts = _arg(args, kwargs, 0, "tensors")
        if all(isinstance(p, Lazy) for p in parts):
            dim = _arg(args, kwargs, 1, "dim", 0) % out.dim()
            return _Cat(list(parts), dim, out) if func in _CAT else _Stack(list(parts), dim, out)
    elif func in _CHUNK_SPLIT and isinstance(args[0], Lazy):
        dim = _arg(args, kwargs, 2, "dim", 0) % args[0].ndim
        pieces, at = [], 0
        for meta in out:
            pieces.append(_Narrow(args[0], dim, at, meta))
            at += meta.shape[dim]
        return tuple(pieces)
    elif func in _TRANSPOSE and isinstance(args[0], Lazy):
        n = args[0].ndim
        d0, d1 = _arg(args, kwargs, 1, "dim0") % n, _arg(args, kwargs, 2, "dim1") % n
        return _Transpose(args[0], d0, d1, out)
    elif func is torch.Tensor.contiguous:
        return args[0]
    if isinstance(out, torch.Tensor):
        return _Deferred(func, args, kwargs, out)
    if isinstance(out, (tuple, list)) and out and all(isinstance(o, torch.Tensor) for o in out):
        node = _Deferred(func, args, kwargs, None)
        return type(out)(_Pick(node, i, o) for i, o in enumerate(out))
    return out  # a size, a flag: what the meta tensors say


# ---------------------------------------------------------------- transformers' mapping
def is_hf_model(model: nn.Module | None) -> bool:
    """A transformers ``PreTrainedModel`` (its conversion mapping applies)."""
    import sys

    transformers = sys.modules.get("transformers")  # a HuggingFace model has imported it
    return transformers is not None and isinstance(model, transformers.PreTrainedModel)


def load_view(model: nn.Module, stored: dict[str, Leaf]) -> tuple[dict[str, Lazy], list[str]]:
    """(model name -> Lazy, the conversions used), as ``from_pretrained`` maps ``stored``
    (checkpoint name -> Leaf): every renaming, then at most one converter per tensor, the base
    model's prefix added or dropped where the model's names need it. A stored tensor the mapping
    sends to no name of the model stays under its own name. Not a HuggingFace model: ``stored``."""
    if not is_hf_model(model):
        return dict(stored), []
    try:
        from transformers.conversion_mapping import get_model_conversion_mapping
        from transformers.core_model_loading import (WeightConverter, WeightRenaming, dot_natural_key,
                                                     rename_source_key)
    except ImportError:  # transformers before 5 has no conversion mapping: stored names are the model's
        return dict(stored), []

    mapping = get_model_conversion_mapping(model)
    renamings = [m for m in mapping if isinstance(m, WeightRenaming)]
    converters = [m for m in mapping if isinstance(m, WeightConverter)]
    by_pattern = {p: c for c in converters for p in c.source_patterns}
    names = model.state_dict(keep_vars=True)
    prefix = model.base_model_prefix
    out: dict[str, Lazy] = {}
    groups: dict[str, tuple[Any, list[tuple[str, str]]]] = {}
    for key in sorted(stored, key=dot_natural_key):
        renamed, pattern = rename_source_key(key, renamings, converters, prefix, names)
        if renamed not in names and key in names:
            renamed, pattern = rename_source_key(key, [], [], prefix, names)
        if renamed not in names:
            out.setdefault(key, stored[key])
        elif pattern is None:
            out.setdefault(renamed, stored[key])
        else:
            groups.setdefault(renamed, (by_pattern[pattern], []))[1].append((pattern, key))
    for first, (template, members) in groups.items():
        converter = copy.deepcopy(template)
        for pattern, key in members:
            converter.add_tensor(first, key, pattern, stored[key])
        try:
            made = converter.convert(first, model=model, config=model.config)
        except Exception as e:
            raise CheckpointError(f"transformers' {type(template).__name__}({template.operations}) could not make "
                                  f"'{first}' from {[key for _, key in members]}: {type(e).__name__}: {e}") from e
        for name, value in made.items():
            out[name] = value[0] if isinstance(value, list) else value
    used = [repr(m) for m in mapping if m.was_used()]
    return out, used


def saved_view(model: nn.Module | None, tensors: dict[str, Leaf]) -> dict[str, Lazy]:
    """Name written -> Lazy over ``tensors`` (the model's state_dict names, tied duplicates and
    ignored keys already left out), as ``save_pretrained`` writes them: transformers'
    ``revert_weight_conversion``, in the order of each written tensor's first source."""
    if not is_hf_model(model):
        return dict(tensors)
    try:
        from transformers.core_model_loading import revert_weight_conversion
    except ImportError:  # transformers before 5: save_pretrained writes the model's own names
        return dict(tensors)

    reverted = revert_weight_conversion(model, dict(tensors))
    out = {name: value[0] if isinstance(value, list) else value for name, value in reverted.items()}
    bad = [name for name, value in out.items() if not isinstance(value, Lazy)]
    if bad:
        raise CheckpointError(f"transformers' conversion for saving made {bad[:3]} from no tensor of the model")
    order = {key: i for i, key in enumerate(tensors)}
    return dict(sorted(out.items(), key=lambda kv: min(order[leaf.key] for leaf in kv[1].leaves())))
