"""Gradient synchronisation after (and during) a step: data parallel, tied parameters, clipping.

- Data-parallel averaging in buckets: ``start(names)`` flattens the named
  parameters' gradients into buckets of ``bucket_bytes`` and launches an
  asynchronous all-reduce over the mesh's 'dp_cp' group for each (the d
  replicas, times the c context-parallel ranks of each: they hold the same
  weights and gradients of their own tokens, so they average like replicas;
  the dp group itself when c = 1); the engine calls it as
  soon as the last backward that produces those gradients has run, so the
  reduction overlaps the rest of the backward. ``end_step`` waits and averages.
  Averaging is idempotent on gradients that replicas already agree on, so
  gradients accumulated over several steps stay right.
- Parameters read by chunks on several stages (a tied embedding and LM head):
  this step's gradient is summed across those stages (and averaged over dp).
- ``clip_norm_``: the global 2-norm over every rank, each parameter counted once
  (``global_norm``, which the engine also reads to tell a non-finite step).
- Reduce-scatter mode (``reduce_scatter_into``, set by a distributed optimizer):
  the same buckets, started at the same moments, are reduce-scattered instead
  of all-reduced, each replica receiving the averaged gradient of the range it
  owns into its ``FlatBucket.grad`` (``flat_buffers.py``). The parameters'
  ``.grad`` are then left as this replica's own accumulated gradients (never
  overwritten), so accumulating over several steps stays right: each reduction
  reads the whole accumulation. Clipping then reads and scales the shards.
- Stacked expert weights (expert parallelism) are averaged over the d/ep
  replicas holding the same experts (mesh 'edp') in either mode, in buckets of
  their own; with d = ep nothing is reduced (no other rank holds them).

Every tensor made here lives on the engine's device (``device``, where all the
parameters are): the buckets are built from the gradients, the norm's
accumulator is made there, so no collective runs on a CPU tensor under NCCL.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
import torch.nn as nn

from autopar.core.mesh import Mesh
from autopar.core.tensor_placement import Shard
from autopar.runtime.optim.errors import OptimizerError, StepOrderError
from autopar.runtime.optim.flat_buffers import FlatBucket, gather_owned
from autopar.runtime.optim.sequence_grads import PartialGradSum

if TYPE_CHECKING:
    from autopar.compiler.program import Program

__all__ = ["GradientSync", "bucket_names"]


def bucket_names(names: list[str], params: dict[str, torch.Tensor], bucket_bytes: int) -> list[list[str]]:
    """``names`` cut into buckets in order: a bucket closes once its gradients reach ``bucket_bytes``.

    The one rule both modes use, so a distributed optimizer can lay out its flat buffers as the
    buckets that ``start`` will launch.
    """
    buckets, bucket, size = [], [], 0
    for name in names:
        p = params[name]
        bucket.append(name)
        size += p.numel() * p.element_size()
        if size >= bucket_bytes:
            buckets.append(bucket)
            bucket, size = [], 0
    if bucket:
        buckets.append(bucket)
    return buckets


class GradientSync:
    def __init__(self, program: "Program", mesh: Mesh, params: dict[str, nn.Parameter],
                 bucket_bytes: int = 25 * 2**20, device: torch.device | str = "cpu"):
        self.program = program
        self.mesh = mesh
        self.params = params
        """Original name -> this rank's shard."""
        self.device = torch.device(device)
        """The engine's device; every parameter (and so every gradient) is on it."""
        elsewhere = [n for n, p in params.items() if p.device != self.device]
        if elsewhere:
            raise OptimizerError(f"parameter(s) {elsewhere[:3]} are on {params[elsewhere[0]].device}, "
                                 f"not on the engine's device {self.device}")
        self.bucket_bytes = bucket_bytes
        """Flattened gradient bytes after which a bucket's all-reduce is launched."""
        self._works: list = []
        self.sharded: dict[tuple[str, ...], FlatBucket] | None = None
        """Reduce-scatter mode: each bucket's names -> its flat buffers; None: all-reduce mode."""
        self._tied_before: dict[str, torch.Tensor | None] = {}
        self.stats: dict = {}
        self.tp_partial = PartialGradSum(program, mesh, params)
        """Gradients split by sequence parallelism into partial sums over tp: summed before any reduction."""

    def reduce_scatter_into(self, buckets: list[FlatBucket]) -> None:
        """Switch to reduce-scatter mode: gradients go to these buckets' owned ranges.

        ``buckets`` must be laid out as ``start`` cuts them (``bucket_names`` over each group of
        names the engine starts together); the parameters held by several stages in ``tied`` ones.
        """
        self.sharded = {tuple(b.names): b for b in buckets}

    # ------------------------------------------------------------- a step
    def begin_step(self, stats: dict) -> None:
        """Remember the tied parameters' gradients before this step (only this step's part is summed)."""
        self.stats = stats
        self._works = []
        self._tied_before = {}
        self.tp_partial.begin_step()
        if self.sharded is not None:  # the parameters' .grad are never overwritten: nothing to remember
            return
        for name in self.program.tied_params:
            if name in self.params:
                g = self.params[name].grad
                self._tied_before[name] = None if g is None else g.clone()

    def start(self, names: list[str]) -> None:
        """Launch the averaging all-reduce (or reduce-scatter) of these parameters' gradients, in
        buckets, asynchronously (partial sums over tp summed first)."""
        self.tp_partial.sum(names)
        if not names or (self.mesh.shape.dp_cp == 1 and self.mesh.shape.edp == 1 and self.sharded is None):
            return
        experts = [n for n in names if n in self.program.expert_params]
        if experts:  # each expert's replicas are the ranks holding it (mesh 'edp'), not all of dp
            names = [n for n in names if n not in self.program.expert_params]
            replicas = self.mesh.groups.get("edp")
            for names_in_bucket in bucket_names(experts, self.params, self.bucket_bytes):
                if self.sharded is not None:
                    self._launch_reduce_scatter(self._flat_bucket(names_in_bucket), replicas)
                    continue
                bucket = [self.params[name] for name in names_in_bucket]
                for p in bucket:
                    if p.grad is None:
                        p.grad = torch.zeros_like(p)
                if replicas is not None:
                    self._launch(bucket, replicas, self.mesh.shape.edp)
        if self.mesh.shape.dp_cp == 1 and self.sharded is None:  # whole experts' replicas over tp alone
            return
        group = self.mesh.groups.get("dp_cp")
        for names_in_bucket in bucket_names(names, self.params, self.bucket_bytes):
            if self.sharded is not None:
                self._launch_reduce_scatter(self._flat_bucket(names_in_bucket), group)
                continue
            bucket = [self.params[name] for name in names_in_bucket]
            for p in bucket:
                if p.grad is None:
                    p.grad = torch.zeros_like(p)
            self._launch(bucket, group)

    def _launch(self, params: list[nn.Parameter], group, replicas: int | None = None) -> None:
        """All-reduce one bucket: the gradients flattened into one 1-D tensor (on the device), averaged
        over ``replicas`` (default: d x c, the 'dp_cp' ranks) at the end of the step."""
        flat = torch.cat([p.grad.reshape(-1) for p in params])
        work = dist.all_reduce(flat, group=group, async_op=True)
        self._works.append((work, flat, params, replicas or self.mesh.shape.dp_cp))
        self.stats["dp_buckets"] = self.stats.get("dp_buckets", 0) + 1

    def _flat_bucket(self, names: list[str]) -> FlatBucket:
        """The distributed optimizer's buffers laid out for this gradient bucket."""
        bucket = self.sharded.get(tuple(names))
        if bucket is None:
            raise StepOrderError(f"a gradient bucket of {len(names)} parameter(s) starting at {names[0]} matches none "
                                 f"of the distributed optimizer's flat buffers: bucket_bytes changed after the "
                                 f"optimizer laid them out ({self.bucket_bytes} now); set it before making the "
                                 f"optimizer")
        return bucket

    def _launch_reduce_scatter(self, bucket: FlatBucket, group) -> None:
        """Reduce-scatter one bucket: its local gradients, flat and padded, summed over the replicas
        (``group``: the bucket's, 'dp_cp' or the expert replicas) into each one's owned range
        (``bucket.grad``); averaged in ``end_step``."""
        flat = bucket.flat_grads(self.params)
        if bucket.tied:
            self._sum_tied_across_stages(bucket, flat)
        if bucket.dp == 1:
            bucket.grad.copy_(flat)
            return
        work = dist.reduce_scatter_single(bucket.grad, flat, group=group, async_op=True)
        self._works.append((work, flat, bucket))
        self.stats["dp_buckets"] = self.stats.get("dp_buckets", 0) + 1

    def _sum_tied_across_stages(self, bucket: FlatBucket, flat: torch.Tensor) -> None:
        """Sum each tied parameter's local gradient (its slice of ``flat``) over the stages holding it."""
        for slot in bucket.slots:
            stages = self.program.tied_params[slot.name]
            dist.all_reduce(flat[slot.offset : slot.offset + slot.numel], group=self.mesh.tied[stages])

    def end_step(self) -> None:
        """Wait for the data-parallel buckets and average; then sum tied parameters across stages."""
        self.tp_partial.sum_rest()
        if self.sharded is not None:
            self._end_sharded_step()
            return
        for work, flat, params, replicas in self._works:
            work.wait()
            flat /= replicas
            offset = 0
            for p in params:
                n = p.grad.numel()
                p.grad.copy_(flat[offset : offset + n].view_as(p.grad))
                offset += n
        self._works = []
        self._sync_tied()

    def _end_sharded_step(self) -> None:
        """Reduce-scatter mode: reduce the tied buckets (their gradients are final only now), wait for
        every bucket and average its owned range."""
        group = self.mesh.groups.get("dp_cp")
        for bucket in self.sharded.values():
            if bucket.tied:
                self._launch_reduce_scatter(bucket, group)
        for work, _, _ in self._works:
            work.wait()
        self._works = []
        for bucket in self.sharded.values():  # d x c, or an expert bucket's d/ep replicas
            bucket.grad /= bucket.dp

    def reduced_grads(self) -> dict[str, torch.Tensor]:
        """Reduce-scatter mode: every parameter's reduced gradient, whole on this rank (its local
        shard's shape and dtype), all-gathered over the replicas from their owned ranges."""
        out = {}
        for bucket in self.sharded.values():
            full = gather_owned(bucket, bucket.grad, self.mesh.groups.get(bucket.axis))
            for slot in bucket.slots:
                p = self.params[slot.name]
                out[slot.name] = full[slot.offset : slot.offset + slot.numel].view(p.shape).to(p.dtype)
        return out

    def _sync_tied(self) -> None:
        for name, stages in self.program.tied_params.items():
            if name not in self.params:
                continue
            p = self.params[name]
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            before = self._tied_before.get(name)
            delta = p.grad - before if before is not None else p.grad.clone()
            dist.all_reduce(delta, group=self.mesh.tied[stages])
            if self.mesh.shape.dp_cp > 1:
                dist.all_reduce(delta, group=self.mesh.groups["dp_cp"])
                delta /= self.mesh.shape.dp_cp
            p.grad.copy_(delta if before is None else before + delta)

    # ------------------------------------------------------------- clipping
    def clip_norm_(self, max_norm: float, tp_rank: int, stage: int) -> float:
        """Clip all gradients by their global 2-norm (``global_norm``); returns the norm before clipping.
        A non-finite norm leaves the gradients as they are (the step's numbers are bad: the engine
        skips its optimizer step)."""
        norm = self.global_norm(tp_rank, stage)
        coef = max_norm / (norm + 1e-6)
        if coef < 1 and math.isfinite(norm):
            for _, grad in self._reduced_pieces():
                grad.mul_(coef)
        return norm

    def global_norm(self, tp_rank: int, stage: int) -> float:
        """The 2-norm of every gradient of the model, the same on every rank (NaN or inf when a
        gradient is not finite anywhere).

        Each parameter counts once: a shard on every tensor-parallel rank (and each expert-parallel
        rank's experts of a stacked expert weight), a
        replicated parameter on tp rank 0, a parameter held by several stages
        on the first of them; data-parallel replicas and the cp ranks of each hold equal gradients
        (in reduce-scatter mode each of the d x c ranks counts and scales the range it owns, and
        the sum runs over 'dp_cp').

        Expert weights: in all-reduce mode every rank holds its experts' whole reduced gradient, so
        their part is summed over the expert group ('ep') only (with whole experts, ``expert_tp=1``,
        each tp rank holds other experts, all counted, and the group's sum is divided by t before the
        sum over tp). In reduce-scatter mode each of the
        d/ep replicas of an expert owns a distinct range of its bucket, and the ep ranks of a group
        hold distinct experts: the sum over all of dp (ep x edp) counts every expert entry once.
        """
        sq = torch.zeros((), dtype=torch.float64, device=self.device)
        experts = torch.zeros((), dtype=torch.float64, device=self.device)
        for name, grad in self._reduced_pieces():
            if self._counts_once(name, tp_rank, stage):
                into = experts if name in self.program.expert_params else sq
                into += grad.detach().double().pow(2).sum()
        if self.sharded is None and self.mesh.groups.get("ep") is not None:  # the other experts: the group's
            dist.all_reduce(experts, group=self.mesh.groups["ep"])
            if self.mesh.shape.rows_split > 1:  # whole experts: every tp rank now holds the same sum, which
                experts /= self.mesh.shape.tp   # the all-reduce over tp below adds t times
        sq += experts
        axes = ("tp", "pp", "dp_cp") if self.sharded is not None else ("tp", "pp")
        for axis in axes:
            if self.mesh.groups.get(axis) is not None:
                dist.all_reduce(sq, group=self.mesh.groups[axis])
        return math.sqrt(float(sq))

    def nonfinite_grads(self) -> tuple[list[str], list[str]]:
        """The parameters whose gradient on this rank holds a NaN or an infinity, in order: (among this
        replica's own gradients, among the reduced ones). In reduce-scatter mode the parameters' ``.grad``
        stay this replica's own (where a bad value came from) and the reduced ones are the owned ranges;
        in all-reduce mode both are the reduced ``.grad``."""
        own = [(n, p.grad) for n, p in self.params.items() if p.grad is not None] if self.sharded is not None else []
        reduced = list(self._reduced_pieces())
        if not own and not reduced:
            return [], []
        finite = torch.stack([torch.isfinite(g).all() for _, g in own + reduced]).tolist()  # one transfer
        own_bad = [name for (name, _), ok in zip(own, finite) if not ok]
        reduced_bad = list(dict.fromkeys(name for (name, _), ok in zip(reduced, finite[len(own):]) if not ok))
        return (own_bad if self.sharded is not None else reduced_bad), reduced_bad

    def _reduced_pieces(self):
        """(parameter name, its reduced gradient on this rank): whole ``.grad`` in all-reduce mode,
        the owned pieces of the buckets' gradient shards in reduce-scatter mode."""
        if self.sharded is None:
            for name, p in self.params.items():
                if p.grad is not None:
                    yield name, p.grad
            return
        for bucket in self.sharded.values():
            for piece in bucket.pieces:
                yield piece.name, bucket.grad[piece.at : piece.at + piece.length]

    def _whole_expert(self, name: str) -> bool:
        """A stacked expert weight left whole by tensor parallelism (``expert_tp=1``): the tp ranks hold
        different experts of it, not copies."""
        return name in self.program.expert_params and self.mesh.shape.rows_split > 1

    def _counts_once(self, name: str, tp_rank: int, stage: int) -> bool:
        """Whether this rank counts parameter ``name`` in the global norm (see ``clip_norm_``)."""
        if not isinstance(self.program.param_spec(name), Shard) and tp_rank != 0 and not self._whole_expert(name):
            return False
        return self.program.param_stages[name][0] == stage
