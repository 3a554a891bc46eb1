"""A step's batch as this replica's microbatches, and each microbatch's weight in the loss.

``train_step``/``eval_step`` take the global batch (the same on every rank;
this data-parallel replica's rows are kept) or this replica's own batch (a data
loader per replica): ``MicroBatches.split`` tells which from the shapes, keeps
this replica's rows, moves them to the engine's device and cuts them into the
program's microbatches. ``MicroBatches.weights`` checks the ids against what
they index and weighs the microbatches (``loss_weights.py``); with several
replicas they agree on both first (``batch_checks.agree``), so every rank
raises alike or none does.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from autopar.core.mesh import Mesh
from autopar.runtime.engine.batch_checks import (REFUSED, BatchCountError, BatchError, IdProblem, agree, cast_dtypes,
                                                 find_id_problem, id_error)
from autopar.runtime.engine.device_graphs import on_device
from autopar.runtime.engine.loss_weights import StepWeights, equal_weights, step_weights, token_counts

if TYPE_CHECKING:
    from autopar.compiler.program import Program

__all__ = ["MicroBatches"]


class MicroBatches:
    """Splits a step's batch for one rank and weighs its microbatches."""

    def __init__(self, program: "Program", mesh: Mesh, device: torch.device) -> None:
        self.program = program
        self.mesh = mesh
        self.device = device
        self.dp_rank, self.dp_size = mesh.dp_rank, mesh.shape.dp
        self._loss_targets = None
        """The loss's targets graph on the device (a token loss counts its targets with it), made once."""

    def split(self, batch) -> tuple[list[list[torch.Tensor]], bool]:
        """([microbatch][input or target]: this replica's slices, on the engine's device; whether the
        batch is the global one).

        Each tensor is the global batch (leading size d*m*b: this replica's rows are kept) or this
        replica's own (m*b); all of the batch's tensors the same way (one and the same when d = 1).
        Each has its traced dtype, or is an integer tensor the graph uses as indices only, cast to it
        (``batch_checks.py``). A batch refused here is reported to the other replicas, which would
        otherwise wait for this one in the step's agreement.
        """
        try:
            return self._split(batch)
        except (ValueError, TypeError):
            if self.replicas_agree():
                agree(IdProblem(REFUSED, 0, ()), 0, self.mesh.groups["dp"], self.dp_size, self.device)
            raise

    def _split(self, batch) -> tuple[list[list[torch.Tensor]], bool]:
        traced = self.program.traced
        names = traced.input_names + traced.target_names
        if len(batch) != len(names):
            raise BatchCountError(f"expected {len(traced.input_names)} input(s) and {len(traced.target_names)} "
                                  f"target(s), got {len(batch)} tensors")
        phs = {n.name: n for n in traced.gm.graph.nodes if n.op == "placeholder"}
        m = self.program.microbatches
        wants = [tuple(phs[name].meta["val"].shape) for name in names]
        whole = [self._is_global_batch(name, tuple(x.shape), want) for name, x, want in zip(names, batch, wants)]
        if len(set(whole)) > 1:
            kinds = ", ".join(f"'{n}' {tuple(x.shape)}: {'global' if g else 'this replica'}"
                              for n, x, g in zip(names, batch, whole))
            raise BatchError(f"the batch mixes the global batch and this replica's ({kinds}): pass every "
                             f"input and target the same way, all global or all this replica's")
        batch = cast_dtypes(names, batch, [phs[name].meta["val"].dtype for name in names], self.program.batch_roles)
        out = [[] for _ in range(m)]
        for x, want, is_global in zip(batch, wants, whole):
            start = self.dp_rank * want[0] * m if is_global else 0
            mine = x.narrow(0, start, want[0] * m).to(self.device)
            for i, piece in enumerate(mine.split(want[0], dim=0)):
                out[i].append(piece)
        return out, whole[0]

    def _is_global_batch(self, name: str, shape: tuple[int, ...], want: tuple[int, ...]) -> bool:
        """Whether batch tensor ``name`` of ``shape`` is the global batch (True) or this replica's
        (False), the example microbatch's shape being ``want``; an error naming both accepted shapes
        when it is neither."""
        m, d = self.program.microbatches, self.dp_size
        replica = (want[0] * m,) + want[1:]
        full = (want[0] * m * d,) + want[1:]
        if shape in (full, replica):
            return shape == full
        if d == 1:
            expected = f"{full}: {m} microbatch(es) of {want} (the example microbatch's shape)"
        else:
            expected = (f"{full}, the global batch ({d} data-parallel replicas x {m} microbatch(es) of {want}, "
                        f"the example microbatch's shape), or {replica}, this replica's own batch "
                        f"({m} microbatch(es) of {want}; replica {self.dp_rank} of {d})")
        raise BatchError(f"batch tensor '{name}' has shape {shape}, but the program expects {expected}")

    def _token_loss(self) -> bool:
        roles = self.program.batch_roles
        return roles.loss is not None and self.program.config.loss_reduction == "tokens"

    def replicas_agree(self) -> bool:
        """Whether the replicas exchange their batch checks and target counts each step (``agree``):
        with d > 1, when the loss counts its targets or the batch holds ids."""
        return self.dp_size > 1 and (self._token_loss() or bool(self.program.batch_roles.ids))

    def weights(self, batch, micro: list[list[torch.Tensor]], whole: bool) -> StepWeights:
        """Ids checked against what they index and the microbatches' weights, before the step's first action.

        The ids of ``batch`` as passed (the global batch on every rank, or this replica's own) are
        checked with a min/max each; a token loss counts each microbatch's targets. With d > 1, one
        all-gather over dp of a few numbers (``replicas_agree``) gives every rank the count N of the
        global batch and any replica's problem, so every rank raises alike (with the global batch
        every rank checked all of it)."""
        roles, d, m = self.program.batch_roles, self.dp_size, self.program.microbatches
        traced = self.program.traced
        names = traced.input_names + traced.target_names
        problem = find_id_problem(roles.ids, dict(zip(names, batch)))
        if problem is not None and whole:
            raise id_error(problem, roles, whole, d)
        tokens = self._token_loss()
        counts = []
        if tokens:
            if self._loss_targets is None:
                self._loss_targets = on_device(roles.loss.targets, self.device)
            counts = token_counts(roles.loss, self._loss_targets, [dict(zip(names, mb)) for mb in micro])
        total = sum(counts)
        if self.replicas_agree():
            problem, total = agree(problem, total, self.mesh.groups["dp"], d, self.device)
        if problem is not None:
            raise id_error(problem, roles, whole, d)
        return step_weights(counts, total, d) if tokens else equal_weights(m, d)
