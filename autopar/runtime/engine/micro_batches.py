"""A step's batch as this replica's microbatches, and each microbatch's weight in the loss.

``train_step``/``eval_step`` take the global batch (the same on every rank;
this data-parallel replica's rows are kept) or this replica's own batch (a data
loader per replica): ``MicroBatches.split`` tells which from the shapes, keeps
this replica's rows, moves them to the engine's device and cuts them into the
program's microbatches. ``MicroBatches.weights`` checks the ids against what
they index and weighs the microbatches (``loss_weights.py``); with several
replicas they agree on both first (``batch_checks.agree``), so every rank
raises alike or none does.

Context parallelism (``program.context``, c > 1): the c ranks of a replica
take the same rows (a batch's rows are cut by dp alone), then each batch
tensor the context names (``ContextSplit.seq_dims``) is cut along its sequence
dim to this rank's tokens (``ContextSplit.shard`` at ``mesh.cp_rank``: chunks r
and 2c-1-r under the load-balanced layout), after the microbatches are cut; a
tensor not named reaches every cp rank whole. The batch passed holds whole
sequences (``ContextSplit.seq_len`` tokens). A token loss then counts each cp
rank's own targets, and the counts are summed over the d x c ranks
('dp_cp'); the batch checks agree over the same ranks. Any other loss (or
``loss_reduction='microbatch'``) is refused when the engine is made: a
microbatch's mean over its tokens would need every cp rank's token count.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from autopar.core.comm.cp_layout import ContextSplit
from autopar.core.mesh import Mesh
from autopar.runtime.engine.batch_checks import (REFUSED, BatchCountError, BatchError, IdProblem, agree, cast_dtypes,
                                                 find_id_problem, id_error)
from autopar.runtime.engine.device_graphs import on_device
from autopar.runtime.engine.errors import EngineUsageError
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
        self.replicas = mesh.shape.dp_cp
        """Ranks the token counts and batch checks are exchanged over ('dp_cp'): d x c."""
        self.context = self._context(program, mesh)
        """How the sequences are split over the cp ranks (None: no context parallelism)."""
        self._loss_targets = None
        """The loss's targets graph on the device (a token loss counts its targets with it), made once."""

    def _context(self, program: "Program", mesh: Mesh) -> ContextSplit | None:
        """The program's context split when the mesh has cp > 1, checked against the mesh and the loss."""
        context = program.context
        if mesh.shape.cp == 1 and (context is None or context.cp == 1):
            return None
        if context is None or context.cp != mesh.shape.cp:
            raise EngineUsageError(f"the mesh has cp={mesh.shape.cp} context-parallel ranks but the program's context "
                                   f"split is {context}: the compiler sets program.context for cp > 1 "
                                   f"(passes/context_parallel.py); compile with parallelize(..., cp={mesh.shape.cp})")
        if not self._token_loss():
            roles = program.batch_roles
            why = ("loss_reduction='microbatch' was asked for" if program.config.loss_reduction != "tokens"
                   else f"the loss is not a token mean ({roles.why_not_tokens or 'no token loss found'})")
            raise EngineUsageError(
                f"context parallelism (cp={context.cp}) needs a token loss weighted by counted targets "
                f"(loss_reduction='tokens' with a mean-reduced cross-entropy / nll over targets), but {why}: each "
                f"cp rank holds 1/{context.cp} of a microbatch's tokens, and the microbatch's mean over its tokens "
                f"would need every cp rank's count. Fix: loss_fn=F.cross_entropy (or lm_cross_entropy) with "
                f"loss_reduction='tokens', or cp=1")
        unknown = sorted(set(context.seq_dims) - set(program.traced.input_names + program.traced.target_names))
        if unknown:
            raise EngineUsageError(f"the context split names batch tensor(s) {unknown}, which are not the program's "
                                   f"inputs or targets ({program.traced.input_names + program.traced.target_names})")
        return context

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
                agree(IdProblem(REFUSED, 0, ()), 0, self.mesh.groups["dp_cp"], self.replicas, self.device,
                      self.mesh.shape.cp)
            raise

    def _split(self, batch) -> tuple[list[list[torch.Tensor]], bool]:
        traced = self.program.traced
        names = traced.input_names + traced.target_names
        if len(batch) != len(names):
            raise BatchCountError(f"expected {len(traced.input_names)} input(s) and {len(traced.target_names)} "
                                  f"target(s), got {len(batch)} tensors")
        phs = {n.name: n for n in traced.gm.graph.nodes if n.op == "placeholder"}
        m = self.program.microbatches
        wants = [self._whole_shape(name, tuple(phs[name].meta["val"].shape)) for name in names]
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
        if self.context is not None:  # this cp rank's tokens of each microbatch
            for k, name in enumerate(names):
                if name in self.context.seq_dims:
                    dim = self.context.seq_dims[name] % len(wants[k])
                    for i in range(m):
                        out[i][k] = self.context.shard(out[i][k], dim, self.mesh.cp_rank)
        return out, whole[0]

    def _whole_shape(self, name: str, traced: tuple[int, ...]) -> tuple[int, ...]:
        """A microbatch's shape of batch tensor ``name`` as passed: as traced, with whole sequences
        (``ContextSplit.seq_len``) along its sequence dim when the context names it (the graph was
        traced with the whole sequence or with one rank's tokens)."""
        if self.context is None or name not in self.context.seq_dims:
            return traced
        dim = self.context.seq_dims[name] % len(traced)
        return traced[:dim] + (self.context.seq_len,) + traced[dim + 1:]

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
        with d x c > 1, when the loss counts its targets or the batch holds ids."""
        return self.replicas > 1 and (self._token_loss() or bool(self.program.batch_roles.ids))

    def weights(self, batch, micro: list[list[torch.Tensor]], whole: bool) -> StepWeights:
        """Ids checked against what they index and the microbatches' weights, before the step's first action.

        The ids of ``batch`` as passed (the global batch on every rank, or this replica's own) are
        checked with a min/max each; a token loss counts each microbatch's targets (this cp rank's
        tokens of it). With d x c > 1, one all-gather over 'dp_cp' of a few numbers
        (``replicas_agree``) gives every rank the count N of the global batch and any replica's
        problem, so every rank raises alike (with the global batch every rank checked all of it). The
        backward's seeds are scaled by d x c, the ranks the gradients are averaged over."""
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
            problem, total = agree(problem, total, self.mesh.groups["dp_cp"], self.replicas, self.device,
                                   self.mesh.shape.cp)
        if problem is not None:
            raise id_error(problem, roles, whole, d)
        return step_weights(counts, total, self.replicas) if tokens else equal_weights(m, d)
