"""One rank's training engine: its chunks' parameter shards and the schedule interpreter.

``train_step(*inputs, *targets)`` takes the whole batch (the same on every
rank), keeps this data-parallel replica's slice, cuts it into microbatches and
runs this stage's actions from the lowered schedule (``autopar/schedules.py``):

- ``F c.i``  forward of chunk c on microbatch i; inputs that arrived from the
             previous stage become leaves that require grad; the context is
             kept until ``B c.i`` (the last chunk scales its loss by 1/m);
- ``B c.i``  backward of the kept outputs with the received output gradients;
             the gradients of the inputs are what the previous stage needs;
- ``SF/RF/SB/RB``  point-to-point; a run of consecutive ones is posted as one
             ``batch_isend_irecv`` so no ordering of pairs can deadlock.

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
the same masks: the checkpoint saves and restores this stream's state.
"""

from __future__ import annotations

import contextlib
import time
from collections import defaultdict
from collections.abc import Iterable
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
import torch.nn as nn

from autopar.core.checkpoint import count_kept_bytes
from autopar.core.comm import TPGroup, _all_gather, seed_forked
from autopar.core.mesh import Mesh
from autopar.core.placement import Shard
from autopar.runtime.gradients import GradientSync
from autopar.runtime.timeline import Event, gather_events, write_chrome_trace
from autopar.schedules import Action, Kind

if TYPE_CHECKING:
    from autopar.compiler.program import Program
    from autopar.core.chunks import Boundary, Chunk

__all__ = ["RankEngine", "rank_device"]


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


