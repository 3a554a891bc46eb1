"""One rank's training engine: its chunks' parameter shards and the schedule interpreter.

``train_step(*inputs, *targets)`` takes the global batch (the same on every
rank; this data-parallel replica's slice is kept) or this replica's own batch
(a data loader per replica, ``engine.dp_rank`` of ``engine.dp_size``), cuts it
into microbatches, and with context parallelism each into this rank's tokens
(``micro_batches.py``) and runs this stage's actions from the
lowered schedule (``autopar/schedules/``); ``eval_step`` runs the forward-only
form of the schedule (``program.eval_schedule``) over each chunk's evaluation
graph (dropout removed, training flags off; made at compile time) under
``torch.no_grad()``: no context kept, no gradient touched. Every step reads the
same way: a new ``StepState`` (``step_state.py``), then each action through its
handler (one table for both steps: F, B, W in ``compute.py``; SF, RF, SB, RB in
``p2p.py``, a run of consecutive ones posted as one batch), then the loss
reduced over the stages and replicas. A failure becomes one ``ActionError`` on
every rank (``step_failures.py``).

Every tensor the engine makes lives on its device (``self.device``: the device
of its parameters; the current GPU when the process group is NCCL), so no
collective ever runs on a CPU tensor under NCCL. The rank's shards and buffers
are its ``holdings`` (``holdings.py``), random ops draw from its
``random_stream`` (``random_streams.py``); checkpoints and the HuggingFace
export read those two, never the engine.

After the last backward, gradients of parameters that several stages hold (a
tied embedding and LM head) are summed across those stages
(``runtime/optim/gradient_sync.py``). Gradients accumulate into ``.grad`` as
with ``loss.backward()``: call ``optimizer.step()`` and ``zero_grad()`` around,
or ``engine.optimizer_step(optimizer, scheduler)``, which skips a step whose
loss or gradient norm is not finite (``step_health.py``; ``engine.last_step``
says what and where; a distributed optimizer's own ``step()`` skips it too).
"""

from __future__ import annotations

import dataclasses
import secrets
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
import torch.nn as nn

from autopar.core.comm import TPGroup
from autopar.core.comm.expert_dispatch import EXPERT_LOAD
from autopar.core.mesh import Mesh
from autopar.runtime.engine.action_runs import Handlers, run_actions
from autopar.runtime.engine.compiled_chunks import CompiledChunk, CompileReport, CompileTurns
from autopar.runtime.engine.compute import ChunkCompute
from autopar.runtime.engine.errors import EngineUsageError
from autopar.runtime.engine.eval_outputs import LogitsOutput, askers, gather_logits
from autopar.runtime.engine.failure_board import FailureBoard, failure_timeout
from autopar.runtime.engine.step_failures import StepFailures
from autopar.runtime.engine.step_health import StepChecks, StepHealth
from autopar.runtime.engine.holdings import Holdings, nccl, rank_device, shard_key
from autopar.runtime.engine.micro_batches import MicroBatches
from autopar.runtime.engine.p2p import PointToPoint, wait_sends
from autopar.runtime.engine.random_streams import RandomStream, stream_seed
from autopar.runtime.engine.step_state import StepState
from autopar.runtime.engine.timeline import (Event, StepHistory, aligned_steps, clock_offset, gather_objects,
                                             trace_metadata, write_chrome_trace)
from autopar.runtime.hf.export import save_pretrained
from autopar.runtime.optim.distributed_optimizer import DistributedOptimizer
from autopar.runtime.optim.gradient_sync import GradientSync
from autopar.schedules import Kind, Schedule

if TYPE_CHECKING:
    from autopar.compiler.program import Program
    from autopar.core.chunks import Chunk
    from autopar.runtime.checkpoint.checkpointer import Checkpointer, SaveHandle

__all__ = ["RankEngine"]


