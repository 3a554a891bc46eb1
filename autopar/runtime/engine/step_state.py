"""What one step holds between its actions: ``StepState``, made per step and dropped after it.

Kept contexts of the forwards, tensors that arrived or wait to be sent,
receives in flight (``Receive``), the open batch of point-to-point operations
(``CommBatch``), the loss, the step's measured events and statistics, and where
the step is now (the failure watch's clock). Keyed by ``(chunk, microbatch)``.
"""

from __future__ import annotations

import time
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from autopar.runtime.engine.loss_weights import StepWeights
from autopar.runtime.engine.timeline import Event
from autopar.runtime.optim.split_backward import SplitBackward
from autopar.schedules import Action, Kind, Schedule

__all__ = ["Key", "Finish", "Receive", "CommBatch", "StepState", "new_stats"]

Key = tuple[int, int]
"""(chunk, microbatch)."""

Finish = Callable[[], torch.Tensor]
"""Turns a filled receive buffer into the boundary tensor (all-gathers a scattered one)."""


def new_stats() -> dict:
    """A step's statistics (``engine.stats``), before its first action."""
    return {"bytes_sent": defaultdict(int), "peak_in_flight": 0, "peak_activation_bytes": 0}


@dataclass
class Receive:
    """The receives of one RF/RB action in flight: its own works and how to finish each buffer."""

    works: list
    finishes: list[Finish | None]
    """One per boundary; None where nothing is received (no gradient flows)."""

    def wait(self) -> list[torch.Tensor | None]:
        for work in self.works:
            work.wait()
        return [f() if f is not None else None for f in self.finishes]


@dataclass
class CommBatch:
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
    split_backward: bool = False
    """Whether each backward splits into B (input gradients) and W (weight gradients)."""
    stats: dict = field(default_factory=new_stats)
    """The step's statistics (``engine.stats``): bytes sent per peer, peak backwards in flight, peak
    activation bytes kept."""
    events: list[Event] = field(default_factory=list)
    """Measured timeline of the step (``engine.events``)."""
    ctx: dict[Key, tuple[list[torch.Tensor], list[torch.Tensor]]] = field(default_factory=dict)
    """F done, B pending: (the chunk's inputs as leaves, its outputs; the last chunk's: [loss * seed])."""
    outgoing: dict[Key, list[torch.Tensor]] = field(default_factory=dict)
    """F done, SF pending: the outputs to send to the next chunk's stage."""
    saved: dict[Key, dict[int, int] | int] = field(default_factory=dict)
    """What each pending backward keeps: its storages (address -> bytes: what autograd saved and the
    chunk's outputs), or the bytes a split backward's store holds (``compute.held_activation_bytes``)."""
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
    comm: CommBatch = field(default_factory=CommBatch)
    """The batch the communication handlers of the current run add to."""
    pending_sends: list[tuple[Any, torch.Tensor]] = field(default_factory=list)
    """(work, tensor) of sends in flight: the tensor must live until the work completes."""
    pending_recv: dict[tuple[Kind, int, int], Receive] = field(default_factory=dict)
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
    losses: dict[int, torch.Tensor] = field(default_factory=dict)
    """A training step on the last chunk's stage: microbatch -> its loss (detached, unweighted), for
    the microbatches that count (a nonzero backward seed): what tells a non-finite step apart."""
    logits: dict[int, torch.Tensor] | None = None
    """``eval_step(outputs=True)``: microbatch -> this rank's piece of the logits the last chunk's
    evaluation graph returned; None: not kept."""

    @property
    def kind(self) -> str:
        """``"train_step"`` or ``"eval_step"``."""
        return "train_step" if self.training else "eval_step"

    def enter_phase(self, phase: str) -> None:
        """The step is outside its actions now, in ``phase``."""
        self.at, self.phase, self.progress = [], phase, time.monotonic()

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
