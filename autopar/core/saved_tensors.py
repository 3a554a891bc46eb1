"""``SavedTensorStore``: the tensors autograd saves during a forward, in slots a caller can release.

A backward split in two (input gradients first, weight gradients later; see
``autopar/runtime/optim/split_backward.py``) runs its first half with the graph
retained, so autograd frees nothing by itself; yet most of what the forward
saved is needed by that first half only. Recording the forward into a store
puts every saved tensor in a ``Slot``: an unpack may empty its slot (the store's
``release`` decides, per autograd node), and what is left is exactly what the
second half still reads.

Checkpointed regions (``core/activation_recompute.py``) run inside a recording through
``store.checkpoint``: their saved tensors get empty slots, the region keeps
only its inputs, and the first unpack of any of its slots replays the region
once (same random stream, same autocast state) and fills every slot still
alive. A slot is not consumed by being read, so the weight-gradient half reads
what the input-gradient half's replay made, and the region is never replayed
twice (``torch.utils.checkpoint`` replays per backward call, and refuses a
tensor read by two calls).
"""

from __future__ import annotations

import contextlib
import contextvars
import weakref
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.nn as nn

from autopar.core.errors import AutoparError

__all__ = ["Slot", "SavedTensorStore", "recording_store", "ReplayError"]


class ReplayError(AutoparError, RuntimeError):
    """A checkpointed region's replay went wrong: asked twice, saving other tensors than its forward,
    or a slot read after it was released."""

_STORE: contextvars.ContextVar["SavedTensorStore | None"] = contextvars.ContextVar("autopar_saved_store",
                                                                                  default=None)


def recording_store() -> "SavedTensorStore | None":
    """The store the current forward records into (None outside ``store.recording()``)."""
    return _STORE.get()


class Slot:
    """One saved tensor; ``tensor`` is None once released (or, in a region, until its replay)."""

    __slots__ = ("tensor", "region", "__weakref__")

    def __init__(self, tensor: torch.Tensor | None, region: "_Region | None" = None) -> None:
        self.tensor = tensor
        self.region = region


class _Region:
    """One checkpointed call: its function, its inputs and the states its replay restores."""

    def __init__(self, fn: Callable, args: tuple) -> None:
        self.fn = fn
        self.args: tuple | None = args
        self.slots: list[weakref.ref] = []
        self.rng_devices = sorted({a.device.index for a in args
                                   if isinstance(a, torch.Tensor) and a.device.type == "cuda"})
        self.rng_states = [torch.get_rng_state()] + [torch.cuda.get_rng_state(d) for d in self.rng_devices]
        self.autocast = {dev: (torch.is_autocast_enabled(dev), torch.get_autocast_dtype(dev))
                         for dev in ("cpu", "cuda") if torch.amp.is_autocast_available(dev)}

    def pack(self, t: torch.Tensor) -> Slot:
        slot = Slot(None, self)
        self.slots.append(weakref.ref(slot))
        return slot

    def replay(self) -> None:
        """Run the region again and fill its live slots; its inputs are dropped after (no second replay)."""
        if self.args is None:
            raise ReplayError("a checkpointed region was asked to replay twice: its inputs were released "
                               "after the first replay")
        args = tuple(a.detach().requires_grad_(a.requires_grad) if isinstance(a, torch.Tensor) else a
                     for a in self.args)
        made: list[torch.Tensor] = []
        with torch.random.fork_rng(devices=self.rng_devices), contextlib.ExitStack() as stack:
            torch.set_rng_state(self.rng_states[0])
            for d, state in zip(self.rng_devices, self.rng_states[1:]):
                torch.cuda.set_rng_state(state, d)
            for dev, (enabled, dtype) in self.autocast.items():
                stack.enter_context(torch.autocast(dev, dtype=dtype, enabled=enabled))
            stack.enter_context(torch.enable_grad())
            stack.enter_context(torch.autograd.graph.saved_tensors_hooks(lambda t: made.append(t), _never))
            self.fn(*args)
        if len(made) != len(self.slots):
            raise ReplayError(f"a checkpointed region saved {len(made)} tensors when replayed but "
                               f"{len(self.slots)} in its forward: the region is not deterministic in what it saves")
        for ref, t in zip(self.slots, made):
            slot = ref()
            if slot is not None:
                slot.tensor = t
        self.args = None


def _never(_: Any) -> torch.Tensor:
    raise ReplayError("a replay's own autograd graph is never run backward")


class SavedTensorStore:
    """Saved tensors of one forward, in slots; ``release(slot)`` after each unpack decides whether
    the slot is emptied (default: never, as plain autograd with the graph retained).

    ``param_ptrs``: storage addresses of parameters; they are weights, not activations, and the
    byte counts leave them out.
    """

    def __init__(self, param_ptrs: set[int] | frozenset[int] = frozenset()) -> None:
        self.param_ptrs = set(param_ptrs)
        self.release: Callable[[Slot], bool] = lambda slot: False
        self.slots: list[weakref.ref] = []
        self.regions: list[weakref.ref] = []
        self.recorded = False

    @contextlib.contextmanager
    def recording(self) -> Iterator["SavedTensorStore"]:
        """Record the forward run inside this block (checkpointed regions through ``checkpoint``)."""
        token = _STORE.set(self)
        try:
            with torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack):
                yield self
        finally:
            _STORE.reset(token)
            self.recorded = True

    def checkpoint(self, fn: Callable, *args) -> Any:
        """``fn(*args)`` as a checkpointed region of this store: only ``args`` are kept until the backward."""
        region = _Region(fn, args)
        self.regions.append(weakref.ref(region))
        with torch.autograd.graph.saved_tensors_hooks(lambda t: self._track(region.pack(t)), self._unpack):
            return fn(*args)

    def _pack(self, t: torch.Tensor) -> Slot:
        return self._track(Slot(t))

    def _track(self, slot: Slot) -> Slot:
        self.slots.append(weakref.ref(slot))
        return slot

    def _unpack(self, slot: Slot) -> torch.Tensor:
        if slot.tensor is None and slot.region is not None and slot.region.args is not None:
            slot.region.replay()
        t = slot.tensor
        if t is None:
            node = torch._C._current_autograd_node()
            raise ReplayError(f"a saved tensor was read after its slot was released, by "
                               f"{node.name() if node is not None else 'no autograd node'}: the backward that "
                               f"reads it was not expected to run (a weight-gradient pass run twice, or a node "
                               f"the input-gradient pass ran and released run again)")
        if self.release(slot):
            slot.tensor = None
        return t

    def replay_pending(self) -> None:
        """Replay now every checkpointed region that still has slots alive and was not replayed yet."""
        for ref in self.regions:
            region = ref()
            if region is not None and region.args is not None and any(s() is not None for s in region.slots):
                region.replay()

    def held_bytes(self) -> int:
        """Bytes of activations the store still holds: live slots' tensors and checkpointed regions'
        kept inputs, each storage counted once, parameters left out."""
        seen: dict[int, int] = {}
        tensors = [ref().tensor for ref in self.slots if ref() is not None and ref().tensor is not None]
        for ref in self.regions:
            region = ref()
            if region is not None and region.args is not None:
                tensors += [a for a in region.args if isinstance(a, torch.Tensor) and not isinstance(a, nn.Parameter)]
        for t in tensors:
            storage = t.untyped_storage()
            if storage.data_ptr() not in self.param_ptrs:
                seen[storage.data_ptr()] = storage.nbytes()
        return sum(seen.values())