def _from_rank0(values: list[int], device: torch.device) -> list[int]:
    """Global rank 0's ``values`` on every rank: a broadcast over the world (every rank builds its
    engine: ``materialize`` is collective)."""
    t = torch.tensor(values, dtype=torch.int64, device=device)
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.broadcast(t, src=0)
    return [int(v) for v in t]


def _compile_turns(program: "Program", mesh: Mesh, token: int, timeout_s: float) -> CompileTurns | None:
    """With compiled chunks and tensor parallelism: the turns the tp ranks of this rank's stage and
    replica take compiling their chunk graphs (waiting only with Inductor, whose cache they share);
    None otherwise."""
    if not program.config.compile or mesh.shape.tp == 1 or not dist.is_initialized():
        return None
    return CompileTurns(store=dist.distributed_c10d._get_default_store(),
                        prefix=f"autopar/compile/{token:x}/{mesh.pp_rank}/{mesh.dp_rank}/{mesh.cp_rank}",
                        first=mesh.tp_rank == 0, timeout_s=timeout_s)


class RankEngine(nn.Module):
    """Holds this rank's parameter shards and interprets its schedule."""

    def __init__(self, program: "Program", mesh: Mesh, local_params: dict[str, torch.Tensor],
                 feeds: dict[str, torch.Tensor], bucket_bytes: int = 25 * 2**20):
        super().__init__()
        self.program = program
        self.mesh = mesh
        self.stage = mesh.pp_rank
        self.chunks: dict[int, "Chunk"] = {c.index: c for c in program.chunks_of_stage(self.stage)}
        self.device = rank_device(local_params.values())
        """Where this rank computes: its parameters' device. Every tensor the engine makes lives here."""
        self.tp = TPGroup.of(mesh.groups.get("tp"), tuple(mesh.tp_members()))
        if mesh.shape.ep > 1:  # the expert dispatch's group rides on the tp group the rank program is given
            self.tp = dataclasses.replace(self.tp, ep=TPGroup.of(mesh.groups.get("ep"), tuple(mesh.ep_members())))
        if mesh.shape.cp > 1:  # ring attention's group rides on the tp group too
            self.tp = dataclasses.replace(self.tp, cp=TPGroup.of(mesh.groups.get("cp"), tuple(mesh.cp_members())))
        if program.config.compile and self.tp.size > 1:  # the rank as a graph input: one graph per stage
            self.tp = dataclasses.replace(self.tp, rank_tensor=torch.tensor(self.tp.rank, device=self.device))
        if nccl() and self.device.type != "cuda":
            raise EngineUsageError(f"the process group's backend is NCCL, but this rank's parameters are on "
                                   f"{self.device}: NCCL communicates GPU tensors only (materialize places the "
                                   f"shards on the rank's GPU under NCCL; or use the gloo backend)")
        self.device_type = self.device.type
        self.shards = nn.ParameterDict({shard_key(n): nn.Parameter(t) for n, t in local_params.items()})
        self.holdings = Holdings(program, mesh, self.tp, self.device, self.shards, feeds)
        """This rank's shards and buffers: what checkpoints and the export read."""
        self.schedule = program.schedule
        self.eval_schedule = program.eval_schedule
        """The forward-only schedule of an evaluation step."""
        self.stats: dict = {}
        self.events: list[Event] = []
        """The last step's measured timeline."""
        self.timelines = StepHistory()
        """The measured timelines of the last training steps (``write_trace`` writes them)."""
        # one broadcast: the stream's seed (rank 0's torch.initial_seed()) and the failure board's token
        seed, token = _from_rank0([torch.initial_seed() % 2**62, secrets.randbits(62)], self.device)
        self.random_stream = RandomStream(stream_seed(seed, mesh), self.device)
        """This rank's random stream (dropout): equal on the t ranks of a stage."""
        self.failures = StepFailures(FailureBoard(f"autopar/failure/{token:x}", mesh.shape.world), mesh)
        """Whether a step failed, and the board its failure is published on (``step_failures.py``)."""
        self.failure_timeout_s = failure_timeout()
        """Seconds an action may make no progress (waiting for a peer) before this rank fails the step
        with a ``TimeoutError`` its peers raise too: ``AUTOPAR_FAILURE_TIMEOUT``, default 300."""
        self._steps = 0
        """Steps started (train and eval)."""
        self._expert_load: dict[str, list[int]] = {}
        self._held_placeholders = {ph for c in self.chunks.values() for ph in c.params}
        self.grads = GradientSync(program, mesh, {n: self.holdings.shard(n) for n in local_params},
                                  bucket_bytes, device=self.device)
        self.step_checks = StepChecks(self.grads, mesh, self.device, self.tp.rank)
        """Whether each training step's numbers were finite, and the skip policy (``step_health.py``):
        ``step_checks.skipped`` steps skipped in all, ``step_checks.in_row`` since the last finite one."""
        self.split_backward = program.schedule.splits_backward
        """Whether a backward is split into B (input gradients) and W (weight gradients): the
        schedule's choice (ZB-H1 and ZB-V place W actions of their own)."""
        self.batches = MicroBatches(program, mesh, self.device)
        self.compute = ChunkCompute(self.holdings, self.chunks, self.random_stream, self.grads, self.schedule,
                                    _compile_turns(program, mesh, token, self.failure_timeout_s))
        """The F, B and W handlers."""
        self.p2p = PointToPoint(program, mesh, self.tp, self.chunks, self.device)
        """The SF, RF, SB and RB handlers."""

    @property
    def random_seed(self) -> int:
        """Seed of this rank's random stream (dropout); equal on the t ranks of a stage."""
        return self.random_stream.seed

    @property
    def runnables(self) -> dict:
        """Chunk -> what a training step runs: its graph, making its tensors on the engine's device."""
        return self.compute.runnables

    @runnables.setter
    def runnables(self, value: dict) -> None:
        self.compute.runnables = value

    @property
    def eval_runnables(self) -> dict:
        """Chunk -> what an evaluation step runs: its graph in evaluation mode."""
        return self.compute.eval_runnables

    @property
    def dp_rank(self) -> int:
        """This rank's data-parallel replica (0 .. dp_size - 1): the ``rank`` of its data loader's
        ``DistributedSampler``."""
        return self.mesh.dp_rank

    @property
    def dp_size(self) -> int:
        """Data-parallel replicas: the ``num_replicas`` of each replica's ``DistributedSampler``. The cp
        ranks of a replica read the same rows (each keeps its own tokens of them)."""
        return self.mesh.shape.dp

    @property
    def cp_rank(self) -> int:
        """This rank's place among the context-parallel ranks of its replica: which token blocks of
        each sequence it holds (``program.context``)."""
        return self.mesh.cp_rank

    # ------------------------------------------------------------------ stepping
    def forward(self, *batch: torch.Tensor) -> float:
        """``engine(x, y)``: ``train_step`` (forward *and* backward) in training mode, the default;
        ``eval_step`` after ``engine.eval()``."""
        return self.train_step(*batch) if self.training else self.eval_step(*batch)

    def train_step(self, *batch: torch.Tensor) -> float:
        """Forward and backward of one batch; returns the mean loss (same on every rank).

        ``batch``: the model's inputs then its targets, each of shape (d * m * b, ...) for d
        data-parallel replicas, m microbatches and the example microbatch's leading size b (the
        global batch, the same on every rank), or (m * b, ...): this replica's own batch. On any
        device (what this replica uses is moved to the engine's).
        """
        self._refuse_if_failed("train_step", read_board=True)
        self._report_failed_save()
        st = self._new_step(batch, self.schedule, training=True)
        with self.failures.together(st, self.failure_timeout_s):
            self.grads.begin_step(st.stats)
            run_actions(st, self.stage, self.mesh.rank, self._handlers(), self.p2p.post, self.failures)
            self.timelines.add(st.origin, st.events)
            st.enter_phase("the step's end (sends, gradient reductions, loss)")
            wait_sends(st)
            self.wait_parameters("train_step")  # a parameter no chunk read: nothing else waits for it
            self.grads.end_step()
            loss = self._reduce_loss(st)
            self._expert_load = self._step_expert_load()
            self.step_checks.after_loss(st.losses, st.m, loss, st.weights.total)
        return loss

    @property
    def last_step(self) -> StepHealth | None:
        """The last training step's ``StepHealth``: whether its loss and gradient norm were finite,
        and if not, what, in which microbatch, on which stage and rank (the same on every rank). Set
        by ``train_step`` (the loss), completed by ``clip_grad_norm_`` or ``optimizer_step`` (the
        gradient norm). None before the first step."""
        return self.step_checks.last

    @property
    def max_nonfinite_steps(self) -> int:
        """Non-finite training steps in a row that stop the run (``NonFiniteError`` on every rank,
        raised by ``optimizer_step`` or a distributed optimizer's ``step()``); the ones before are
        skipped. 1: the first non-finite step stops it. Default 3; set it on every rank."""
        return self.step_checks.limit

    @max_nonfinite_steps.setter
    def max_nonfinite_steps(self, value: int) -> None:
        self.step_checks.limit = value

    def optimizer_step(self, optimizer: torch.optim.Optimizer, scheduler=None) -> bool:
        """Step ``optimizer`` (then ``scheduler``) unless this training step's numbers were not finite;
        clear every gradient either way. Returns whether it stepped.

        Collective: every rank calls it after ``train_step`` (and ``clip_grad_norm_``, if used). A step
        whose microbatch loss or gradient norm is NaN or infinite (``last_step``) is skipped: neither
        the optimizer nor the scheduler steps, so the weights, the optimizer's state and the learning
        rate are those of a run without that step; a warning names the step, microbatch, stage and
        rank. The ``max_nonfinite_steps``-th non-finite step in a row raises ``NonFiniteError`` on
        every rank instead. Without ``clip_grad_norm_`` the gradient norm is computed here (one
        all-reduce of a scalar per parallel axis). With gradient accumulation (several
        ``train_step`` before it) any non-finite loss among them skips the step.
        """
        self._refuse_if_failed("optimizer_step")
        with self._watched("optimizer_step"):
            stepped = self.step_checks.settle()
            if stepped:
                optimizer.step()  # a distributed optimizer asks settle() again: the same answer
                if scheduler is not None:
                    scheduler.step()
        optimizer.zero_grad()
        self.zero_grad()
        return stepped

    def _step_expert_load(self) -> dict[str, list[int]]:
        """This step's rows per expert of each expert-parallel layer, over every replica (the expert
        group's counts summed over the groups: a small all-reduce over 'edp'); {} without ep."""
        counted = EXPERT_LOAD.take()
        if not self.program.expert_params:
            return {}
        layers = [x for x in self.program.experts if x.params[0] in self._held_placeholders]
        rows = torch.tensor([n for x in layers for n in counted.get(x.module, [0] * x.experts)], dtype=torch.int64)
        if self.mesh.groups.get("edp") is not None and layers:
            rows = rows.to(self.device)
            dist.all_reduce(rows, group=self.mesh.groups["edp"])
        flat, out = rows.cpu().tolist(), {}
        for x in layers:
            out[x.module], flat = flat[:x.experts], flat[x.experts:]
        return out

    def expert_load(self) -> dict[str, list[int]]:
        """The last training step's load: for each mixture-of-experts layer on this rank's stage (by
        its experts' module), the token rows routed to each expert over the whole global batch (every
        replica's; a token counts once per expert it chose). {} without expert parallelism."""
        return dict(self._expert_load)

    def eval_step(self, *batch: torch.Tensor, outputs: bool = False, to: str | int | Iterable[int] = "all"):
        """Forward only, over the pipeline; returns the mean loss (same on every rank) as the
        model in ``eval()`` mode computes it.

        The batch as for ``train_step``. Runs the forward-only schedule (``program.eval_schedule``)
        over each chunk's evaluation graph (dropout removed, training flags off) under
        ``torch.no_grad()``: no context is kept, no ``.grad`` touched, and the random stream of
        training steps is left where it was.

        ``outputs=True``: returns ``(loss, logits)``, the logits (``output_fn``'s value) whole:
        gathered over tp, the microbatches concatenated along their first dim, this replica's rows
        (its own batch given) or every replica's in the global batch's order (the global batch
        given); on the ranks ``to`` names (``"all"``, ``"last"``: the last stage's, a rank or a
        list of ranks; the same on every rank), None on the others. They are rows x ... x V values
        on each of those ranks: ask where they are needed (``runtime/engine/eval_outputs.py``).
        """
        if outputs:  # what cannot be returned fails here, on every rank, before any work
            spec = LogitsOutput.of(self.program)
            last = self.program.stage_of_chunk(self.program.split.n - 1)
            ranks = askers(to, self.mesh.shape.world,
                           [r for r in range(self.mesh.shape.world) if self.mesh.shape.coords(r)[0] == last])
        self._refuse_if_failed("eval_step", read_board=True)
        self._report_failed_save()
        self.wait_parameters("eval_step")
        st = self._new_step(batch, self.eval_schedule, training=False)
        st.logits = {} if outputs else None
        with self.failures.together(st, self.failure_timeout_s):
            with self.random_stream.unchanged(), torch.no_grad():  # evaluation graphs' random ops draw from a copy
                run_actions(st, self.stage, self.mesh.rank, self._handlers(), self.p2p.post, self.failures)
            st.enter_phase("the step's end (sends, loss, outputs)")
            wait_sends(st)
            loss = self._reduce_loss(st)
            if not outputs:
                return loss
            return loss, gather_logits(self.holdings, spec, st.logits, ranks, st.global_batch and self.dp_size > 1)

    def _new_step(self, batch, schedule: Schedule, training: bool) -> StepState:
        """The state of a step over ``batch``; resets ``stats`` and ``events`` to this step's."""
        self._refuse_if_failed("train_step" if training else "eval_step")
        self._steps += 1
        micro, whole = self.batches.split(batch)
        st = StepState(schedule=schedule, training=training, micro=micro, m=self.program.microbatches,
                       weights=self.batches.weights(batch, micro, whole), split_backward=self.split_backward,
                       loss_sum=torch.zeros((), dtype=torch.float64, device=self.device),
                       param_ptrs={p.data_ptr() for p in self.shards.values()})
        self.stats, self.events = st.stats, st.events
        st.number, st.global_batch = self._steps, whole
        return st

    def _handlers(self) -> Handlers:
        """Action kind -> its handler, called ``handler(action, state)``; a communication handler
        adds its operations to ``state.comm``. Made at the start of each step from the handlers'
        objects, so a handler wrapped on its object (instrumentation) is the one dispatched to."""
        return {
            Kind.F: self.compute.forward,
            Kind.B: self.compute.backward,
            Kind.W: self.compute.weight_backward,
            Kind.SEND_F: self.p2p.send_outputs,
            Kind.RECV_F: self.p2p.recv_inputs,
            Kind.SEND_B: self.p2p.send_input_grads,
            Kind.RECV_B: self.p2p.recv_output_grads,
        }

    def _reduce_loss(self, st: StepState) -> float:
        """The step's loss: the weighted sum of the microbatch losses (``runtime/engine/loss_weights.py``), from
        the last stage to the others, summed over the replicas and their cp ranks (their weights sum to one)."""
        loss = st.loss_sum.reshape(1)
        if self.mesh.shape.pp > 1:  # the stage of the last chunk (stage 0 in ZB-V's V)
            last = self.mesh.peer(self.program.stage_of_chunk(self.program.split.n - 1))
            dist.broadcast(loss, src=last, group=self.mesh.groups["pp"])
        if self.mesh.shape.dp_cp > 1:
            dist.all_reduce(loss, group=self.mesh.groups["dp_cp"])
        return float(loss)

    def _refuse_if_failed(self, what: str, read_board: bool = False) -> None:
        """``EngineFailedError`` when a step of this engine failed (``step_failures.py``)."""
        self.failures.refuse_if_failed(what, self._steps, read_board)

    def _watched(self, what: str, patient: bool = False):
        """A collective call outside the steps under the failure watch (``StepFailures.watched``): a peer
        that stops answering during it fails it within ``failure_timeout_s``, named, on every rank."""
        return self.failures.watched(what, self._steps, self.failure_timeout_s, patient)

    # -------------------------------------------------------------- gradients
    def gradient_groups(self) -> list[list[str]]:
        """The groups of parameter names whose data-parallel reduction starts together (each final
        after one chunk's last backward), as ``GradientSync.start`` receives them; tied ones aside."""
        return [list(names) for names in self.compute.ready_after.values()]

    def clip_grad_norm_(self, max_norm: float) -> float:
        """Clip all gradients by their global 2-norm over every rank; returns the norm before clipping.
        A non-finite norm clips nothing and marks the step non-finite (``last_step``; ``optimizer_step``
        skips it)."""
        self._refuse_if_failed("clip_grad_norm_")
        with self._watched("clip_grad_norm_"):
            norm = self.grads.clip_norm_(max_norm, self.tp.rank, self.stage)
            self.step_checks.after_norm(norm)
        return norm

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Clear the shards' gradients; reads no parameter, so the all-gathers in flight go on."""
        for p in self.shards.values():
            if p.grad is not None and set_to_none:
                p.grad = None
            elif p.grad is not None:
                p.grad.requires_grad_(False).zero_()

    def distributed_optimizer(self, optimizer_class: type, params=None, *, elementwise: bool = False,
                              overlap_param_gather: bool = True, **defaults: Any) -> DistributedOptimizer:
        """``optimizer_class(params, **defaults)`` with its state sharded over the data-parallel replicas
        (Megatron's distributed optimizer, ZeRO stage 1; ``runtime/optim/distributed_optimizer.py``).

        ``params``: this engine's parameters or param groups (default: all of them). Gradients are
        reduce-scattered from then on, so each replica holds the averaged gradient of its 1/d range
        only; ``clip_grad_norm_`` and ``full_grads`` read the shards, and the parameters' ``.grad``
        keep this replica's own gradients. ``elementwise=True`` accepts an optimizer class outside
        the known element-wise ones. ``overlap_param_gather``: ``step()`` returns with the parameters'
        all-gathers in flight, each waited for right before the first forward (or other read) of one
        of its parameters; False waits for them inside ``step()``. One per engine; made before the
        first ``train_step``.
        """
        optimizer = DistributedOptimizer(dict(self.named_local_parameters()), self.grads, self.gradient_groups(),
                                         optimizer_class, params, elementwise=elementwise,
                                         overlap_param_gather=overlap_param_gather, step_guard=self.step_checks.settle,
                                         watched=self._watched, **defaults)
        self.holdings.gathers = optimizer.gathers
        return optimizer

    # ---------------------------------------------------------------- parameters
    def wait_parameters(self, where: str = "wait_parameters") -> None:
        """Finish the distributed optimizer's parameter all-gathers still in flight, so the parameters
        hold the last ``step()``'s values (every read of them by the engine does this first; call it
        before reading a tensor of ``engine.parameters()`` kept from earlier). ``where``: recorded."""
        if self.holdings.gathers is None or not self.holdings.gathers.pending:
            return
        with self._watched(f"the parameters' all-gathers (before {where})"):
            self.holdings.wait(where)

    def named_parameters(self, *args, **kwargs):
        """``nn.Module.named_parameters``, once the parameter all-gathers in flight are done."""
        self.wait_parameters("named_parameters")
        return super().named_parameters(*args, **kwargs)

    def state_dict(self, *args, **kwargs):
        """``nn.Module.state_dict`` (the shards by engine key), once the all-gathers in flight are done."""
        self.wait_parameters("state_dict")
        return super().state_dict(*args, **kwargs)

    def load_state_dict(self, *args, **kwargs):
        """``nn.Module.load_state_dict``, once the all-gathers in flight are done (a gather landing
        later would overwrite the loaded values)."""
        self.wait_parameters("load_state_dict")
        return super().load_state_dict(*args, **kwargs)

    def _apply(self, *args, **kwargs):
        """``.to()``, ``.float()`` and the like, once the all-gathers in flight are done."""
        self.wait_parameters("_apply")
        return super()._apply(*args, **kwargs)

    def compiled(self) -> dict[tuple[str, int], CompileReport]:
        """With ``compile=``: ('train' or 'eval', chunk) -> what compiling that chunk graph on this rank
        cost (seconds of its first forward and backward) and made (graphs, why each break cut it,
        Inductor's code), for the graphs run so far; {} when the chunks run eagerly."""
        compute = self.compute
        out = {}
        for mode, runnables in (("train", compute.runnables), ("eval", compute.eval_runnables)):
            for chunk, run in runnables.items():
                if isinstance(run, CompiledChunk) and run.report is not None:
                    out[(mode, chunk)] = run.report
        return out

    def compiled_code(self) -> str:
        """With ``compile=True`` (Inductor): the code Inductor generated for this rank's chunks so far,
        chunk by chunk, forward then backward (B's module, then W's, when the backward is split): the
        wrapper that calls each fused kernel, the kernels' source, and above each kernel the graph nodes it fuses (the names ``program.code(rank)``
        shows). Empty for chunks not run yet, and with another backend."""
        out = []
        for (mode, chunk), report in sorted(self.compiled().items()):
            for part, modules in report.code.items():
                for i, code in enumerate(modules, 1):
                    head = f"# ==== chunk {chunk} ({mode}), {part} {i}/{len(modules)}: Inductor's code ===="
                    out.append(f"{head}\n{code}")
        return "\n".join(out)

    def named_local_parameters(self):
        """(original name, local shard) of every parameter this rank holds (the all-gathers of a
        distributed optimizer's step done)."""
        return self.holdings.named_local_parameters()

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """The model's ``state_dict()``, whole, on every rank, on the engine's device: exactly its keys
        in its order. Parameters under every name the model gives them (tied weights twice),
        gathered over tp, then over pp; persistent buffers; non-persistent buffers (a rotary
        ``inv_freq``) are not part of it, as in the model's own ``state_dict()``."""
        self._refuse_if_failed("full_state_dict")
        with self._watched("full_state_dict"):
            return self.holdings.full_state_dict()

    def full_grads(self) -> dict[str, torch.Tensor]:
        """Full gradients under every original parameter name, on every rank (with a distributed
        optimizer: the reduced gradients, all-gathered from the replicas' shards)."""
        self._refuse_if_failed("full_grads")
        with self._watched("full_grads"):
            return self.holdings.full_grads(self.grads)

    # ------------------------------------------------------- traces and export
    def write_trace(self, path: str, steps: int | None = 1) -> None:
        """Write the last ``steps`` training steps (None: all kept, ``engine.timelines``) of every
        rank as one Chrome/Perfetto trace on rank 0's clock, with the schedule, mesh and message
        sizes in its ``"autopar"`` object (``autopar simulate --measured`` reads it).

        Collective: every rank calls it; rank 0 writes ``path``.
        """
        self._refuse_if_failed("write_trace")
        with self._watched("write_trace"):
            offset = clock_offset(self.device)
            per_rank = gather_objects((self.mesh.rank, offset, self.timelines.last(steps)))
        if not dist.is_initialized() or dist.get_rank() == 0:
            events, step_of = aligned_steps(per_rank)
            meta = trace_metadata(self.program, self.mesh) | {"steps": sorted(set(step_of))}
            write_chrome_trace(events, path, steps=step_of, metadata=meta)

    def save_pretrained(self, path: str) -> list[str]:
        """Write the model as a HuggingFace directory that ``from_pretrained`` loads: safetensors
        with the model's names and shapes, one file per pipeline stage written by that stage
        (``autopar/runtime/hf/export.py``), and ``config.json`` for a HuggingFace model.

        Collective: every rank calls it. Returns the names of the files this rank wrote.
        """
        self._refuse_if_failed("save_pretrained")
        with self._watched("save_pretrained", patient=True):
            return save_pretrained(path, self.holdings.for_export())

    # --------------------------------------------------------------- checkpoints
    def save(self, root: str, optimizer: torch.optim.Optimizer | None = None, *, step: int, scheduler=None,
             extra: Any = None, async_save: bool = False) -> "SaveHandle":
        """Save the training state as ``root/step-<step>`` with ``torch.distributed.checkpoint``.

        Collective: every rank calls it. Stored: the parameters in their full
        shapes (loadable at any layout), ``optimizer``'s state by parameter name,
        ``scheduler``'s state, the random streams, the persistent buffers, ``step``
        and ``extra`` (a dict of plain values, e.g. the data position; rank 0's is
        kept). The checkpoint becomes ``root/step-N`` and ``root/latest`` only once
        every rank finished writing. ``async_save``: return once the state is copied
        to host memory while a thread writes it; ``handle.wait()`` (or the next
        save or load) waits for it; its failure is raised at the next ``train_step``,
        ``eval_step``, save, load or ``wait()``, on every rank. Wait before the process
        group is destroyed.

        Refused on every rank, before anything is written, when a parameter holds a NaN
        or an infinity. A save that fails writing (a full disk, an I/O error, a file size
        limit, a permission) raises ``CheckpointError`` on every rank naming the
        directory and each rank's OS error; nothing is published (``root/latest`` still
        names the previous checkpoint) and the partial directory is removed
        (``docs/fault-tolerance.md``).
        """
        self._refuse_if_failed("save")
        with self._watched(f"save of step {step}", patient=True):
            self.wait_parameters("save")
            return self._checkpoints().save(root, optimizer, step=step, scheduler=scheduler, extra=extra,
                                            async_save=async_save)

    def load(self, path: str, optimizer: torch.optim.Optimizer | None = None, scheduler=None) -> tuple[int, Any]:
        """Load a checkpoint saved at any layout; returns ``(step, extra)``.

        Collective: every rank calls it. ``path``: a checkpoint root (its
        ``latest``) or one ``step-N`` directory. Parameters and ``optimizer``'s
        state are resharded to this program's layout; the random streams continue
        where they were when the layout is the same. Nothing is read until the
        checkpoint has been checked against this program; a problem any rank finds
        raises ``CheckpointError`` on every rank.
        """
        self._refuse_if_failed("load")
        with self._watched(f"load of {path}", patient=True):
            self.wait_parameters("load")  # a gather finishing after the load would overwrite what it read
            step, extra = self._checkpoints().load(path, optimizer, scheduler)
        self.step_checks.loaded(step)
        return step, extra

    def _report_failed_save(self) -> None:
        """Raise here, on every rank, an asynchronous save that failed since it started (``CheckpointError``),
        rather than at the next save. Collective while a save is in flight: one small all-reduce."""
        if "_checkpointer" in self.__dict__ and self._checkpointer.unsettled():
            with self._watched("the check of the asynchronous save in flight"):
                self._checkpointer.report_failed_save(self.device)

    def _checkpoints(self) -> "Checkpointer":
        """This engine's checkpoints, made at the first save or load (collective: creates their group).
        Imported here: ``torch.distributed.checkpoint`` takes a second to import, and most runs never save."""
        from autopar.runtime.checkpoint.checkpointer import Checkpointer

        if "_checkpointer" not in self.__dict__:
            self._checkpointer = Checkpointer(self.holdings, self.random_stream, self._watched)
        return self._checkpointer
