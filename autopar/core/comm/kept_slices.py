"""Kept slices: the consumers of an all-gathered value save this rank's slice, and gather again.

Sequence parallelism's f (``gather_from_sp``) all-gathers the tokens before a
column-parallel region, whose linears save that whole-sequence input for their
backward. Inside ``keeping_gathered_slices`` they save this rank's 1/t slice
instead and the backward all-gathers it again, once for every consumer, as
Megatron does. The module keeps two registries: the gathered values alive now
(by the tensor owning their memory) and the re-gathers made so far, which
``release_regathered`` empties between a split backward's B and W.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Iterator

import torch
from torch.utils.weak import WeakIdKeyDictionary

from autopar.core.comm.group import TPGroup, all_gather_dim

__all__ = ["remember_gathered", "release_regathered", "keeping_gathered_slices"]


class _Regather:
    """One all-gathered value whose consumers kept this rank's slice: gathered again at most once in
    the backward, however many consumers (a layer's q, k and v projections) read it."""

    __slots__ = ("tp", "dim", "segments", "full", "__weakref__")

    def __init__(self, tp: TPGroup, dim: int, segments: tuple[int, ...] | None) -> None:
        self.tp, self.dim, self.segments = tp, dim, segments
        self.full: torch.Tensor | None = None
        _REGATHERS.add(self)

    def whole(self, local: torch.Tensor) -> torch.Tensor:
        if self.full is None:
            self.full = all_gather_dim(local, self.tp, self.dim, self.segments)
        return self.full


class _KeptSlice:
    """What a consumer saves instead of (a view of) a gathered value: the outer hooks' packing of
    this rank's slice, the shared re-gather, and the view's size, strides and offset."""

    __slots__ = ("packed", "regather", "geometry")

    def __init__(self, packed, regather: _Regather, geometry: tuple) -> None:
        self.packed, self.regather, self.geometry = packed, regather, geometry



_GATHERED: WeakIdKeyDictionary = WeakIdKeyDictionary()
"""Memory of a value ``gather_from_sp`` made (its root tensor, while alive) -> (this rank's slice,
its re-gather)."""
_REGATHERS: weakref.WeakSet = weakref.WeakSet()
"""Every live ``_Regather``: ``release_regathered`` drops their whole values."""


def remember_gathered(full: torch.Tensor, local: torch.Tensor, tp: TPGroup, dim: int,
                      segments: tuple[int, ...] | None) -> None:
    """Record that ``full`` was all-gathered along ``dim`` from this rank's slice ``local``: inside
    ``keeping_gathered_slices`` its consumers save ``local`` and gather again in the backward."""
    _GATHERED[_root(full)] = (local.detach(), _Regather(tp, dim, segments))


def release_regathered() -> None:
    """Drop the whole values re-gathered so far: a split backward calls it after B, whose autograd
    nodes unpack every saved tensor (the linears' inputs too, re-gathering them) although only the
    input gradients are wanted; W then gathers again what its weight gradients read, so between B
    and W a microbatch keeps only the 1/t slices, as between F and B."""
    for regather in list(_REGATHERS):
        regather.full = None


def _identity(t):
    return t


def _root(t: torch.Tensor) -> torch.Tensor:
    """The tensor owning ``t``'s memory: ``t`` itself, or the base it is a view of (the gathered
    value may itself be a view of the buffer the all-gather filled)."""
    return t if t._base is None else t._base


@contextlib.contextmanager
def keeping_gathered_slices() -> Iterator[None]:
    """Inside this block, an op that saves for its backward a value ``gather_from_sp`` made (or a
    view of it: the column-parallel linears after sequence parallelism's all-gather) saves this
    rank's 1/t slice instead, and the backward all-gathers it again when it reads it, as Megatron
    does: the whole-sequence input is not kept from the forward to the backward on every rank.

    The hooks compose with those already set (the engine's byte count, a saved-tensor store of a
    split backward): the slice goes through them, so they see and count 1/t of the bytes, and every
    other saved tensor passes through them unchanged. A checkpointed region sets its own hooks and
    keeps only its inputs, so this block does not reach inside it. The re-gather is a collective:
    every rank of the group unpacks in the same order (the same autograd graph on each)."""
    if not torch._C._autograd._saved_tensors_hooks_is_enabled():
        yield
        return
    # private: the pair of hooks set now, to compose with (torch has no public accessor)
    outer = torch._C._autograd._top_saved_tensors_default_hooks(False)
    outer_pack, outer_unpack = outer if outer is not None else (_identity, _identity)

    def pack(t: torch.Tensor):
        source = _GATHERED.get(_root(t))
        if source is None:
            return outer_pack(t)
        local, regather = source
        return _KeptSlice(outer_pack(local), regather, (t.size(), t.stride(), t.storage_offset()))

    def unpack(packed) -> torch.Tensor:
        if isinstance(packed, _KeptSlice):
            return packed.regather.whole(outer_unpack(packed.packed)).as_strided(*packed.geometry)
        return outer_unpack(packed)

    with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
        yield
