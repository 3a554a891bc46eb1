"""The distributed optimizer's parameter all-gathers, in flight until a forward reads their parameters.

After ``DistributedOptimizer.step()`` each replica holds the updated entries of
its own 1/d range of every flat bucket; the parameters get the other
replicas' ranges by one all-gather per bucket (over the bucket's ``axis``:
all of dp, 'dp_cp' with context parallelism, or for stacked expert weights the d/ep
replicas of those experts). ``ParamGathers.launch`` starts
them all asynchronously and returns at once, so they overlap whatever comes
next: the data loader, the next step's first forwards. A bucket is waited for
(and copied into its parameters) only when something is about to read one of
its parameters:

- the engine's ``F`` action of a chunk, through ``wait_for`` with the
  chunk's parameter names: the first forward of each chunk in the next step
  waits for exactly the buckets it reads, later ones find nothing pending;
- anything else that reads the parameters (``full_state_dict``, a save or
  load, ``eval_step``, ``named_local_parameters``/``parameters()``, the next
  ``step()``) through ``wait_all``.

Until a bucket is waited for, its parameters must not be read: with fp32
parameters the all-gather writes straight into their storage (``FlatBucket.flat``),
and this replica's own range already holds the new values.
``waits`` records where each wait happened since the last launch, which the
tests read to check that waits happen at the first forward of each chunk.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch

from autopar.runtime.optim.flat_buffers import FlatBucket, gather_owned

__all__ = ["ParamGathers"]


class ParamGathers:
    """The all-gathers of one optimizer's buckets into the parameters, started together, waited per bucket."""

    def __init__(self, buckets: list[FlatBucket], params: dict[str, torch.Tensor], groups: dict,
                 on_written: Callable[[list[str]], None]) -> None:
        self.buckets = buckets
        self.params = params
        """Original name -> this rank's shard (an engine parameter)."""
        self.groups = groups
        """The mesh's process groups by axis: each bucket is gathered over ``groups[bucket.axis]``
        (data parallelism, or the replicas of the same experts; None with one replica)."""
        self.on_written = on_written
        """Told the names of the parameters a wait has just written (the optimizer's version check)."""
        self.pending: dict[int, tuple[torch.Tensor, Any, torch.Tensor]] = {}
        """Bucket index -> (the gathered flat vector being filled, its work (None for one replica), the
        range sent: kept alive until the work is done)."""
        self.waits: list[tuple[str, tuple[int, ...]]] = []
        """Since the last launch: (what was about to read the parameters, the bucket indices waited for)."""
        self._bucket_of = {slot.name: i for i, b in enumerate(buckets) for slot in b.slots}

    def launch(self) -> None:
        """Start every bucket's all-gather of the replicas' updated ranges (in the parameters' dtype)."""
        self.wait_all("launch")
        self.waits = []
        for i, bucket in enumerate(self.buckets):
            if bucket.masters_shared:  # into the parameters' own storage, from a copy of the range in it
                shard = bucket.master.clone() if bucket.dp > 1 else bucket.master
                full, work = gather_owned(bucket, shard, self.groups.get(bucket.axis), async_op=True,
                                          out=bucket.flat)
            else:
                shard = bucket.master.to(bucket.param_dtype)
                full, work = gather_owned(bucket, shard, self.groups.get(bucket.axis), async_op=True)
            self.pending[i] = (full, work, shard)

    def wait_for(self, names: Iterable[str], where: str) -> None:
        """Finish the buckets holding any of parameters ``names`` before ``where`` reads them."""
        if not self.pending:
            return
        wanted = sorted({self._bucket_of[n] for n in names if n in self._bucket_of} & self.pending.keys())
        self._finish(wanted, where)

    def wait_all(self, where: str) -> None:
        """Finish every bucket still in flight before ``where`` reads the parameters."""
        if self.pending:
            self._finish(sorted(self.pending), where)

    def _finish(self, indices: list[int], where: str) -> None:
        if not indices:
            return
        written = []
        for i in indices:
            full, work, _ = self.pending.pop(i)
            if work is not None:
                work.wait()
            self.buckets[i].write_params(self.params, full)
            written += self.buckets[i].names
        self.waits.append((where, tuple(indices)))
        self.on_written(written)
