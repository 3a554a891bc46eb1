"""The compute actions of a step: forward (F), backward (B) and weight backward (W) of a chunk.

- ``F c.i``  forward of chunk c on microbatch i; in a training step, inputs that
             arrived from the previous stage become leaves that require grad
             and the context is kept until ``B c.i`` (the last chunk weights its
             loss: by n_i / N, its share of the counted targets, for a token loss;
             ``loss_weights.py``); in an evaluation step the chunk's evaluation
             graph runs and nothing is kept;
- ``B c.i``  backward of the kept outputs with the received output gradients;
             the gradients of the inputs are what the previous stage needs;
             when the step splits its backwards (``StepState.split_backward``:
             the schedule's choice, ZB-H1 and ZB-V), the input gradients only,
             the weights' left to ``W`` with their context kept in
             ``StepState.wctx`` (``runtime/optim/split_backward.py``; a compiled
             chunk's backward graph is split instead: ``compiled_split.py``);
- ``W c.i``  the weights' gradients of that B, into ``.grad``.

After a chunk's last backward (its last W when backwards split) its
parameters' data-parallel reduction starts (``GradientSync.start``),
overlapping the remaining backwards. Each chunk runs under autocast (bf16
precision) and on the rank's random stream; a training forward counts the
activation bytes autograd keeps for its backward (``engine.stats``).
"""

from __future__ import annotations

import contextlib
from collections import defaultdict
from typing import TYPE_CHECKING

import torch

from autopar.core.comm import keeping_gathered_slices, release_regathered
from autopar.runtime.engine.compiled_chunks import CompiledChunk, CompileTurns, compiled
from autopar.runtime.engine.compiled_split import WeightGrads, collecting_weight_grads
from autopar.runtime.engine.device_graphs import on_device
from autopar.runtime.engine.errors import EngineRuntimeError
from autopar.runtime.engine.holdings import Holdings
from autopar.runtime.engine.random_streams import RandomStream
from autopar.runtime.engine.step_state import Key, StepState
from autopar.runtime.optim.gradient_sync import GradientSync
from autopar.runtime.optim.split_backward import SplitBackward
from autopar.schedules import Action, Kind, Schedule

if TYPE_CHECKING:
    from autopar.core.chunks import Chunk

__all__ = ["ChunkCompute", "gradients_ready_after"]


def gradients_ready_after(holdings: Holdings, schedule: Schedule, chunks: dict[int, "Chunk"]) -> dict[int, list[str]]:
    """Chunk -> the parameters whose gradients are final after that chunk's last backward.

    A parameter's gradient is final after the last backward of the last local chunk that
    reads it (its last W when the schedule splits backwards): its data-parallel reduction
    starts right then, overlapping the remaining backwards. A parameter two local chunks
    read (ZB-V's V puts a tied embedding and head both on stage 0) waits for the later one.
    Tied parameters are left out: their gradients are final at the step's end.
    """
    program = holdings.program
    last = Kind.W if schedule.splits_backward else Kind.B
    order = [a.chunk for a in schedule.actions[holdings.stage] if a.kind is last]
    last_b = {c: i for i, c in enumerate(order)}
    ready: dict[int, list[str]] = defaultdict(list)
    for name in program.param_names:
        if holdings.holds(name) and name not in program.tied_params:
            users = [c for c, ch in chunks.items() if any(program.traced.param_of[ph] == name for ph in ch.params)]
            ready[max(users, key=last_b.__getitem__)].append(name)
    return ready


