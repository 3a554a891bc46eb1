"""Gradient synchronisation after (and during) a step: data parallel, tied parameters, clipping.

- Data-parallel averaging in buckets: ``start(names)`` flattens the named
  parameters' gradients into buckets of ``bucket_bytes`` and launches an
  asynchronous all-reduce over the dp group for each; the engine calls it as
  soon as the last backward that produces those gradients has run, so the
  reduction overlaps the rest of the backward. ``end_step`` waits and averages.
  Averaging is idempotent on gradients that replicas already agree on, so
  gradients accumulated over several steps stay right.
- Parameters read by chunks on several stages (a tied embedding and LM head):
  this step's gradient is summed across those stages (and averaged over dp).
- ``clip_norm_``: the global 2-norm over every rank, each parameter counted once.

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
from autopar.core.placement import Shard

if TYPE_CHECKING:
    from autopar.compiler.program import Program

__all__ = ["GradientSync"]


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
            raise ValueError(f"parameter(s) {elsewhere[:3]} are on {params[elsewhere[0]].device}, "
                             f"not on the engine's device {self.device}")
        self.bucket_bytes = bucket_bytes
        """Flattened gradient bytes after which a bucket's all-reduce is launched."""
        self._works: list = []
        self._tied_before: dict[str, torch.Tensor | None] = {}
        self.stats: dict = {}

    # ------------------------------------------------------------- a step
    def begin_step(self, stats: dict) -> None:
        """Remember the tied parameters' gradients before this step (only this step's part is summed)."""
        self.stats = stats
        self._works = []
        self._tied_before = {}
        for name in self.program.tied_params:
            if name in self.params:
                g = self.params[name].grad
                self._tied_before[name] = None if g is None else g.clone()

    def start(self, names: list[str]) -> None:
        """Launch the averaging all-reduce of these parameters' gradients, in buckets, asynchronously."""
        if self.mesh.shape.dp == 1 or not names:
            return
        group = self.mesh.groups.get("dp")
        bucket: list[nn.Parameter] = []
        size = 0
        for name in names:
            p = self.params[name]
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            bucket.append(p)
            size += p.grad.numel() * p.grad.element_size()
            if size >= self.bucket_bytes:
                self._launch(bucket, group)
                bucket, size = [], 0
        if bucket:
            self._launch(bucket, group)

    def _launch(self, params: list[nn.Parameter], group) -> None:
        """All-reduce one bucket: the gradients flattened into one 1-D tensor (on the device)."""
        flat = torch.cat([p.grad.reshape(-1) for p in params])
        work = dist.all_reduce(flat, group=group, async_op=True)
        self._works.append((work, flat, params))
        self.stats["dp_buckets"] = self.stats.get("dp_buckets", 0) + 1

    def end_step(self) -> None:
        """Wait for the data-parallel buckets and average; then sum tied parameters across stages."""
        d = self.mesh.shape.dp
        for work, flat, params in self._works:
            work.wait()
            flat /= d
            offset = 0
            for p in params:
                n = p.grad.numel()
                p.grad.copy_(flat[offset : offset + n].view_as(p.grad))
                offset += n
        self._works = []
        self._sync_tied()

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
            if self.mesh.shape.dp > 1:
                dist.all_reduce(delta, group=self.mesh.groups["dp"])
                delta /= self.mesh.shape.dp
            p.grad.copy_(delta if before is None else before + delta)

    # ------------------------------------------------------------- clipping
    def clip_norm_(self, max_norm: float, tp_rank: int, stage: int) -> float:
        """Clip all gradients by their global 2-norm; returns the norm before clipping.

        Each parameter counts once: a shard on every tensor-parallel rank, a
        replicated parameter on tp rank 0, a parameter held by several stages
        on the first of them; data-parallel replicas hold equal gradients.
        """
        sq = torch.zeros((), dtype=torch.float64, device=self.device)
        for name, p in self.params.items():
            if p.grad is None:
                continue
            if not isinstance(self.program.param_spec(name), Shard) and tp_rank != 0:
                continue
            if self.program.param_stages[name][0] != stage:
                continue
            sq += p.grad.detach().double().pow(2).sum()
        for axis in ("tp", "pp"):
            if self.mesh.groups.get(axis) is not None:
                dist.all_reduce(sq, group=self.mesh.groups[axis])
        norm = math.sqrt(float(sq))
        coef = max_norm / (norm + 1e-6)
        if coef < 1:
            for p in self.params.values():
                if p.grad is not None:
                    p.grad.mul_(coef)
        return norm
