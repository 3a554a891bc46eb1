"""One rank's training engine: its chunks' parameter shards and the schedule interpreter.

``train_step(*inputs, *targets)`` takes the global batch (the same on every
rank; this data-parallel replica's slice is kept) or this replica's own batch
(a data loader per replica, ``engine.dp_rank`` of ``engine.dp_size``), moves
it to the engine's device, cuts it into microbatches and runs this stage's
actions from the lowered schedule (``autopar/schedules/``). ``eval_step`` runs
the forward-only form of the schedule (``program.eval_schedule``) over each
chunk's evaluation graph (dropout removed, training flags off; made at compile
time) under ``torch.no_grad()``: no context kept, no gradient touched. A table
maps each action kind to its handler, the same in both steps:

- ``F c.i``  forward of chunk c on microbatch i; in a training step, inputs that
             arrived from the previous stage become leaves that require grad
             and the context is kept until ``B c.i`` (the last chunk weights its
             loss: by n_i / N, its share of the counted targets, for a token loss;
             ``runtime/engine/loss_weights.py``); in an evaluation step nothing is kept;
- ``B c.i``  backward of the kept outputs with the received output gradients;
             the gradients of the inputs are what the previous stage needs;
             with ``split_backward`` on, the input gradients only (B), the
             weights' left to ``_weight_backward`` (W) and their context kept
             in ``StepState.wctx`` (``runtime/optim/split_backward.py``); on when the
             schedule splits its backwards (ZB-H1, ZB-V);
- ``W c.i``  the weights' gradients of that B, into ``.grad``; after a chunk's
             last W its parameters' data-parallel reduction starts;
- ``SF/RF/SB/RB``  point-to-point; each handler adds its operations to the
             open batch, and a run of consecutive ones is posted as one
             ``batch_isend_irecv`` so no ordering of pairs can deadlock.

What a step holds between actions (kept contexts, arrived tensors, receives in
flight, the loss) lives in one ``StepState``, made per step and dropped after
it. An action that raises is re-raised as ``ActionError`` naming the rank, its
(pp, dp, tp) coordinates and the action, with the schedule grid around it (the
action marked ``[..]``). With peers, the failure is published to them and every
rank raises the same root cause; a failed engine refuses further steps
(``runtime/engine/failures.py``).

Every tensor the engine makes lives on its device (``self.device``: the device
of its parameters; the current GPU when the process group is NCCL), so no
collective ever runs on a CPU tensor under NCCL.

With tensor parallelism, a boundary tensor that is identical on the t ranks of
a stage is sent as 1/t slices (rank j of stage s to rank j of stage s+1) and
all-gathered on arrival (scatter/gather). After the last backward, gradients
of parameters that several stages hold (a tied embedding and LM head) are
summed across those stages. Gradients accumulate into ``.grad`` as with
``loss.backward()``: call ``optimizer.step()`` and ``zero_grad()`` around.

Random ops (dropout) draw from the engine's own random stream, not the
process's default generator: one seed, ``torch.initial_seed()`` of global rank
0, offset per pipeline stage and data-parallel replica. So stage 1 does not
repeat stage 0's masks on its own layers, replicas draw independent masks for
their different samples (as one device drawing for the whole batch would), and
the t ranks of a stage draw identically for the values they all hold (split
values get per-rank streams from ``comm.tp_rng_call``). Recomputation replays
the same masks: the checkpoint saves and restores this stream's state. An
evaluation step puts the stream back as it found it, so a training step draws
the same masks with or without evaluations before it (and evaluations repeat).
"""

from __future__ import annotations

import contextlib
import secrets
import time
from collections import defaultdict
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
import torch.nn as nn

from autopar.core.activation_recompute import count_kept_bytes
from autopar.core.comm import (TPGroup, all_gather, keeping_gathered_slices, release_regathered, seed_forked,
                               whole_from_shards)
from autopar.core.errors import AutoparError
from autopar.core.mesh import Mesh
from autopar.core.tensor_placement import Shard
from autopar.runtime.engine.batch_checks import REFUSED, IdProblem, agree, cast_dtypes, find_id_problem, id_error
from autopar.runtime.engine.device_graphs import on_device
from autopar.runtime.engine.eval_outputs import LogitsOutput, askers, gather_logits
from autopar.runtime.hf.export import RankHoldings, save_pretrained
from autopar.runtime.engine.failures import EngineFailedError, Failure, FailureBoard, failure_timeout
from autopar.runtime.optim.gradient_sync import GradientSync
from autopar.runtime.engine.loss_weights import StepWeights, equal_weights, step_weights, token_counts
from autopar.runtime.optim.split_backward import SplitBackward
from autopar.compiler.state_keys import state_sources, untraced_value
from autopar.runtime.engine.timeline import (Event, StepHistory, aligned_steps, clock_offset, gather_objects,
                                      trace_metadata, write_chrome_trace)
from autopar.schedules import Action, Kind, Schedule

if TYPE_CHECKING:
    from autopar.compiler.program import Program
    from autopar.core.chunks import Boundary, Chunk
    from autopar.runtime.checkpoint.checkpointer import Checkpointer, SaveHandle
    from autopar.runtime.optim.distributed_optimizer import DistributedOptimizer

__all__ = ["RankEngine", "StepState", "ActionError", "EngineFailedError", "rank_device"]

Key = tuple[int, int]
"""(chunk, microbatch)."""

Finish = Callable[[], torch.Tensor]
"""Turns a filled receive buffer into the boundary tensor (all-gathers a scattered one)."""


class ActionError(AutoparError, RuntimeError):
    """An action of this rank's schedule raised; ``__cause__`` is the original exception.

    The message names the rank, its (pp, dp, tp) coordinates and the action(s),
    and ends with the schedule grid around them, marked ``[..]``. With peers, the
    message starts with the root cause (the first failure any rank published:
    ``root``) and, on the other ranks, says where this rank saw it.
    """

    def __init__(self, message: str, rank: int, coords: tuple[int, int, int],
                 actions: Iterable[Action], marks: Iterable[tuple[int, int]], root: Failure | None = None) -> None:
        super().__init__(message)
        self.rank = rank
        self.coords = coords
        """(pp, dp, tp) of the rank."""
        self.actions = tuple(actions)
        """The failing action, or the run of sends/receives that was being posted (empty: the
        failure came outside the schedule's actions, or a peer's was seen at the step's end)."""
        self.marks = tuple(marks)
        """(stage, index in the stage's action list) of each failing action."""
        self.root = root
        """The root cause: the failure published first (this rank's own when it is the root);
        None without peers."""

    @property
    def root_rank(self) -> int:
        """The rank that failed first (this one without peers)."""
        return self.rank if self.root is None else self.root.rank

    def __reduce__(self):
        return type(self), (str(self), self.rank, self.coords, self.actions, self.marks, self.root)


