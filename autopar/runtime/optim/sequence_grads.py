"""Gradients that are partial sums over the tensor-parallel ranks, summed once per step.

Under sequence parallelism each tensor-parallel rank runs the norms, biases and
other replicated parameters on its own 1/t of the tokens, so its gradient for
them is the sum over its tokens only (``program.sequence.partial_params``, found
by ``passes/sequence_parallel.py``). Summed over the t ranks they are the whole
gradient. As in Megatron, the sum runs once per step rather than once per
microbatch (an all-reduce per norm per microbatch otherwise): right after the
last backward that produces a gradient, before its data-parallel reduction
(``GradientSync.start``), and for parameters held by several stages before
their sum across them (``GradientSync.end_step``); so clipping and the
optimizer see whole gradients. Only this step's part is summed (the gradients
before the step are remembered), so gradients accumulated over several steps
without ``zero_grad`` stay right. Every buffer lives on the parameters' device.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
import torch.nn as nn

from autopar.core.mesh import Mesh

if TYPE_CHECKING:
    from autopar.compiler.program import Program

__all__ = ["PartialGradSum"]


class PartialGradSum:
    """Sums this step's gradients of the partial-gradient parameters over the tensor-parallel group."""

    def __init__(self, program: "Program", mesh: Mesh, params: dict[str, nn.Parameter]):
        sequence = getattr(program, "sequence", None)
        self.group = mesh.groups.get("tp")
        self.names = [n for n in (sequence.partial_params if sequence is not None else ()) if n in params]
        """This rank's parameters whose gradients are partial sums over the tp ranks."""
        self.params = params
        self._before: dict[str, torch.Tensor | None] = {}
        self._pending: set[str] = set()

    def begin_step(self) -> None:
        """Remember the gradients before this step: only this step's part is summed."""
        if self.group is None:
            return
        self._before = {n: None if self.params[n].grad is None else self.params[n].grad.clone() for n in self.names}
        self._pending = set(self.names)

    def sum(self, names) -> None:
        """Sum over tp this step's gradient of those of ``names`` not summed yet, in one all-reduce."""
        todo = [n for n in names if n in self._pending]
        if not todo:
            return
        deltas = []
        for name in todo:
            p = self.params[name]
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            before = self._before[name]
            deltas.append((p.grad if before is None else p.grad - before).reshape(-1))
        flat = torch.cat(deltas)
        dist.all_reduce(flat, group=self.group)
        offset = 0
        for name in todo:
            p, before = self.params[name], self._before[name]
            delta = flat[offset: offset + p.grad.numel()].view_as(p.grad)
            p.grad.copy_(delta if before is None else before + delta)
            offset += p.grad.numel()
        self._pending -= set(todo)

    def sum_rest(self) -> None:
        """Sum what no chunk's last backward summed (parameters held by several stages)."""
        self.sum(sorted(self._pending))
