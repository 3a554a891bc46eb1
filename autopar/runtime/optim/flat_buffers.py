"""The flat buffers of a sharded optimizer: buckets of parameters laid end to end, each replica owning 1/d.

A bucket is a run of this rank's parameters (the same names, in the same
order, as a gradient bucket of ``GradientSync``) laid end to end in one flat
vector, padded at its end to a multiple of the d data-parallel replicas.
Replica r owns the contiguous range ``[r * s, (r + 1) * s)`` of it
(``s = padded / d``), as in Megatron-LM's distributed optimizer. A bucket of
stacked expert weights (expert parallelism) is shared by the d/ep replicas
holding the same experts only (``axis`` 'edp'), each owning 1/(d/ep) of it;
with d = ep each rank owns its experts' bucket whole. For that range this
replica keeps:

- ``master``: the master copy of the parameters' entries it owns (fp32, or
  wider when a parameter is), which the inner optimizer updates. When the
  parameters are already fp32, the bucket holds the parameters themselves
  (``flat``: each parameter's ``.data`` becomes a view of it), so the owned
  range of ``flat`` *is* the master, without a second copy, and the all-gather
  writes straight into the parameters;
- ``grad``: the reduced (data-parallel averaged) gradient of those entries,
  written by the gradient reduce-scatter.

With 16-bit parameters (a model in bf16) the master copies stay fp32: the
optimizer accumulates its small updates there, and only the all-gather back
into the parameters rounds them, each replica's range cast to the parameters'
dtype before it is sent (``param_dtype``: half the bytes on the wire, the same
values as rounding after the gather).

A ``Piece`` is where one parameter meets the owned range: a parameter may be
split between two replicas, or not touch this replica's range at all. The
pieces are what the inner ``torch.optim`` optimizer sees, one tensor per
(parameter, replica), views of ``master`` with views of ``grad`` as their
``.grad``.

Every buffer is made on the device of the parameters (the engine's).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import torch.distributed as dist

__all__ = ["Slot", "Piece", "FlatBucket", "master_dtype", "gather_owned"]


@dataclass(frozen=True)
class Slot:
    """One parameter in a bucket: its entries are ``[offset, offset + numel)`` of the flat vector."""

    name: str
    offset: int
    numel: int


@dataclass(frozen=True)
class Piece:
    """The part of parameter ``name`` this replica owns: its flat entries ``[start, start + length)``,
    at ``[at, at + length)`` of the bucket's shard."""

    name: str
    start: int
    length: int
    at: int


def master_dtype(dtypes) -> torch.dtype:
    """The master copies' dtype: fp32, or a wider floating dtype when a parameter has one."""
    return functools.reduce(torch.promote_types, dtypes, torch.float32)