def rank_device(tensors: Iterable[torch.Tensor]) -> torch.device:
    """The device a rank computes on: the one device of ``tensors``; with none, the current
    GPU when the default process group is NCCL, else the CPU."""
    devices = {t.device for t in tensors}
    if len(devices) > 1:
        raise ValueError(f"a rank's parameters must all be on one device, got {sorted(map(str, devices))}")
    if devices:
        return devices.pop()
    if _nccl():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _nccl() -> bool:
    return dist.is_initialized() and dist.get_backend() == "nccl"


@dataclass
class _Receive:
    """The receives of one RF/RB action in flight: its own works and how to finish each buffer."""

    works: list
    finishes: list[Finish | None]
    """One per boundary; None where nothing is received (no gradient flows)."""

    def wait(self) -> list[torch.Tensor | None]:
        for work in self.works:
            work.wait()
        return [f() if f is not None else None for f in self.finishes]


@dataclass
class _CommBatch:
    """The point-to-point operations of a run of consecutive SF/RF/SB/RB actions."""

    ops: list = field(default_factory=list)
    """``dist.P2POp`` in the order the handlers added them."""
    receives: list[tuple[Action, list[int], list[Finish | None]]] = field(default_factory=list)
    """(RF/RB action, indices of its ops in ``ops``, one finish per boundary)."""


@dataclass
class StepState:
    """What one ``train_step`` or ``eval_step`` holds between actions; made per step, dropped after it.

    Keyed by ``(chunk, microbatch)``. Boundary tensors are one microbatch's,
    local to this tensor-parallel rank (shapes as the chunk's ``Boundary.shape``),
    on the engine's device.
    """

    schedule: Schedule
    """What the step runs: the training schedule, or its forward-only form."""
    training: bool
    """A training step (contexts kept for the backward) or an evaluation step (nothing kept)."""
    micro: list[list[torch.Tensor]]
    """[microbatch][input or target]: this replica's slices of the batch."""
    m: int
    """Microbatches per step."""
    loss_sum: torch.Tensor
    """Float64 scalar: the sum of the last chunk's microbatch losses, each times its weight."""
    param_ptrs: set[int]
    """Storage addresses of the parameters: weights autograd saves are not activations."""
    weights: StepWeights | None = None
    """Each microbatch's weight in the loss and the backward's seed (``runtime/engine/loss_weights.py``)."""
    events: list[Event] = field(default_factory=list)
    """Measured timeline of the step (``engine.events``)."""
    ctx: dict[Key, tuple[list[torch.Tensor], list[torch.Tensor]]] = field(default_factory=dict)
    """F done, B pending: (the chunk's inputs as leaves, its outputs; the last chunk's: [loss * seed])."""
    outgoing: dict[Key, list[torch.Tensor]] = field(default_factory=dict)
    """F done, SF pending: the outputs to send to the next chunk's stage."""
    saved: dict[Key, int] = field(default_factory=dict)
    """Bytes autograd keeps for each pending backward."""
    fwd_in: dict[Key, list[torch.Tensor]] = field(default_factory=dict)
    """Inputs of a coming F: received, or handed over by the previous chunk on this stage."""
    grad_out: dict[Key, list[torch.Tensor | None]] = field(default_factory=dict)
    """Gradients of a chunk's outputs for its coming B (None where no gradient flows)."""
    grad_in: dict[Key, list[torch.Tensor | None]] = field(default_factory=dict)
    """Gradients of a chunk's inputs, for SB to send to the previous stage."""
    b_done: dict[int, int] = field(default_factory=lambda: defaultdict(int))
    """Chunk -> backwards run; at m its parameters' gradients are final (unless the backward splits)."""
    splits: dict[Key, SplitBackward] = field(default_factory=dict)
    """F done, B pending, the backward splitting: the recorded forward each B splits."""
    wctx: dict[Key, SplitBackward] = field(default_factory=dict)
    """B done, W pending: what the weights' gradients still need."""
    w_done: dict[int, int] = field(default_factory=lambda: defaultdict(int))
    """Chunk -> weight backwards run; at m its parameters' gradients are final (the backward splitting)."""
    comm: _CommBatch = field(default_factory=_CommBatch)
    """The batch the communication handlers of the current run add to."""
    pending_sends: list[tuple[Any, torch.Tensor]] = field(default_factory=list)
    """(work, tensor) of sends in flight: the tensor must live until the work completes."""
    pending_recv: dict[tuple[Kind, int, int], _Receive] = field(default_factory=dict)
    """RF/RB ``action.key`` -> its receives in flight, waited for by the F or B that consumes them."""
    origin: float = 0.0
    """``time.perf_counter()`` when the step's first action started: its events' zero."""
    waits: list[tuple[float, float]] = field(default_factory=list)
    """(start, end) perf_counter times the current F or B waited for its received tensors."""
    number: int = 0
    """The engine's step number (train and eval steps counted together, from 1)."""
    global_batch: bool = False
    """The batch was the global one (every replica's rows), not this replica's own."""
    at: list[int] = field(default_factory=list)
    """Indices in this stage's action list of what runs now (empty: outside the actions)."""
    phase: str = "the step's start"
    """What runs outside the actions (a failure there names it)."""
    progress: float = field(default_factory=time.monotonic)
    """``time.monotonic()`` when the current action (or phase) started: the failure watch's clock."""
    waiting_for: str | None = None
    """The RF/RB whose tensors the current F or B waits for."""
    logits: dict[int, torch.Tensor] | None = None
    """``eval_step(outputs=True)``: microbatch -> this rank's piece of the logits the last chunk's
    evaluation graph returned; None: not kept."""

    def store(self, kind: Kind) -> dict[Key, list]:
        """Where an RF (``fwd_in``) or RB (``grad_out``) puts what it receives."""
        return self.fwd_in if kind is Kind.RECV_F else self.grad_out

    def take(self, kind: Kind, key: Key) -> list:
        """The tensors of the RF/RB ``kind`` for ``key``; waits for them if still in flight."""
        store = self.store(kind)
        pending = self.pending_recv.pop((kind, *key), None)
        if pending is not None:
            waited_from = time.perf_counter()
            self.waiting_for = f"{'RF' if kind is Kind.RECV_F else 'RB'}{key[0]}.{key[1]}"
            store[key] = pending.wait()
            self.waiting_for = None
            self.waits.append((waited_from, time.perf_counter()))
        return store.pop(key)