class ChunkCompute:
    """The F, B and W handlers of one rank's chunks, called ``handler(action, state)``."""

    def __init__(self, holdings: Holdings, chunks: dict[int, "Chunk"], stream: RandomStream, grads: GradientSync,
                 schedule: Schedule, turns: CompileTurns | None = None) -> None:
        self.holdings = holdings
        self.program = holdings.program
        self.chunks = chunks
        self.stream = stream
        self.grads = grads
        device = holdings.device
        backend = self.program.config.compile
        self.runnables = {c: compiled(on_device(ch.module, device), backend,
                                      frozenset(ch.params) if schedule.splits_backward else None, turns, f"train/{c}")
                          for c, ch in chunks.items()}
        """Chunk -> what runs it: its graph, with recomputation applied at compile time, making its
        tensors on the engine's device (compiled at its first run with ``compile=``)."""
        self.eval_runnables = {c: compiled(on_device(ch.eval_gm, device), backend, None, turns, f"eval/{c}")
                               for c, ch in chunks.items()}
        """Chunk -> what an evaluation step runs: its graph in evaluation mode (``passes/eval_mode.py``)."""
        self.ready_after = gradients_ready_after(holdings, schedule, chunks)
        """Chunk -> the parameters whose data-parallel reduction starts after its last backward."""
        self.param_names = {c: [self.program.traced.param_of[ph] for ph in ch.params] for c, ch in chunks.items()}
        """Chunk -> the names of the parameters its forward reads."""

    def autocast(self):
        """The precision the chunks run at: bf16 autocast, or as traced."""
        if self.program.config.precision == "bf16":
            return torch.autocast(self.holdings.device.type, dtype=torch.bfloat16)
        return contextlib.nullcontext()

    def chunk_args(self, chunk: "Chunk", micro_i: list[torch.Tensor], inputs: list[torch.Tensor]) -> list:
        """The chunk's graph arguments: the tp group, its parameter shards, its feeds, its inputs."""
        traced = self.program.traced
        batch = dict(zip(traced.input_names + traced.target_names, micro_i))
        args = [self.holdings.tp]
        for name in chunk.params:
            args.append(self.holdings.shard(traced.param_of[name]))
        for name in chunk.feeds:
            args.append(batch[name] if name in batch else self.holdings.feeds[name])
        return args + inputs

    def forward(self, a: Action, st: StepState) -> None:
        """``F c.i``: run the chunk; in a training step keep its context for ``B c.i``. Hand the
        outputs to the next chunk when it lives on this stage, else keep them for ``SF``."""
        chunk = self.chunks[a.chunk]
        key = (a.chunk, a.microbatch)
        # the chunk's first forward of a step waits for a distributed optimizer's gathers of its parameters
        self.holdings.wait_for(self.param_names[a.chunk], str(a))
        inputs = [] if a.chunk == 0 else [t.detach().requires_grad_(st.training and b.requires_grad)
                                          for t, b in zip(st.take(Kind.RECV_F, key), chunk.inputs)]
        outs = self.run_chunk(st, key, self.chunk_args(chunk, st.micro[a.microbatch], inputs))
        if a.chunk == self.program.split.n - 1:
            weight = st.weights.loss[a.microbatch]
            if weight:  # 0: a microbatch that counts no target (its mean is 0/0) adds nothing
                st.loss_sum += outs[0].detach().double() * weight
            if st.training and st.weights.seed[a.microbatch]:  # step_health.py reads it if the loss is not finite
                st.losses[a.microbatch] = outs[0].detach()
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
        st.stats["peak_in_flight"] = max(st.stats["peak_in_flight"], len(st.ctx) + len(st.wctx))
        st.stats["peak_activation_bytes"] = max(st.stats["peak_activation_bytes"], held_activation_bytes(st))

    def run_chunk(self, st: StepState, key: Key, args: list):
        """Run chunk ``key[0]`` (its evaluation graph in an evaluation step) under autocast and the
        random stream; record in ``st.saved[key]`` the storages of what it keeps for its backward:
        every tensor autograd saves (a checkpointed region's inputs among them: the non-reentrant
        checkpoint saves them through the same hooks) and the chunk's outputs (kept in its context
        until its backward), each storage once, weights left out (``held_activation_bytes``)."""
        if not st.training:
            with self.autocast(), self.stream.active():
                return self.eval_runnables[key[0]](*args)
        storages: dict[int, int] = {}

        def pack(t: torch.Tensor):
            _note_storage(storages, t, st.param_ptrs)
            return t

        if st.split_backward and not isinstance(self.runnables[key[0]], CompiledChunk):
            split = st.splits[key] = SplitBackward(st.param_ptrs)
            with split.recording(), keeping_gathered_slices(), self.autocast(), self.stream.active():
                outs = self.runnables[key[0]](*args)
            st.saved[key] = split.held_bytes()
            return outs
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), self.autocast(), \
                keeping_gathered_slices(), self.stream.active():
            outs = self.runnables[key[0]](*args)
        for o in outs:
            if isinstance(o, torch.Tensor) and o.requires_grad:
                _note_storage(storages, o, st.param_ptrs)
        st.saved[key] = storages
        return outs

    def backward(self, a: Action, st: StepState) -> None:
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
        if st.split_backward and isinstance(self.runnables[a.chunk], CompiledChunk):
            # the compiled backward runs B and leaves W here (its graph split in two: compiled_split.py)
            with self.first_backward(a.chunk), collecting_weight_grads() as st.wctx[key]:
                if tensors:
                    torch.autograd.backward(tensors, grads)
            in_grads = [x.grad if b.requires_grad else None for x, b in zip(inputs, chunk.inputs)]
        elif st.split_backward:
            split = st.wctx[key] = st.splits.pop(key)
            got = split.input_grads(tensors, grads, inputs)
            release_regathered()  # W gathers again the slices its weight GEMMs read
            in_grads = [g if b.requires_grad else None for g, b in zip(got, chunk.inputs)]
        else:
            if tensors:
                with self.first_backward(a.chunk):
                    torch.autograd.backward(tensors, grads)
            in_grads = [x.grad if b.requires_grad else None for x, b in zip(inputs, chunk.inputs)]
        if last and not tensors:
            in_grads = [torch.zeros_like(x) if b.requires_grad else None for x, b in zip(inputs, chunk.inputs)]
        st.b_done[a.chunk] += 1
        if st.split_backward:  # what W keeps, the gradients flowing into its GEMMs among it, peaks after B
            st.stats["peak_activation_bytes"] = max(st.stats["peak_activation_bytes"], held_activation_bytes(st))
        if st.b_done[a.chunk] == st.m and not st.split_backward:
            self.grads.start(self.ready_after.get(a.chunk, []))
        if a.chunk > 0 and (a.chunk - 1) in self.chunks:
            st.grad_out[(a.chunk - 1, a.microbatch)] = in_grads
        elif a.chunk > 0:
            st.grad_in[key] = in_grads

    def first_backward(self, chunk: int):
        """Around a backward of ``chunk``: a compiled chunk's first one compiles its backward graph
        (timed, its code kept: ``CompiledChunk.capturing``); otherwise nothing."""
        run = self.runnables[chunk]
        return run.capturing() if isinstance(run, CompiledChunk) else contextlib.nullcontext()

    def weight_backward(self, a: Action, st: StepState) -> None:
        """``W c.i``: the weights' gradients of chunk c on microbatch i, after its ``B c.i`` split
        the backward; they accumulate into ``.grad``. After the chunk's last W its parameters'
        data-parallel reduction starts."""
        key = (a.chunk, a.microbatch)
        split = st.wctx.pop(key, None)
        if split is None:
            raise EngineRuntimeError(f"W {a.chunk}.{a.microbatch}: no split backward pending for chunk {a.chunk} "
                                     f"microbatch {a.microbatch} (its B must run first, with split_backward on)")
        if isinstance(split, WeightGrads):  # a compiled chunk's W: its graph's weight gradients, by argument
            for name, g in split.run().items():
                p = self.holdings.shard(self.program.traced.param_of[name])
                if p.grad is None:
                    p.grad = g
                else:
                    p.grad += g
        else:
            split.weight_grads()
        st.w_done[a.chunk] += 1
        if st.w_done[a.chunk] == st.m:
            self.grads.start(self.ready_after.get(a.chunk, []))


def _note_storage(storages: dict[int, int], t: torch.Tensor, param_ptrs: set[int]) -> None:
    """Add ``t``'s storage (address -> bytes) to ``storages`` unless it holds a weight. A view (a
    linear's input flattened to 2-D, Q, K and V sliced from one projection) keeps its whole storage
    alive and no more: counting storages, not tensors, counts such memory once."""
    storage = t.untyped_storage()
    if t.data_ptr() in param_ptrs or storage.data_ptr() in param_ptrs:
        return
    storages[storage.data_ptr()] = storage.nbytes()


def held_activation_bytes(st: StepState) -> int:
    """Bytes of activations the step holds now for its pending backwards: the storages the
    forwards recorded (``ChunkCompute.run_chunk``), each counted once over all pending contexts
    (a chunk's output is the next chunk's input on the same stage), plus what split backwards
    hold (their stores' own count) and keep for their W's."""
    distinct: dict[int, int] = {}
    held = 0
    for kept in st.saved.values():
        if isinstance(kept, dict):
            distinct.update(kept)
        else:
            held += kept
    held += sum(split.held_bytes() for split in st.wctx.values())
    return held + sum(distinct.values())