class RankEngine(nn.Module):
    """Holds this rank's parameter shards and interprets its schedule."""

    def __init__(self, program: "Program", mesh: Mesh, local_params: dict[str, torch.Tensor],
                 feeds: dict[str, torch.Tensor], bucket_bytes: int = 25 * 2**20):
        super().__init__()
        self.program = program
        self.mesh = mesh
        self.tp = TPGroup.of(mesh.groups.get("tp"), tuple(mesh.tp_members()))
        self.stage = mesh.pp_rank
        p = mesh.shape.pp
        self.chunks: dict[int, "Chunk"] = {c.index: c for c in program.split.chunks if c.index % p == self.stage}
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
        self.stats: dict = {}
        self.runnables = {c: ch.module for c, ch in self.chunks.items()}
        """Chunk -> what runs it: its graph, with recomputation applied at compile time."""
        self.random_seed = self._stream_seed(mesh)
        """Seed of this rank's random stream (dropout); equal on the t ranks of a stage."""
        self._rng_devices = [self.device.index] if self.device.type == "cuda" else []
        with torch.random.fork_rng(devices=self._rng_devices):
            seed_forked(self.random_seed, self._rng_devices)
            self._rng_states = self._get_rng()
        self.grads = GradientSync(program, mesh, {n: self.shards[_key(n)] for n in local_params},
                                  bucket_bytes, device=self.device)
        # a parameter's gradient is final after the last backward of the last local chunk that reads
        # it: its data-parallel reduction starts right then, overlapping the remaining backwards
        order = [a.chunk for a in self.schedule.actions[self.stage] if a.kind is Kind.B]
        last_b = {c: i for i, c in enumerate(order)}
        self._ready_after: dict[int, list[str]] = defaultdict(list)
        for name in program.param_names:
            if name in local_params and name not in program.tied_params:
                users = [c for c, ch in self.chunks.items()
                         if any(program.traced.param_of[ph] == name for ph in ch.params)]
                self._ready_after[max(users, key=last_b.__getitem__)].append(name)

    def _stream_seed(self, mesh: Mesh) -> int:
        """Global rank 0's ``torch.initial_seed()``, offset by this rank's (stage, replica).
        A broadcast over the world: every rank builds its engine (``materialize`` is collective)."""
        base = torch.tensor([torch.initial_seed() % 2**62], dtype=torch.int64, device=self.device)
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.broadcast(base, src=0)
        replica = mesh.dp_rank + mesh.shape.dp * mesh.pp_rank
        return (int(base) + 1_000_003 * replica) % 2**63

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
    def forward(self, *batch: torch.Tensor) -> float:
        """``engine(x, y)`` is ``train_step``: forward *and* backward of the global batch."""
        return self.train_step(*batch)

    def train_step(self, *batch: torch.Tensor) -> float:
        """Forward and backward of one global batch; returns the mean loss (same on every rank)."""
        micro = self._microbatches(batch)
        m = self.program.microbatches
        self._ctx: dict[tuple[int, int], tuple] = {}
        self._fwd_in: dict[tuple[int, int], list[torch.Tensor]] = {}
        self._grad_out: dict[tuple[int, int], list[torch.Tensor | None]] = {}
        self._grad_in: dict[tuple[int, int], list[torch.Tensor | None]] = {}
        self._loss_sum = torch.zeros((), dtype=torch.float64, device=self.device)
        self._saved: dict[tuple[int, int], int] = {}
        self._param_ptrs = {p.data_ptr() for p in self.shards.values()}
        self.stats = {"bytes_sent": defaultdict(int), "peak_in_flight": 0, "peak_activation_bytes": 0}
        self.grads.begin_step(self.stats)
        self._b_done: dict[int, int] = defaultdict(int)
        self._pending_sends: list = []
        self._pending_recv: dict = {}

        actions = self.schedule.actions[self.stage]
        rank = dist.get_rank() if dist.is_initialized() else 0
        self.events: list[Event] = []
        t0 = time.perf_counter()
        i = 0
        while i < len(actions):
            a = actions[i]
            start = time.perf_counter() - t0
            if a.is_comm:
                j = i
                while j < len(actions) and actions[j].is_comm:
                    j += 1
                self._communicate(actions[i:j])
                name, kind = " ".join(map(str, actions[i:j])), "comm"
                i = j
            else:
                if a.kind is Kind.F:
                    self._forward(a, micro, m)
                else:
                    self._backward(a, m)
                name, kind = str(a), a.kind.value
                i += 1
            self.events.append(Event(rank, kind, name, start, time.perf_counter() - t0))

        for work, _ in self._pending_sends:
            work.wait()
        self._pending_sends = []
        self.grads.end_step()
        return self._reduce_loss(m)

    def _microbatches(self, batch) -> list[list[torch.Tensor]]:
        """[microbatch][input or target]: this replica's slices, on the engine's device."""
        traced = self.program.traced
        names = traced.input_names + traced.target_names
        if len(batch) != len(names):
            raise TypeError(f"expected {len(traced.input_names)} input(s) and {len(traced.target_names)} "
                            f"target(s), got {len(batch)} tensors")
        phs = {n.name: n for n in traced.gm.graph.nodes if n.op == "placeholder"}
        m, d = self.program.microbatches, self.mesh.shape.dp
        out = [[] for _ in range(m)]
        for name, x in zip(names, batch):
            want = tuple(phs[name].meta["val"].shape)
            full = (want[0] * m * d,) + want[1:]
            if tuple(x.shape) != full:
                raise ValueError(
                    f"batch tensor '{name}' has shape {tuple(x.shape)}, but the program expects {full}: "
                    f"{d} data-parallel replica(s) x {m} microbatch(es) of {want} (the example microbatch's shape)")
            mine = x.narrow(0, self.mesh.dp_rank * want[0] * m, want[0] * m).to(self.device)
            for i, piece in enumerate(mine.split(want[0], dim=0)):
                out[i].append(piece)
        return out

    def _chunk_args(self, chunk: "Chunk", micro_i: list[torch.Tensor], inputs: list[torch.Tensor]) -> list:
        traced = self.program.traced
        batch = dict(zip(traced.input_names + traced.target_names, micro_i))
        args = [self.tp]
        for name in chunk.params:
            args.append(self.shards[_key(traced.param_of[name])])
        for name in chunk.feeds:
            args.append(batch[name] if name in batch else self._feeds[name])
        return args + inputs

    def _forward(self, a: Action, micro, m: int) -> None:
        chunk = self.chunks[a.chunk]
        key = (a.chunk, a.microbatch)
        if a.chunk == 0:
            inputs = []
        else:
            received = self._take(self._fwd_in, key)
            inputs = [t.detach().requires_grad_(b.requires_grad) for t, b in zip(received, chunk.inputs)]
        saved = [0]

        def pack(t: torch.Tensor):
            if t.data_ptr() not in self._param_ptrs:  # weights are not activations
                saved[0] += t.numel() * t.element_size()
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), self._autocast(), \
                self._random_stream(), count_kept_bytes() as kept:
            outs = self.runnables[a.chunk](*self._chunk_args(chunk, micro[a.microbatch], inputs))
        self._saved[key] = saved[0] + kept.nbytes
        if a.chunk == self.program.split.n - 1:
            loss = outs[0]
            self._loss_sum += loss.detach().double()
            self._ctx[key] = (inputs, [loss / m])
        else:
            self._ctx[key] = (inputs, list(outs))
            nxt = (a.chunk + 1, a.microbatch)
            if (a.chunk + 1) in self.chunks:  # next chunk on this stage: hand over directly
                self._fwd_in[nxt] = [o.detach().to(b.dtype) for o, b in zip(outs, chunk.outputs)]
        self.stats["peak_in_flight"] = max(self.stats["peak_in_flight"], len(self._ctx))
        held = sum(self._saved.values())  # bytes autograd keeps for the pending backwards
        self.stats["peak_activation_bytes"] = max(self.stats["peak_activation_bytes"], held)

    def _backward(self, a: Action, m: int) -> None:
        key = (a.chunk, a.microbatch)
        inputs, outs = self._ctx.pop(key)
        self._saved.pop(key, None)
        chunk = self.chunks[a.chunk]
        if a.chunk == self.program.split.n - 1:
            tensors, grads = outs, [None]
        else:
            got = self._take(self._grad_out, key)
            pairs = [(o, g) for o, g, b in zip(outs, got, chunk.outputs) if b.requires_grad and o.requires_grad]
            tensors, grads = [p[0] for p in pairs], [p[1] for p in pairs]
        if tensors:
            torch.autograd.backward(tensors, grads)
        self._b_done[a.chunk] += 1
        if self._b_done[a.chunk] == m:
            self.grads.start(self._ready_after.get(a.chunk, []))
        in_grads = [x.grad if b.requires_grad else None for x, b in zip(inputs, chunk.inputs)]
        if a.chunk > 0 and (a.chunk - 1) in self.chunks:
            self._grad_out[(a.chunk - 1, a.microbatch)] = in_grads
        elif a.chunk > 0:
            self._grad_in[key] = in_grads

    # ------------------------------------------------------------ point-to-point
    def _communicate(self, comm_actions: list[Action]) -> None:
        ops, after = [], []
        for a in comm_actions:
            chunk = self.chunks[a.chunk]
            peer = self.mesh.peer(a.peer)
            if a.kind is Kind.SEND_F:
                _, outs = self._ctx[(a.chunk, a.microbatch)]
                for idx, (t, b) in enumerate(zip(outs, chunk.outputs)):
                    ops.append(self._send(t.detach(), b, peer, _tag(a, idx), a))
            elif a.kind is Kind.SEND_B:
                grads = self._grad_in.pop((a.chunk, a.microbatch))
                for idx, (g, b) in enumerate(zip(grads, chunk.inputs)):
                    if b.requires_grad:
                        g = g if g is not None else torch.zeros(b.shape, dtype=b.dtype, device=self.device)
                        ops.append(self._send(g, b, peer, _tag(a, idx), a))
            elif a.kind is Kind.RECV_F:
                bufs, mine = [], []
                for idx, b in enumerate(chunk.inputs):
                    op, finish = self._recv(b, peer, _tag(a, idx))
                    mine.append(len(ops))
                    ops.append(op)
                    bufs.append(finish)
                after.append((self._fwd_in, (a.chunk, a.microbatch), bufs, mine))
            else:  # RECV_B: gradients of this chunk's outputs
                bufs, mine = [], []
                for idx, b in enumerate(chunk.outputs):
                    if b.requires_grad:
                        op, finish = self._recv(b, peer, _tag(a, idx))
                        mine.append(len(ops))
                        ops.append(op)
                        bufs.append(finish)
                    else:
                        bufs.append(None)
                after.append((self._grad_out, (a.chunk, a.microbatch), bufs, mine))
        if not ops:
            for store, key, finishes, _ in after:
                store[key] = [None for _ in finishes]
            return
        works = dist.batch_isend_irecv(ops)
        if len(works) != len(ops):  # NCCL coalesces a batch into one work: wait for it here
            for work in works:
                work.wait()
            for store, key, finishes, _ in after:
                store[key] = [f() if f is not None else None for f in finishes]
            return
        # sends complete in the background (waited for at the end of the step); a receive is
        # waited for only by the F or B that consumes it, so peers never meet in lock-step
        for op, work in zip(ops, works):
            if op.op is dist.isend:
                self._pending_sends.append((work, op.tensor))
        for store, key, finishes, mine in after:
            # only this action's own receives: waiting on the batch's others could wait on a
            # tensor the peer sends only after it gets something from us
            self._pending_recv[(id(store), key)] = ([works[i] for i in mine], finishes)
            store[key] = None  # placeholder until taken

    def _take(self, store: dict, key: tuple[int, int]) -> list:
        """The tensors for ``key``: wait for their receive if it is still in flight."""
        pending = self._pending_recv.pop((id(store), key), None)
        if pending is not None:
            works, finishes = pending
            for work in works:
                work.wait()
            store[key] = [f() if f is not None else None for f in finishes]
        return store.pop(key)

    def _scatter_gather(self, b: "Boundary") -> bool:
        return (self.program.config.scatter_gather and self.tp.size > 1 and b.replicated
                and b.numel % self.tp.size == 0)

    def _send(self, t: torch.Tensor, b: "Boundary", peer: int, tag: int, a: Action):
        t = t.to(b.dtype).contiguous()  # under autocast a boundary may be bf16: send its declared dtype
        if self._scatter_gather(b):
            t = t.reshape(self.tp.size, -1)[self.tp.rank].contiguous()
        self.stats["bytes_sent"][(self.stage, a.peer)] += t.numel() * t.element_size()
        return dist.P2POp(dist.isend, t, peer, tag=tag)

    def _recv(self, b: "Boundary", peer: int, tag: int):
        if self._scatter_gather(b):
            buf = torch.empty(b.numel // self.tp.size, dtype=b.dtype, device=self.device)

            def finish(buf=buf, b=b):
                return _all_gather(buf, self.tp, 0, None).reshape(b.shape)
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
        return self.grads.clip_norm_(max_norm, self.tp.rank, self.stage)

    def _reduce_loss(self, m: int) -> float:
        loss = (self._loss_sum / m).float().reshape(1)
        p = self.mesh.shape.pp
        if p > 1:
            last = self.mesh.peer(p - 1)
            dist.broadcast(loss, src=last, group=self.mesh.groups["pp"])
        if self.mesh.shape.dp > 1:
            dist.all_reduce(loss, group=self.mesh.groups["dp"])
            loss /= self.mesh.shape.dp
        return float(loss)

    def write_trace(self, path: str) -> None:
        """Write the last step's measured timeline of every rank as a Chrome/Perfetto trace.

        Collective: every rank calls it; rank 0 writes ``path``.
        """
        events = gather_events(self.events)
        if not dist.is_initialized() or dist.get_rank() == 0:
            write_chrome_trace(events, path)

    # ---------------------------------------------------------------- parameters
    def named_local_parameters(self):
        """(original name, local shard) of every parameter this rank holds."""
        for name in self.program.param_names:
            if _key(name) in self.shards:
                yield name, self.shards[_key(name)]

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """Full parameters under every original name (gathered over tp, then over pp), on every rank."""
        return self._gather(lambda p: p.detach(), buffers=True)

    def full_grads(self) -> dict[str, torch.Tensor]:
        """Full gradients under every original parameter name, on every rank."""
        return self._gather(lambda p: p.grad if p.grad is not None else torch.zeros_like(p), buffers=False)

    def _gather(self, get, buffers: bool) -> dict[str, torch.Tensor]:
        program = self.program
        dtypes = self._param_dtypes()
        out = {}
        for name in program.param_names:
            local = self.shards[_key(name)] if _key(name) in self.shards else None
            value = get(local) if local is not None else None
            spec = program.param_spec(name)
            if value is not None and isinstance(spec, Shard):
                if self.tp.size > 1:
                    value = _all_gather(value, self.tp, spec.dim, spec.segments)
                value = value.narrow(spec.dim, 0, program.full_shape(name)[spec.dim])
            if self.mesh.shape.pp > 1:
                owner = program.param_stages[name][0]
                if self.stage == owner:
                    buf = value.to(dtypes[name]).contiguous()
                else:
                    buf = torch.empty(program.full_shape(name), dtype=dtypes[name], device=self.device)
                dist.broadcast(buf, src=self.mesh.peer(owner), group=self.mesh.groups["pp"])
                value = buf
            for alias in program.traced.aliases.get(name, [name]):
                out[alias] = value.clone()
        if buffers:
            for pname, bname in program.traced.buffer_of.items():
                if pname in self._feeds:
                    out[bname] = self._feeds[pname].clone()
        return out

    def _param_dtypes(self) -> dict[str, torch.dtype]:
        """Parameter name -> its dtype as traced (the same on every stage, held or not)."""
        traced = self.program.traced
        phs = {n.name: n for n in traced.gm.graph.nodes if n.op == "placeholder"}
        return {name: phs[ph].meta["val"].dtype for ph, name in traced.param_of.items()}


def _tag(a: Action, idx: int) -> int:
    """A tag unique per (direction, chunk, microbatch, tensor) so gloo never mismatches messages."""
    direction = 0 if a.kind in (Kind.SEND_F, Kind.RECV_F) else 1
    chunk = a.chunk if a.kind in (Kind.SEND_F, Kind.SEND_B) else (a.chunk - 1 if direction == 0 else a.chunk + 1)
    return ((a.microbatch * 1024 + chunk) * 2 + direction) * 64 + idx


def _key(name: str) -> str:
    return name.replace(".", "__")