class RankEngine(nn.Module):
    """Holds this rank's parameter shards and interprets its schedule."""

    def __init__(self, program: "Program", mesh: Mesh, local_params: dict[str, torch.Tensor],
                 feeds: dict[str, torch.Tensor], bucket_bytes: int = 25 * 2**20):
        super().__init__()
        self.program = program
        self.mesh = mesh
        self.tp = TPGroup.of(mesh.groups.get("tp"), tuple(mesh.tp_members()))
        self.stage = mesh.pp_rank
        self.chunks: dict[int, "Chunk"] = {c.index: c for c in program.chunks_of_stage(self.stage)}
        self.device = rank_device(local_params.values())
        """Where this rank computes: its parameters' device. Every tensor the engine makes lives here."""
        if _nccl() and self.device.type != "cuda":
            raise ValueError(f"the process group's backend is NCCL, but this rank's parameters are on "
                             f"{self.device}: NCCL communicates GPU tensors only (materialize places the "
                             f"shards on the rank's GPU under NCCL; or use the gloo backend)")
        self.device_type = self.device.type
        self.shards = nn.ParameterDict({_key(n): nn.Parameter(t) for n, t in local_params.items()})
        self._feeds = {n: t.to(self.device) if isinstance(t, torch.Tensor) else t for n, t in feeds.items()}
        """Buffers and constants by placeholder, on the engine's device."""
        self.schedule = program.schedule
        self.eval_schedule = program.eval_schedule
        """The forward-only schedule of an evaluation step."""
        self.stats: dict = {}
        self.events: list[Event] = []
        """The last step's measured timeline."""
        self.timelines = StepHistory()
        """The measured timelines of the last training steps (``write_trace`` writes them)."""
        self.runnables = {c: on_device(ch.module, self.device) for c, ch in self.chunks.items()}
        """Chunk -> what runs it: its graph, with recomputation applied at compile time, making its
        tensors on the engine's device."""
        self.eval_runnables = {c: on_device(ch.eval_gm, self.device) for c, ch in self.chunks.items()}
        """Chunk -> what an evaluation step runs: its graph in evaluation mode (``passes/eval_mode.py``)."""
        self.random_seed = self._stream_seed(mesh)
        """Seed of this rank's random stream (dropout); equal on the t ranks of a stage."""
        self._rng_devices = [self.device.index] if self.device.type == "cuda" else []
        with torch.random.fork_rng(devices=self._rng_devices):
            seed_forked(self.random_seed, self._rng_devices)
            self._rng_states = self._get_rng()
        self.grads = GradientSync(program, mesh, {n: self.shards[_key(n)] for n in local_params},
                                  bucket_bytes, device=self.device)
        self.split_backward = program.schedule.splits_backward
        """Whether a backward is split into B (input gradients) and W (weight gradients, by
        ``_weight_backward``): the schedule's choice (ZB-H1 and ZB-V place W actions of their own)."""
        self._ready_after = self._gradients_ready_after(local_params)
        self._chunk_param_names = {c: [program.traced.param_of[ph] for ph in ch.params] for c, ch in self.chunks.items()}
        """Chunk -> the names of the parameters its forward reads."""
        self._param_gathers = None
        """A distributed optimizer's parameter all-gathers (``ParamGathers``), waited for before a read."""

    def gradient_groups(self) -> list[list[str]]:
        """The groups of parameter names whose data-parallel reduction starts together (each final
        after one chunk's last backward), as ``GradientSync.start`` receives them; tied ones aside."""
        return [list(names) for names in self._ready_after.values()]

    def distributed_optimizer(self, optimizer_class: type, params=None, *, elementwise: bool = False,
                              overlap_param_gather: bool = True, **defaults: Any) -> "DistributedOptimizer":
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
        from autopar.runtime.optim.distributed_optimizer import DistributedOptimizer

        if self.grads.sharded is not None:
            raise RuntimeError("this engine already has a distributed optimizer: its gradients are reduce-scattered "
                               "into that optimizer's buffers; make one distributed optimizer per engine")
        optimizer = DistributedOptimizer(self, optimizer_class, params, elementwise=elementwise,
                                         overlap_param_gather=overlap_param_gather, **defaults)
        self.grads.reduce_scatter_into(optimizer.buckets)
        self._param_gathers = optimizer.gathers
        return optimizer

    def wait_parameters(self, where: str = "wait_parameters") -> None:
        """Finish the distributed optimizer's parameter all-gathers still in flight, so the parameters
        hold the last ``step()``'s values (every read of them by the engine does this first; call it
        before reading a tensor of ``engine.parameters()`` kept from earlier). ``where``: recorded."""
        if self._param_gathers is not None:
            self._param_gathers.wait_all(where)

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

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Clear the shards' gradients; reads no parameter, so the all-gathers in flight go on."""
        for p in self.shards.values():
            if p.grad is not None and set_to_none:
                p.grad = None
            elif p.grad is not None:
                p.grad.requires_grad_(False).zero_()

    def _handlers(self) -> dict[Kind, Callable[[Action, StepState], None]]:
        """Action kind -> its handler, called ``handler(action, state)``; a communication handler
        adds its operations to ``state.comm``. Made at the start of each step from the engine's
        methods, so a method wrapped on the instance (instrumentation) is the one dispatched to."""
        return {
            Kind.F: self._forward,
            Kind.B: self._backward,
            Kind.W: self._weight_backward,
            Kind.SEND_F: self._send_outputs,
            Kind.RECV_F: self._recv_inputs,
            Kind.SEND_B: self._send_input_grads,
            Kind.RECV_B: self._recv_output_grads,
        }

    def _gradients_ready_after(self, local_params) -> dict[int, list[str]]:
        """Chunk -> the parameters whose gradients are final after that chunk's last backward.

        A parameter's gradient is final after the last backward of the last local chunk that
        reads it (its last W when the schedule splits backwards): its data-parallel reduction
        starts right then, overlapping the remaining backwards. A parameter two local chunks
        read (ZB-V's V puts a tied embedding and head both on stage 0) waits for the later one.
        """
        program = self.program
        last = Kind.W if self.schedule.splits_backward else Kind.B
        order = [a.chunk for a in self.schedule.actions[self.stage] if a.kind is last]
        last_b = {c: i for i, c in enumerate(order)}
        ready: dict[int, list[str]] = defaultdict(list)
        for name in program.param_names:
            if name in local_params and name not in program.tied_params:
                users = [c for c, ch in self.chunks.items()
                         if any(program.traced.param_of[ph] == name for ph in ch.params)]
                ready[max(users, key=last_b.__getitem__)].append(name)
        return ready

    def _stream_seed(self, mesh: Mesh) -> int:
        """Global rank 0's ``torch.initial_seed()``, offset by this rank's (stage, replica).
        A broadcast over the world: every rank builds its engine (``materialize`` is collective)."""
        # with it, rank 0's token for this engine's failure board (the same broadcast)
        base = torch.tensor([torch.initial_seed() % 2**62, secrets.randbits(62)], dtype=torch.int64,
                            device=self.device)
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.broadcast(base, src=0)
        self._failures = FailureBoard(f"autopar/failure/{int(base[1]):x}", mesh.shape.world)
        """Where this engine's ranks publish a step's failure (``runtime/engine/failures.py``)."""
        self._failed: tuple[int, str, Failure] | None = None
        """(step number, step kind, root cause) once a step failed with peers: steps are refused."""
        self._steps = 0
        """Steps started (train and eval)."""
        self.failure_timeout_s = failure_timeout()
        """Seconds an action may make no progress (waiting for a peer) before this rank fails the step
        with a ``TimeoutError`` its peers raise too: ``AUTOPAR_FAILURE_TIMEOUT``, default 300."""
        replica = mesh.dp_rank + mesh.shape.dp * mesh.pp_rank
        return (int(base[0]) + 1_000_003 * replica) % 2**63

    def _get_rng(self) -> list[torch.Tensor]:
        return [torch.get_rng_state()] + [torch.cuda.get_rng_state(d) for d in self._rng_devices]

    @contextlib.contextmanager
    def _random_stream(self):
        """Run random ops on this rank's stream; the process's default generator is left untouched."""
        with torch.random.fork_rng(devices=self._rng_devices):
            torch.set_rng_state(self._rng_states[0])
            for d, st in zip(self._rng_devices, self._rng_states[1:]):
                torch.cuda.set_rng_state(st, d)
            try:
                yield
            finally:
                self._rng_states = self._get_rng()

    # ------------------------------------------------------------------ stepping
    @property
    def dp_rank(self) -> int:
        """This rank's data-parallel replica (0 .. dp_size - 1): the ``rank`` of its data loader's
        ``DistributedSampler``."""
        return self.mesh.dp_rank

    @property
    def dp_size(self) -> int:
        """Data-parallel replicas: the ``num_replicas`` of each replica's ``DistributedSampler``."""
        return self.mesh.shape.dp

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
        st = self._new_step(batch, self.schedule, training=True)
        with self._failing_together(st):
            self.grads.begin_step(self.stats)
            self._run_actions(st)
            self.timelines.add(st.origin, st.events)
            self._phase(st, "the step's end (sends, gradient reductions, loss)")
            self._wait_sends(st)
            self.wait_parameters("train_step")  # a parameter no chunk read: nothing else waits for it
            self.grads.end_step()
            loss = self._reduce_loss(st)
        return loss

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
        self.wait_parameters("eval_step")
        st = self._new_step(batch, self.eval_schedule, training=False)
        st.logits = {} if outputs else None
        stream = self._rng_states  # random ops left in the evaluation graphs draw from a copy
        with self._failing_together(st):
            try:
                with torch.no_grad():
                    self._run_actions(st)
            finally:
                self._rng_states = stream
            self._phase(st, "the step's end (sends, loss, outputs)")
            self._wait_sends(st)
            loss = self._reduce_loss(st)
            if not outputs:
                return loss
            return loss, gather_logits(self, spec, st.logits, ranks, st.global_batch and self.dp_size > 1)

    def _new_step(self, batch, schedule: Schedule, training: bool) -> StepState:
        """The state of a step over ``batch``; resets ``stats`` and ``events`` to this step's."""
        self._refuse_if_failed("train_step" if training else "eval_step")
        self._steps += 1
        try:
            micro, whole = self._microbatches(batch)
        except (ValueError, TypeError):  # refused here: the other replicas must not wait for this one
            if self._replicas_agree():
                agree(IdProblem(REFUSED, 0, ()), 0, self.mesh.groups["dp"], self.dp_size, self.device)
            raise
        st = StepState(schedule=schedule, training=training, micro=micro, m=self.program.microbatches,
                       weights=self._step_weights(batch, micro, whole),
                       loss_sum=torch.zeros((), dtype=torch.float64, device=self.device),
                       param_ptrs={p.data_ptr() for p in self.shards.values()})
        self.stats = {"bytes_sent": defaultdict(int), "peak_in_flight": 0, "peak_activation_bytes": 0}
        self.events = st.events
        st.number, st.global_batch = self._steps, whole
        return st

    # ------------------------------------------------------------------ failures
    def _refuse_if_failed(self, what: str, read_board: bool = False) -> None:
        """``EngineFailedError`` when a step of this engine failed, here or (``read_board``: one store
        round trip) on a peer: its state is inconsistent and its communication stopped."""
        if self._failed is None and read_board:
            root = self._failures.read()
            if root is not None:  # a peer failed after this rank's last exchange with it
                self._failures.stop()
                self._failed = (self._steps, root.kind, root)
        if self._failed is None:
            return
        number, kind, root = self._failed
        pp, dp, tp = self.mesh.shape.coords(self.mesh.rank)
        raise EngineFailedError(
            f"this engine failed at step {number} ({kind}) on rank {self.mesh.rank} (pp={pp}, dp={dp}, tp={tp}): "
            f"{root.headline()}; its state is inconsistent (sends in flight, partial gradients, peers stopped) "
            f"and its process groups are stopped, so {what} is refused: restart the job and restore the last "
            f"checkpoint with a new engine", root)

    @staticmethod
    def _phase(st: StepState, phase: str) -> None:
        """The step is outside its actions now, in ``phase``."""
        st.at, st.phase, st.progress = [], phase, time.monotonic()

    @contextlib.contextmanager
    def _failing_together(self, st: StepState):
        """Around a step's communicating part: with peers, a watch reads the failure board (and
        bounds a wait by ``failure_timeout_s``); a failure outside the actions is published like an
        action's; a failure a peer published is raised at the step's end if this rank saw none."""
        if not self._failures.shared:
            yield
            return
        watch = self._failures.watch(self.failure_timeout_s, lambda: st.progress,
                                     lambda idle: self._own_failure(st, st.at, TimeoutError(
                                         f"no progress for {idle:.0f} s (engine.failure_timeout_s = "
                                         f"{self.failure_timeout_s:g} s): a peer stopped communicating, or "
                                         f"this rank's work hangs")))
        try:
            with watch:
                yield
            seen = self._failures.read()
            if seen is not None:
                raise self._failure(None, [], st)
        except ActionError:
            raise
        except Exception as e:
            raise self._failure(e, list(st.at), st) from e

    def _own_failure(self, st: StepState, steps: list[int], e: BaseException | None) -> Failure:
        """This rank's failure: at ``steps`` of its action list (or in ``st.phase``), raising ``e``."""
        actions = [st.schedule.actions[self.stage][t] for t in steps]
        if actions:
            what = " ".join(map(str, actions))
            where = f"stage {self.stage}, " + (f"step {steps[0]}" if len(steps) == 1
                                                else f"steps {steps[0]}..{steps[-1]}")
            if st.waiting_for:
                where += f", waiting for {st.waiting_for}"
        else:
            what, where = st.phase, ""
        error = "" if e is None else f"{type(e).__name__}: {e}"
        return Failure(self.mesh.rank, self.mesh.shape.coords(self.mesh.rank), what, where, error, st.number,
                       "train_step" if st.training else "eval_step", tuple((self.stage, t) for t in steps))

    @staticmethod
    def _wait_sends(st: StepState) -> None:
        """Wait for the step's sends in flight (their tensors must live until they complete)."""
        for work, _ in st.pending_sends:
            work.wait()
        st.pending_sends = []

    def _run_actions(self, st: StepState) -> None:
        """Run this stage's actions of ``st.schedule`` in order, recording each compute action and
        each batch of point-to-point operations in ``st.events``; an F or B that waited for a
        received tensor gets a ``wait`` event (``RF2.0``) and starts when the tensor was there."""
        actions = st.schedule.actions[self.stage]
        rank = self.mesh.rank
        handlers = self._handlers()
        t0 = st.origin = time.perf_counter()
        i = 0
        while i < len(actions):
            j = i + 1
            if actions[i].is_comm:
                while j < len(actions) and actions[j].is_comm:
                    j += 1
            start = time.perf_counter() - t0
            st.waits.clear()
            name, kind = self._run(st, handlers, actions, i, j)
            end = time.perf_counter() - t0
            for waited_from, waited_to in st.waits:
                self.events.append(Event(rank, "wait", "R" + name, waited_from - t0, waited_to - t0))
                start = waited_to - t0
            self.events.append(Event(rank, kind, name, start, end))
            i = j

    def _run(self, st: StepState, handlers: dict, actions: list[Action], i: int, j: int) -> tuple[str, str]:
        """Run ``actions[i:j]``: one compute action, or a run of communication actions posted as
        one batch. Returns the event's (name, kind); a failure is re-raised as ``ActionError``."""
        at = st.at = [i]
        st.progress = time.monotonic()
        try:
            if actions[i].is_compute:
                handlers[actions[i].kind](actions[i], st)
                return str(actions[i]), actions[i].kind.value
            st.comm = _CommBatch()
            for k in range(i, j):
                at = st.at = [k]
                handlers[actions[k].kind](actions[k], st)
            at = st.at = list(range(i, j))  # posting the batch: it is the run's, not one action's
            self._post(st)
            return " ".join(map(str, actions[i:j])), "comm"
        except Exception as e:
            raise self._failure(e, at, st) from e

    def _failure(self, e: Exception | None, steps: list[int], st: StepState) -> ActionError:
        """``e`` with context: the rank, its coordinates, the action(s) at ``steps`` (indices in this
        stage's action list of ``st.schedule``; none: ``st.phase``) and the schedule grid around them,
        marked.

        With peers: the failure is published (unless one is already: that one is the root cause,
        and this rank says where it saw it), this rank's communication is stopped so that none of
        its peers keeps waiting on it, and the engine refuses further steps. ``e`` None: a peer's
        failure seen at the step's end."""
        own = self._own_failure(st, steps, e)
        root = own
        if self._failures.shared:
            root = self._failures.publish(own) if e is not None else (self._failures.read() or own)
            self._failures.stop()
            self._failed = (st.number, own.kind, root)
        pp, dp, tp = own.coords
        if root == own:
            message = own.headline(marked=True)
        else:
            seen = ("at the end of its step" if e is None and not steps else
                    f"while running {own.what}{f' ({own.where})' if own.where else ''}")
            first_line = own.error.splitlines()[0][:300] if own.error else ""
            message = (f"{root.headline(marked=root.kind == own.kind)}\nseen from rank {own.rank} "
                       f"(pp={pp}, dp={dp}, tp={tp}) {seen}{f': {first_line}' if first_line else ''}")
        marks = list(own.marks) + (list(root.marks) if root != own and root.kind == own.kind else [])
        if marks:
            ts = [t for _, t in marks]
            message += "\n" + st.schedule.format_grid(marks, columns=(min(ts) - 8, max(ts) + 9))
        actions = [st.schedule.actions[self.stage][t] for t in steps]
        return ActionError(message, self.mesh.rank, own.coords, actions, own.marks,
                           root if self._failures.shared else None)

    def _microbatches(self, batch) -> tuple[list[list[torch.Tensor]], bool]:
        """([microbatch][input or target]: this replica's slices, on the engine's device; whether the
        batch is the global one).

        Each tensor is the global batch (leading size d*m*b: this replica's rows are kept) or this
        replica's own (m*b); all of the batch's tensors the same way (one and the same when d = 1).
        Each has its traced dtype, or is an integer tensor the graph uses as indices only, cast to it
        (``runtime/engine/batch_checks.py``).
        """
        traced = self.program.traced
        names = traced.input_names + traced.target_names
        if len(batch) != len(names):
            raise TypeError(f"expected {len(traced.input_names)} input(s) and {len(traced.target_names)} "
                            f"target(s), got {len(batch)} tensors")
        phs = {n.name: n for n in traced.gm.graph.nodes if n.op == "placeholder"}
        m = self.program.microbatches
        wants = [tuple(phs[name].meta["val"].shape) for name in names]
        whole = [self._is_global_batch(name, tuple(x.shape), want) for name, x, want in zip(names, batch, wants)]
        if len(set(whole)) > 1:
            kinds = ", ".join(f"'{n}' {tuple(x.shape)}: {'global' if g else 'this replica'}"
                              for n, x, g in zip(names, batch, whole))
            raise ValueError(f"the batch mixes the global batch and this replica's ({kinds}): pass every "
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
        raise ValueError(f"batch tensor '{name}' has shape {shape}, but the program expects {expected}")

    def _replicas_agree(self) -> bool:
        """Whether the replicas exchange their batch checks and target counts each step (``agree``):
        with d > 1, when the loss counts its targets or the batch holds ids."""
        roles = self.program.batch_roles
        tokens = roles.loss is not None and self.program.config.loss_reduction == "tokens"
        return self.dp_size > 1 and (tokens or bool(roles.ids))

    def _step_weights(self, batch, micro: list[list[torch.Tensor]], whole: bool) -> StepWeights:
        """Ids checked against what they index and the microbatches' weights, before the step's first action.

        The ids of ``batch`` as passed (the global batch on every rank, or this replica's own) are
        checked with a min/max each; a token loss counts each microbatch's targets. With d > 1, one
        all-gather over dp of a few numbers (``_replicas_agree``) gives every rank the count N of the
        global batch and any replica's problem, so every rank raises alike (with the global batch
        every rank checked all of it)."""
        roles, d, m = self.program.batch_roles, self.dp_size, self.program.microbatches
        traced = self.program.traced
        names = traced.input_names + traced.target_names
        problem = find_id_problem(roles.ids, dict(zip(names, batch)))
        if problem is not None and whole:
            raise id_error(problem, roles, whole, d)
        tokens = roles.loss is not None and self.program.config.loss_reduction == "tokens"
        counts = []
        if tokens:
            if "_loss_targets" not in self.__dict__:  # a plain attribute, not a submodule of the engine
                self.__dict__["_loss_targets"] = on_device(roles.loss.targets, self.device)
            counts = token_counts(roles.loss, self.__dict__["_loss_targets"], [dict(zip(names, mb)) for mb in micro])
        total = sum(counts)
        if self._replicas_agree():
            problem, total = agree(problem, total, self.mesh.groups["dp"], d, self.device)
        if problem is not None:
            raise id_error(problem, roles, whole, d)
        return step_weights(counts, total, d) if tokens else equal_weights(m, d)

    def _chunk_args(self, chunk: "Chunk", micro_i: list[torch.Tensor], inputs: list[torch.Tensor]) -> list:
        """The chunk's graph arguments: the tp group, its parameter shards, its feeds, its inputs."""
        traced = self.program.traced
        batch = dict(zip(traced.input_names + traced.target_names, micro_i))
        args = [self.tp]
        for name in chunk.params:
            args.append(self.shards[_key(traced.param_of[name])])
        for name in chunk.feeds:
            args.append(batch[name] if name in batch else self._feeds[name])
        return args + inputs

    # ------------------------------------------------------------------ compute
    def _forward(self, a: Action, st: StepState) -> None:
        """``F c.i``: run the chunk; in a training step keep its context for ``B c.i``. Hand the
        outputs to the next chunk when it lives on this stage, else keep them for ``SF``."""
        chunk = self.chunks[a.chunk]
        key = (a.chunk, a.microbatch)
        if self._param_gathers is not None:  # the chunk's first forward of a step waits for its parameters
            self._param_gathers.wait_for(self._chunk_param_names[a.chunk], str(a))
        inputs = [] if a.chunk == 0 else [t.detach().requires_grad_(st.training and b.requires_grad)
                                          for t, b in zip(st.take(Kind.RECV_F, key), chunk.inputs)]
        outs = self._run_chunk(st, key, self._chunk_args(chunk, st.micro[a.microbatch], inputs))
        if a.chunk == self.program.split.n - 1:
            weight = st.weights.loss[a.microbatch]
            if weight:  # 0: a microbatch that counts no target (its mean is 0/0) adds nothing
                st.loss_sum += outs[0].detach().double() * weight
            if st.logits is not None:  # an evaluation step asked for its outputs
                st.logits[a.microbatch] = outs[1]
            outs = [outs[0] * st.weights.seed[a.microbatch]]  # what the backward differentiates
        elif (a.chunk + 1) in self.chunks:  # next chunk on this stage: hand over directly
            st.fwd_in[(a.chunk + 1, a.microbatch)] = [o.detach().to(b.dtype) for o, b in zip(outs, chunk.outputs)]
        else:
            st.outgoing[key] = list(outs)
        if st.training:
            st.ctx[key] = (inputs, list(outs))
        # in flight: F done, backward not (its B; its W when the backward splits)
        self.stats["peak_in_flight"] = max(self.stats["peak_in_flight"], len(st.ctx) + len(st.wctx))
        held = sum(st.saved.values())  # bytes autograd keeps for the pending backwards (and W's)
        held += sum(split.held_bytes() for split in st.wctx.values())
        self.stats["peak_activation_bytes"] = max(self.stats["peak_activation_bytes"], held)

    def _run_chunk(self, st: StepState, key: Key, args: list):
        """Run chunk ``key[0]`` (its evaluation graph in an evaluation step) under autocast and the
        random stream; count in ``st.saved[key]`` the activation bytes autograd keeps for its
        backward (checkpointed regions: their kept inputs)."""
        if not st.training:
            with self._autocast(), self._random_stream():
                return self.eval_runnables[key[0]](*args)
        saved = 0

        def pack(t: torch.Tensor):
            nonlocal saved
            if t.data_ptr() not in st.param_ptrs:  # weights are not activations
                saved += t.numel() * t.element_size()
            return t

        if self.split_backward:
            split = st.splits[key] = SplitBackward(st.param_ptrs)
            with split.recording(), keeping_gathered_slices(), self._autocast(), self._random_stream():
                outs = self.runnables[key[0]](*args)
            st.saved[key] = split.held_bytes()
            return outs
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), self._autocast(), \
                keeping_gathered_slices(), self._random_stream(), count_kept_bytes() as kept:
            outs = self.runnables[key[0]](*args)
        st.saved[key] = saved + kept.nbytes
        return outs

    def _backward(self, a: Action, st: StepState) -> None:
        """``B c.i``: backward of the kept outputs with their gradients; the inputs' gradients go
        to the previous chunk (directly when it lives on this stage, else by ``SB``)."""
        key = (a.chunk, a.microbatch)
        inputs, outs = st.ctx.pop(key)
        st.saved.pop(key, None)
        chunk = self.chunks[a.chunk]
        last = a.chunk == self.program.split.n - 1
        if last:  # seed 0 (a microbatch that counts no target): nothing to differentiate, zero gradients
            tensors, grads = (outs, [None]) if st.weights.seed[a.microbatch] else ([], [])
        else:
            got = st.take(Kind.RECV_B, key)
            pairs = [(o, g) for o, g, b in zip(outs, got, chunk.outputs) if b.requires_grad and o.requires_grad]
            tensors, grads = [p[0] for p in pairs], [p[1] for p in pairs]
        if self.split_backward:
            split = st.wctx[key] = st.splits.pop(key)
            got = split.input_grads(tensors, grads, inputs)
            release_regathered()  # W gathers again the slices its weight GEMMs read
            in_grads = [g if b.requires_grad else None for g, b in zip(got, chunk.inputs)]
        else:
            if tensors:
                torch.autograd.backward(tensors, grads)
            in_grads = [x.grad if b.requires_grad else None for x, b in zip(inputs, chunk.inputs)]
        if last and not tensors:
            in_grads = [torch.zeros_like(x) if b.requires_grad else None for x, b in zip(inputs, chunk.inputs)]
        st.b_done[a.chunk] += 1
        if st.b_done[a.chunk] == st.m and not self.split_backward:
            self.grads.start(self._ready_after.get(a.chunk, []))
        if a.chunk > 0 and (a.chunk - 1) in self.chunks:
            st.grad_out[(a.chunk - 1, a.microbatch)] = in_grads
        elif a.chunk > 0:
            st.grad_in[key] = in_grads

    def _weight_backward(self, a: Action, st: StepState) -> None:
        """``W c.i``: the weights' gradients of chunk c on microbatch i, after its ``B c.i`` split
        the backward; they accumulate into ``.grad``. After the chunk's last W its parameters'
        data-parallel reduction starts."""
        key = (a.chunk, a.microbatch)
        split = st.wctx.pop(key, None)
        if split is None:
            raise RuntimeError(f"W {a.chunk}.{a.microbatch}: no split backward pending for chunk {a.chunk} "
                               f"microbatch {a.microbatch} (its B must run first, with split_backward on)")
        split.weight_grads()
        st.w_done[a.chunk] += 1
        if st.w_done[a.chunk] == st.m:
            self.grads.start(self._ready_after.get(a.chunk, []))

    # ------------------------------------------------------------ point-to-point
    def _send_outputs(self, a: Action, st: StepState) -> None:
        """``SF c.i``: the chunk's outputs (kept by ``F c.i``) to the next stage."""
        outs = st.outgoing.pop((a.chunk, a.microbatch))
        peer = self.mesh.peer(a.peer)
        for idx, (t, b) in enumerate(zip(outs, self.chunks[a.chunk].outputs)):
            st.comm.ops.append(self._send(t.detach(), b, peer, _tag(a, idx), a))

    def _send_input_grads(self, a: Action, st: StepState) -> None:
        """``SB c.i``: the gradients of the chunk's inputs to the previous stage; zeros (on the
        engine's device) for an input that got no gradient."""
        grads = st.grad_in.pop((a.chunk, a.microbatch))
        peer = self.mesh.peer(a.peer)
        for idx, (g, b) in enumerate(zip(grads, self.chunks[a.chunk].inputs)):
            if b.requires_grad:
                g = g if g is not None else torch.zeros(b.shape, dtype=b.dtype, device=self.device)
                st.comm.ops.append(self._send(g, b, peer, _tag(a, idx), a))

    def _recv_inputs(self, a: Action, st: StepState) -> None:
        """``RF c.i``: the chunk's inputs from the previous stage."""
        self._add_receive(st, a, list(self.chunks[a.chunk].inputs))

    def _recv_output_grads(self, a: Action, st: StepState) -> None:
        """``RB c.i``: the gradients of the chunk's outputs (those that carry one) from the next stage."""
        self._add_receive(st, a, [b if b.requires_grad else None for b in self.chunks[a.chunk].outputs])

    def _add_receive(self, st: StepState, a: Action, boundaries: list["Boundary | None"]) -> None:
        peer = self.mesh.peer(a.peer)
        mine, finishes = [], []
        for idx, b in enumerate(boundaries):
            if b is None:
                finishes.append(None)
                continue
            op, finish = self._recv(b, peer, _tag(a, idx))
            mine.append(len(st.comm.ops))
            st.comm.ops.append(op)
            finishes.append(finish)
        st.comm.receives.append((a, mine, finishes))

    def _post(self, st: StepState) -> None:
        """Post the run's operations as one ``batch_isend_irecv``.

        Sends complete in the background (waited for at the end of the step); an action's
        receives are waited for only by the F or B that consumes them, so peers never meet in
        lock-step.
        """
        batch = st.comm
        if not batch.ops:
            for a, _, finishes in batch.receives:
                st.store(a.kind)[(a.chunk, a.microbatch)] = [None for _ in finishes]
            return
        works = dist.batch_isend_irecv(batch.ops)
        if len(works) != len(batch.ops):  # NCCL coalesces a batch into one work: wait for it here
            for work in works:
                work.wait()
            for a, _, finishes in batch.receives:
                st.store(a.kind)[(a.chunk, a.microbatch)] = _Receive([], finishes).wait()
            return
        for op, work in zip(batch.ops, works):
            if op.op is dist.isend:
                st.pending_sends.append((work, op.tensor))
        for a, mine, finishes in batch.receives:
            # only this action's own receives: waiting on the batch's others could wait on a
            # tensor the peer sends only after it gets something from us
            st.pending_recv[a.key] = _Receive([works[i] for i in mine], finishes)

    def _scatter_gather(self, b: "Boundary") -> bool:
        return (self.program.config.scatter_gather and self.tp.size > 1 and b.replicated
                and b.numel % self.tp.size == 0)

    def _send(self, t: torch.Tensor, b: "Boundary", peer: int, tag: int, a: Action):
        t = t.to(b.dtype).contiguous()  # under autocast a boundary may be bf16: send its declared dtype
        if self._scatter_gather(b):
            t = t.reshape(self.tp.size, -1)[self.tp.rank].contiguous()
        self.stats["bytes_sent"][(self.stage, a.peer)] += t.numel() * t.element_size()
        return dist.P2POp(dist.isend, t, peer, tag=tag)

    def _recv(self, b: "Boundary", peer: int, tag: int) -> tuple[Any, Finish]:
        """A receive of boundary ``b`` into a buffer on the engine's device: ``b.shape``, or its
        1/t slice (flat, ``b.numel // t``) all-gathered over tp by the finish."""
        if self._scatter_gather(b):
            buf = torch.empty(b.numel // self.tp.size, dtype=b.dtype, device=self.device)

            def finish(buf=buf, b=b):
                return all_gather(buf, self.tp, 0, None).reshape(b.shape)
        else:
            buf = torch.empty(b.shape, dtype=b.dtype, device=self.device)

            def finish(buf=buf):
                return buf
        return dist.P2POp(dist.irecv, buf, peer, tag=tag), finish

    # ------------------------------------------------------------- data parallel
    def _autocast(self):
        if self.program.config.precision == "bf16":
            return torch.autocast(self.device_type, dtype=torch.bfloat16)
        return contextlib.nullcontext()

    def clip_grad_norm_(self, max_norm: float) -> float:
        """Clip all gradients by their global 2-norm over every rank; returns the norm before clipping."""
        self._refuse_if_failed("clip_grad_norm_")
        return self.grads.clip_norm_(max_norm, self.tp.rank, self.stage)

    def _reduce_loss(self, st: StepState) -> float:
        """The step's loss: the weighted sum of the microbatch losses (``runtime/engine/loss_weights.py``), from
        the last stage to the others, summed over the replicas (their weights sum to one)."""
        loss = st.loss_sum.reshape(1)
        if self.mesh.shape.pp > 1:  # the stage of the last chunk (stage 0 in ZB-V's V)
            last = self.mesh.peer(self.program.stage_of_chunk(self.program.split.n - 1))
            dist.broadcast(loss, src=last, group=self.mesh.groups["pp"])
        if self.mesh.shape.dp > 1:
            dist.all_reduce(loss, group=self.mesh.groups["dp"])
        return float(loss)

    def write_trace(self, path: str, steps: int | None = 1) -> None:
        """Write the last ``steps`` training steps (None: all kept, ``engine.timelines``) of every
        rank as one Chrome/Perfetto trace on rank 0's clock, with the schedule, mesh and message
        sizes in its ``"autopar"`` object (``autopar simulate --measured`` reads it).

        Collective: every rank calls it; rank 0 writes ``path``.
        """
        self._refuse_if_failed("write_trace")
        offset = clock_offset(self.device)
        per_rank = gather_objects((self.mesh.rank, offset, self.timelines.last(steps)))
        if not dist.is_initialized() or dist.get_rank() == 0:
            events, step_of = aligned_steps(per_rank)
            meta = trace_metadata(self.program, self.mesh) | {"steps": sorted(set(step_of))}
            write_chrome_trace(events, path, steps=step_of, metadata=meta)

    # ---------------------------------------------------------------- parameters
    def named_local_parameters(self):
        """(original name, local shard) of every parameter this rank holds (the all-gathers of a
        distributed optimizer's step done)."""
        self.wait_parameters("named_local_parameters")
        for name in self.program.param_names:
            if _key(name) in self.shards:
                yield name, self.shards[_key(name)]

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """The model's ``state_dict()``, whole, on every rank, on the engine's device: exactly its keys
        in its order. Parameters under every name the model gives them (tied weights twice),
        gathered over tp, then over pp; persistent buffers; non-persistent buffers (a rotary
        ``inv_freq``) are not part of it, as in the model's own ``state_dict()``."""
        self._refuse_if_failed("full_state_dict")
        self.wait_parameters("full_state_dict")
        params = self._gather(lambda p: p.detach())
        out = {}
        for source in state_sources(self.program):
            if source.kind == "param":
                out[source.key] = params[source.key]
            elif source.kind == "buffer":
                out[source.key] = self._feeds[source.name].clone()
            else:
                out[source.key] = untraced_value(self.program, source, self.device)
        return out

    def full_grads(self) -> dict[str, torch.Tensor]:
        """Full gradients under every original parameter name, on every rank (with a distributed
        optimizer: the reduced gradients, all-gathered from the replicas' shards)."""
        self._refuse_if_failed("full_grads")
        if self.grads.sharded is not None:
            reduced = self.grads.reduced_grads()
            name_of = {id(p): n for n, p in self.named_local_parameters()}
            return self._gather(lambda p: reduced[name_of[id(p)]])
        return self._gather(lambda p: p.grad if p.grad is not None else torch.zeros_like(p))

    def _gather(self, get) -> dict[str, torch.Tensor]:
        """``get(shard)`` of every parameter, whole, on every rank, on the engine's device:
        all-gathered over tp (sharded ones), then broadcast over pp from the first stage holding it."""
        program = self.program
        dtypes = self._param_dtypes()
        out = {}
        for name in program.param_names:
            local = self.shards[_key(name)] if _key(name) in self.shards else None
            value = get(local) if local is not None else None
            spec = program.param_spec(name)
            if value is not None and isinstance(spec, Shard):
                value = whole_from_shards(value, self.tp, spec.dim, spec.segments, program.full_shape(name)[spec.dim])
            if self.mesh.shape.pp > 1:
                value = self._from_owner(name, value, dtypes[name])
            for alias in program.traced.aliases.get(name, [name]):
                out[alias] = value.clone()
        return out

    def _from_owner(self, name: str, value: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor:
        """Parameter ``name`` (full shape, ``dtype``) broadcast over pp from the first stage holding
        it; ``value`` is this rank's copy on that stage, ignored elsewhere."""
        owner = self.program.param_stages[name][0]
        if self.stage == owner:
            buf = value.to(dtype).contiguous()
        else:
            buf = torch.empty(self.program.full_shape(name), dtype=dtype, device=self.device)
        dist.broadcast(buf, src=self.mesh.peer(owner), group=self.mesh.groups["pp"])
        return buf

    def _param_dtypes(self) -> dict[str, torch.dtype]:
        """Parameter name -> its dtype as traced (the same on every stage, held or not)."""
        traced = self.program.traced
        phs = {n.name: n for n in traced.gm.graph.nodes if n.op == "placeholder"}
        return {name: phs[ph].meta["val"].dtype for ph, name in traced.param_of.items()}

    # ------------------------------------------------------------------ export
    def save_pretrained(self, path: str) -> list[str]:
        """Write the model as a HuggingFace directory that ``from_pretrained`` loads: safetensors
        with the model's names and shapes, one file per pipeline stage written by that stage
        (``autopar/runtime/hf/export.py``), and ``config.json`` for a HuggingFace model.

        Collective: every rank calls it. Returns the names of the files this rank wrote.
        """
        self._refuse_if_failed("save_pretrained")
        holdings = RankHoldings(self.program, self.mesh, self.tp, dict(self.named_local_parameters()),
                                self._feeds, self.device)
        return save_pretrained(path, holdings)

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
        save or load) waits for it. Wait before the process group is destroyed.
        """
        self._refuse_if_failed("save")
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
        self.wait_parameters("load")  # a gather finishing after the load would overwrite what it read
        return self._checkpoints().load(path, optimizer, scheduler)

    def _checkpoints(self) -> "Checkpointer":
        """This engine's checkpoints, made at the first save or load (collective: creates their group).
        Imported here: ``torch.distributed.checkpoint`` takes a second to import, and most runs never save."""
        from autopar.runtime.checkpoint.checkpointer import Checkpointer

        if "_checkpointer" not in self.__dict__:
            self._checkpointer = Checkpointer(self)
        return self._checkpointer


def _tag(a: Action, idx: int) -> int:
    """A tag unique per (direction, chunk, microbatch, tensor) so gloo never mismatches messages."""
    direction = 0 if a.kind in (Kind.SEND_F, Kind.RECV_F) else 1
    chunk = a.chunk if a.kind in (Kind.SEND_F, Kind.SEND_B) else (a.chunk - 1 if direction == 0 else a.chunk + 1)
    return ((a.microbatch * 1024 + chunk) * 2 + direction) * 64 + idx


def _key(name: str) -> str:
    return name.replace(".", "__")
