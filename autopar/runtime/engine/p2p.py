"""The point-to-point actions of a step: SF, RF, SB, RB, posted in batches.

Each handler adds its operations to the step's open batch (``StepState.comm``),
and a run of consecutive ones is posted as one ``batch_isend_irecv``
(``post``), so no ordering of pairs can deadlock. Sends complete in the
background (waited for at the step's end: ``wait_sends``); an action's receives
are waited for only by the F or B that consumes them.

With tensor parallelism, a boundary tensor that is identical on the t ranks of
a stage is sent as 1/t slices (rank j of stage s to rank j of stage s+1) and
all-gathered on arrival (scatter/gather). Each message has a tag unique per
(direction, chunk, microbatch, tensor) so gloo never mismatches messages.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from autopar.core.comm import TPGroup, all_gather
from autopar.core.mesh import Mesh
from autopar.runtime.engine.step_state import Finish, Receive, StepState
from autopar.schedules import Action, Kind

if TYPE_CHECKING:
    from autopar.compiler.program import Program
    from autopar.core.chunks import Boundary, Chunk

__all__ = ["PointToPoint", "wait_sends", "tag"]


def tag(a: Action, idx: int) -> int:
    """A tag unique per (direction, chunk, microbatch, tensor) so gloo never mismatches messages."""
    direction = 0 if a.kind in (Kind.SEND_F, Kind.RECV_F) else 1
    chunk = a.chunk if a.kind in (Kind.SEND_F, Kind.SEND_B) else (a.chunk - 1 if direction == 0 else a.chunk + 1)
    return ((a.microbatch * 1024 + chunk) * 2 + direction) * 64 + idx


def wait_sends(st: StepState) -> None:
    """Wait for the step's sends in flight (their tensors must live until they complete)."""
    for work, _ in st.pending_sends:
        work.wait()
    st.pending_sends = []


class PointToPoint:
    """The SF/RF/SB/RB handlers of one rank, called ``handler(action, state)``, and the batch's post."""

    def __init__(self, program: "Program", mesh: Mesh, tp: TPGroup, chunks: dict[int, "Chunk"],
                 device: torch.device) -> None:
        self.program = program
        self.mesh = mesh
        self.tp = tp
        self.chunks = chunks
        self.device = device
        """Where the receive buffers are made."""

    def send_outputs(self, a: Action, st: StepState) -> None:
        """``SF c.i``: the chunk's outputs (kept by ``F c.i``) to the next stage."""
        outs = st.outgoing.pop((a.chunk, a.microbatch))
        peer = self.mesh.peer(a.peer)
        for idx, (t, b) in enumerate(zip(outs, self.chunks[a.chunk].outputs)):
            st.comm.ops.append(self._send(st, t.detach(), b, peer, tag(a, idx), a))

    def send_input_grads(self, a: Action, st: StepState) -> None:
        """``SB c.i``: the gradients of the chunk's inputs to the previous stage; zeros (on the
        engine's device) for an input that got no gradient."""
        grads = st.grad_in.pop((a.chunk, a.microbatch))
        peer = self.mesh.peer(a.peer)
        for idx, (g, b) in enumerate(zip(grads, self.chunks[a.chunk].inputs)):
            if b.requires_grad:
                g = g if g is not None else torch.zeros(b.shape, dtype=b.dtype, device=self.device)
                st.comm.ops.append(self._send(st, g, b, peer, tag(a, idx), a))

    def recv_inputs(self, a: Action, st: StepState) -> None:
        """``RF c.i``: the chunk's inputs from the previous stage."""
        self._add_receive(st, a, list(self.chunks[a.chunk].inputs))

    def recv_output_grads(self, a: Action, st: StepState) -> None:
        """``RB c.i``: the gradients of the chunk's outputs (those that carry one) from the next stage."""
        self._add_receive(st, a, [b if b.requires_grad else None for b in self.chunks[a.chunk].outputs])

    def _add_receive(self, st: StepState, a: Action, boundaries: list["Boundary | None"]) -> None:
        peer = self.mesh.peer(a.peer)
        mine, finishes = [], []
        for idx, b in enumerate(boundaries):
            if b is None:
                finishes.append(None)
                continue
            op, finish = self._recv(b, peer, tag(a, idx))
            mine.append(len(st.comm.ops))
            st.comm.ops.append(op)
            finishes.append(finish)
        st.comm.receives.append((a, mine, finishes))

    def post(self, st: StepState) -> None:
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
                st.store(a.kind)[(a.chunk, a.microbatch)] = Receive([], finishes).wait()
            return
        for op, work in zip(batch.ops, works):
            if op.op is dist.isend:
                st.pending_sends.append((work, op.tensor))
        for a, mine, finishes in batch.receives:
            # only this action's own receives: waiting on the batch's others could wait on a
            # tensor the peer sends only after it gets something from us
            st.pending_recv[a.key] = Receive([works[i] for i in mine], finishes)

    def _scatter_gather(self, b: "Boundary") -> bool:
        return (self.program.config.scatter_gather and self.tp.size > 1 and b.replicated
                and b.numel % self.tp.size == 0)

    def _send(self, st: StepState, t: torch.Tensor, b: "Boundary", peer: int, message_tag: int, a: Action):
        t = t.to(b.dtype).contiguous()  # under autocast a boundary may be bf16: send its declared dtype
        if self._scatter_gather(b):
            t = t.reshape(self.tp.size, -1)[self.tp.rank].contiguous()
        st.stats["bytes_sent"][(self.mesh.pp_rank, a.peer)] += t.numel() * t.element_size()
        return dist.P2POp(dist.isend, t, peer, tag=message_tag)

    def _recv(self, b: "Boundary", peer: int, message_tag: int) -> tuple[Any, Finish]:
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
        return dist.P2POp(dist.irecv, buf, peer, tag=message_tag), finish