class FlatBucket:
    """One bucket: its slots, its padded size, this replica's owned range and buffers."""

    def __init__(self, params: dict[str, torch.Tensor], names: list[str], dp: int, dp_rank: int,
                 tied: bool = False, share_params: bool = False, axis: str = "dp"):
        offsets, total = [], 0
        for name in names:
            offsets.append(Slot(name, total, params[name].numel()))
            total += params[name].numel()
        self.slots: tuple[Slot, ...] = tuple(offsets)
        self.tied = tied
        """Parameters held by several stages: summed over their stages before the reduce-scatter."""
        self.numel = total
        self.padded = -(-total // dp) * dp
        """``numel`` rounded up to a multiple of d: every replica's range has the same length."""
        self.dp, self.dp_rank = dp, dp_rank
        """The replicas sharing this bucket and this one's place among them: all of data parallelism
        (times the cp ranks of each, with context parallelism), or for expert weights the d/ep
        replicas holding the same experts."""
        self.axis = axis
        """The mesh group the bucket is reduce-scattered and all-gathered over: 'dp', 'dp_cp' with
        context parallelism (the d x c ranks averaging gradients), or 'edp' for stacked expert weights
        (None in the mesh when each rank is alone with its experts)."""
        self.shard_numel = self.padded // dp
        self.owned = (dp_rank * self.shard_numel, (dp_rank + 1) * self.shard_numel)
        """This replica's range of the flat vector."""
        self.pieces: tuple[Piece, ...] = tuple(self._owned_pieces())
        device = params[names[0]].device
        self.dtype = master_dtype(params[n].dtype for n in names)
        dtypes = {params[n].dtype for n in names}
        self.param_dtype = dtypes.pop() if len(dtypes) == 1 else self.dtype
        """What the owned ranges are all-gathered in: the parameters' one dtype (else the masters')."""
        self.flat: torch.Tensor | None = None
        """With ``share_params`` and parameters already in the masters' dtype (fp32): the parameters'
        own storage, laid end to end (each parameter's ``.data`` a view of it); None otherwise."""
        if share_params and all(params[n].dtype == self.dtype for n in names):
            self.flat = torch.zeros(self.padded, dtype=self.dtype, device=device)
            self._move_params_into_flat(params)
            self.master = self.flat[self.owned[0] : self.owned[1]]
        else:
            self.master = torch.zeros(self.shard_numel, dtype=self.dtype, device=device)
        self.grad = torch.zeros(self.shard_numel, dtype=self.dtype, device=device)
        self.load_master(params, [p.name for p in self.pieces])

    def _move_params_into_flat(self, params: dict[str, torch.Tensor]) -> None:
        """Copy the parameters into ``flat`` and make each one's ``.data`` its view there: the owned
        range of the parameters is then the master copy itself, not a second fp32 copy of it."""
        with torch.no_grad():
            for slot in self.slots:
                p = params[slot.name]
                view = self.flat[slot.offset : slot.offset + slot.numel].view(p.shape)
                view.copy_(p)
                p.data = view

    @property
    def masters_shared(self) -> bool:
        """Whether the master range is the parameters' own storage (no copy to keep or save)."""
        return self.flat is not None

    def _owned_pieces(self):
        lo, hi = self.owned
        for slot in self.slots:
            start, end = max(lo, slot.offset), min(hi, slot.offset + slot.numel)
            if start < end:
                yield Piece(slot.name, start - slot.offset, end - start, start - lo)

    @property
    def names(self) -> list[str]:
        return [s.name for s in self.slots]

    def signature(self) -> list:
        """What must match for a saved shard to be this one: its replicas, this replica, every slot."""
        return [self.dp, self.dp_rank, [[s.name, s.numel] for s in self.slots]] + (
            [self.axis] if self.axis != "dp" else [])

    def load_master(self, params: dict[str, torch.Tensor], names: list[str]) -> None:
        """Copy the owned entries of parameters ``names`` into the master shard (nothing to copy when
        the masters are the parameters' own storage)."""
        if self.flat is not None:
            return
        wanted = set(names)
        with torch.no_grad():
            for piece in self.pieces:
                if piece.name in wanted:
                    entries = params[piece.name].detach().reshape(-1)[piece.start : piece.start + piece.length]
                    self.master[piece.at : piece.at + piece.length].copy_(entries)

    def flat_grads(self, params: dict[str, torch.Tensor]) -> torch.Tensor:
        """The whole bucket's local gradients as one padded flat vector of the master dtype (zeros
        for a parameter without a gradient and for the padding)."""
        flat = torch.zeros(self.padded, dtype=self.dtype, device=self.master.device)
        for slot in self.slots:
            g = params[slot.name].grad
            if g is not None:
                flat[slot.offset : slot.offset + slot.numel].copy_(g.reshape(-1))
        return flat

    def write_params(self, params: dict[str, torch.Tensor], full: torch.Tensor) -> None:
        """Copy the gathered flat vector ``full`` (every replica's range) into the parameters
        (rounded to their dtype when ``full`` is wider); nothing to copy when ``full`` is their storage."""
        if full is self.flat:
            return
        with torch.no_grad():
            for slot in self.slots:
                p = params[slot.name]
                p.copy_(full[slot.offset : slot.offset + slot.numel].view(p.shape))


def gather_owned(bucket: FlatBucket, shard: torch.Tensor, group, async_op: bool = False,
                 out: torch.Tensor | None = None):
    """The whole flat vector of ``bucket`` from every replica's owned range (``shard`` is this
    replica's, gathered in its own dtype) into ``out`` (else a new tensor): ``full``, or
    ``(full, work)`` with ``async_op``. One replica: the shard itself (or ``out``, holding it)."""
    if bucket.dp == 1:
        full = shard if out is None else out
        return (full, None) if async_op else full
    full = out if out is not None else torch.empty(bucket.padded, dtype=shard.dtype, device=shard.device)
    work = dist.all_gather_single(full, shard, group=group, async_op=async_op)
    return (full, work) if async_op else full
