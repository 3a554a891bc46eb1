"""Benchmark: autopar's zero-bubble schedules vs torch.distributed.pipelining (pp=2, CPU, gloo).

The same nanoGPT-style ``gpt`` model (same seed, weights, batches, AdamW) on 2
gloo ranks (1 thread each), side by side in one spawn per round:

- autopar ``parallelize(model, pp=2, schedule=...)`` with '1f1b', 'interleaved'
  (v=2), 'zb-h1' and 'zbv' (v=2, chunks in a V);
- PyTorch's ``ScheduleInterleaved1F1B`` (chunk c on rank c % 2) and
  ``ScheduleZBVZeroBubble`` (chunk c on rank c for c < 2, 3 - c after), on
  the model split by hand into the chunks autopar chose for 'interleaved' and
  for 'zbv' (``pipeline_vs_torch.py``'s stages, untied LM head for both).

Reported, rank 0 and rank 1: step-time medians (train_step / schedule.step +
loss broadcast + AdamW), each one's ratio to PyTorch's Interleaved1F1B, and the
peak activation memory per stage: for autopar the engine's measured kept bytes
(``engine.stats["peak_activation_bytes"]``: what autograd saves for pending
backwards, W's included); for PyTorch the same quantity counted by a
``saved_tensors_hooks`` pair around its step (bytes of saved non-parameter
tensors alive, peak over the step). Run with m = 2p = 4 and m = 8.

    .venv/bin/python bench/zero_bubble.py [--steps 12 --rounds 2 -m 4,8 --d-model 256 --layers 8]
"""

from __future__ import annotations

import argparse
import gc
import os
import statistics
import sys
import weakref

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import autopar  # noqa: E402
from pipeline_vs_torch import (PP, FirstChunk, LastChunk, MiddleChunk, example_microbatch, make_model,  # noqa: E402
                               timed_steps)
from tp_vs_dtensor import make_batches  # noqa: E402
from gpt_flags import add_gpt_flags  # noqa: E402
from pooling import pool_round  # noqa: E402

AUTOPAR = {"1f1b": 1, "interleaved": 2, "zb-h1": 1, "zbv": 2}  # schedule -> virtual stages
TORCH = {"torch-interleaved": "interleaved", "torch-zbv": "zbv"}  # torch schedule -> the autopar split it uses
BASELINE = "torch-interleaved"


class SavedBytes:
    """While active, the bytes of saved non-parameter tensors autograd holds, and their peak.

    Each saved tensor is packed into a small holder whose finalizer subtracts its bytes when autograd
    drops it (after the backward that used it), so ``peak`` is the most held at once."""

    def __init__(self, params):
        self.ptrs = {p.data_ptr() for p in params}
        self.live = self.peak = 0

    def _pack(self, t: torch.Tensor):
        holder = _Holder(t)
        if t.data_ptr() not in self.ptrs:
            n = t.numel() * t.element_size()
            self.live += n
            self.peak = max(self.peak, self.live)
            weakref.finalize(holder, self._release, n)
        return holder

    def _release(self, n: int) -> None:
        self.live -= n

    def hooks(self):
        return torch.autograd.graph.saved_tensors_hooks(self._pack, lambda holder: holder.tensor)


class _Holder:
    __slots__ = ("tensor", "__weakref__")

    def __init__(self, t):
        self.tensor = t


def build_autopar(a, schedule: str, rec: dict):
    """-> step(x, y) -> float: train_step + AdamW step; ``rec['kept']`` the peak kept bytes."""
    x, y = example_microbatch(a)
    program = autopar.parallelize(make_model(a), pp=PP, virtual_stages=AUTOPAR[schedule],
                                  microbatches=a.microbatches, schedule=schedule, example_inputs=(x,),
                                  example_targets=y)
    engine = program.materialize()
    opt = torch.optim.AdamW(engine.parameters(), lr=a.lr)
    rec["kept"] = 0

    def step(x, y):
        loss = engine.train_step(x, y)
        rec["kept"] = max(rec["kept"], engine.stats["peak_activation_bytes"])
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss

    return step


def _torch_stages(a, model, layer_of_chunk, chunks, compile_stages: bool = False):
    from torch.distributed.pipelining import PipelineStage

    n = len(layer_of_chunk)
    hidden = torch.empty(a.mb, a.seq, a.d_model, requires_grad=True)
    tokens = torch.zeros(a.mb, a.seq, dtype=torch.long)
    logits = torch.empty(a.mb, a.seq, a.vocab, requires_grad=True)
    stages, modules = [], []
    for c in chunks:
        if c == 0:
            mod, inp = FirstChunk(model, layer_of_chunk[c]), tokens
        elif c == n - 1:
            mod, inp = LastChunk(model, layer_of_chunk[c]), hidden
        else:
            mod, inp = MiddleChunk(model, layer_of_chunk[c]), hidden
        modules.append(mod)
        stages.append(PipelineStage(torch.compile(mod) if compile_stages else mod, c, n, torch.device("cpu"),
                                    input_args=(inp,),
                                    output_args=(logits if c == n - 1 else hidden,)))
    return stages, modules


def build_torch(a, schedule: str, rec: dict, layer_of_chunk, compile_stages: bool = False):
    """-> step(x, y) -> float: PyTorch's schedule.step + loss broadcast + AdamW; ``rec['kept']`` as autopar's.
    ``compile_stages``: each stage's module under ``torch.compile`` (Inductor)."""
    from torch.distributed.pipelining import ScheduleInterleaved1F1B, ScheduleZBVZeroBubble

    rank, n = dist.get_rank(), len(layer_of_chunk)
    v_placed = schedule == "torch-zbv"
    chunks = [rank, n - 1 - rank] if v_placed else list(range(rank, n, PP))
    stages, modules = _torch_stages(a, make_model(a), layer_of_chunk, chunks, compile_stages)
    cls = ScheduleZBVZeroBubble if v_placed else ScheduleInterleaved1F1B
    sched = cls(stages, n_microbatches=a.microbatches, loss_fn=autopar.lm_cross_entropy)
    params = [p for mod in modules for p in mod.parameters()]
    opt = torch.optim.AdamW(params, lr=a.lr)
    first, last = 0 in chunks, (n - 1) in chunks
    owner = 0 if v_placed else (n - 1) % PP  # the rank of the last chunk
    rec["kept"] = 0

    def step(x, y):
        losses, saved = [], SavedBytes(params)
        with saved.hooks():
            sched.step(*((x,) if first else ()), target=y if last else None, losses=losses if last else None,
                       return_outputs=False)
        rec["kept"] = max(rec["kept"], saved.peak)
        loss = torch.stack(losses).detach().mean().reshape(1) if last else torch.empty(1)
        dist.broadcast(loss, src=owner)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return float(loss)

    return step


def worker(a, rnd: int, splits):
    batches = make_batches(a)
    recs = {name: {} for name in list(AUTOPAR) + list(TORCH)}
    steps = {name: build_autopar(a, name, recs[name]) for name in AUTOPAR}
    steps.update({name: build_torch(a, name, recs[name], splits[TORCH[name]]) for name in TORCH})
    res = timed_steps(steps, batches, a.warmup, flip=rnd % 2 == 1)
    out = {name: {"times": res[name]["times"], "losses": res[name]["losses"], "kept": recs[name]["kept"]}
           for name in steps}
    del steps
    gc.collect()
    return out


def chunk_splits(a) -> dict[str, list[list[int]]]:
    """The blocks of each chunk autopar chooses for 'interleaved' and 'zbv' (v=2): PyTorch's
    stages are cut the same way."""
    splits = {}
    for s in ("interleaved", "zbv"):
        x, y = example_microbatch(a)
        program = autopar.parallelize(make_model(a), pp=PP, virtual_stages=2, microbatches=a.microbatches,
                                      schedule=s, example_inputs=(x,), example_targets=y)
        splits[s] = [list(c) for c in program.split.layer_of_chunk]
    return splits


def run(a, con) -> None:
    from rich.table import Table

    a.batch = a.mb * a.microbatches
    splits = chunk_splits(a)
    con.print(f"m={a.microbatches}: blocks per chunk, interleaved {splits['interleaved']}, zbv {splits['zbv']}")
    pooled: dict[str, list[dict]] = {}
    for rnd in range(a.rounds):
        for rank_res in [autopar.spawn(worker, nprocs=PP, args=(a, rnd, splits))]:
            for name in rank_res[0]:
                pool_round(pooled, name, [r[name] for r in rank_res], peaks=("kept",))
    base = statistics.median(pooled[BASELINE][0]["times"])
    tab = Table(title=f"pp={PP}, m={a.microbatches}: step time (rank 0 / rank 1 medians) and peak activation "
                      f"memory per stage (saved bytes held for pending backwards)")
    for col in ("system", "schedule", "median ms r0", "median ms r1", f"/ {BASELINE}", "peak act. MiB stage 0",
                "peak act. MiB stage 1", "loss first / last"):
        tab.add_column(col, justify="left" if col in ("system", "schedule") else "right")
    for name, res in pooled.items():
        m0, m1 = (statistics.median(r["times"]) for r in res)
        system = "torch" if name in TORCH else "autopar"
        tab.add_row(system, name, f"{m0 * 1e3:.1f}", f"{m1 * 1e3:.1f}", f"{m0 / base:.3f}",
                    f"{res[0]['kept'] / 2**20:.2f}", f"{res[1]['kept'] / 2**20:.2f}",
                    f"{res[0]['losses'][0]:.5f} / {res[0]['losses'][-1]:.5f}")
    con.print(tab)


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=12, help="timed steps (after warm-up) per round")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--rounds", type=int, default=2, help="spawns per m; times pooled")
    p.add_argument("-m", "--microbatches", default="4,8", help="comma-separated microbatch counts (>= 2p = 4)")
    p.add_argument("--mb", type=int, default=2, help="sequences per microbatch")
    add_gpt_flags(p, d_model=256, layers=8, heads=4, seq=64, vocab=4096)
    p.add_argument("--lr", type=float, default=1e-3)
    a = p.parse_args()
    ms = [int(m) for m in a.microbatches.split(",")]
    if any(m < 2 * PP or m % PP for m in ms):
        p.error(f"every m must be a multiple of pp={PP} and at least 2p={2 * PP} (interleaved 1F1B, ZB-V)")
    if a.layers < 2 * PP:
        p.error(f"need at least {2 * PP} layers: one per chunk")

    from rich.console import Console

    con = Console(width=max(Console().width, 150))
    con.print(f"gpt d_model={a.d_model} layers={a.layers} heads={a.heads} seq={a.seq} vocab={a.vocab} (untied head); "
              f"pp={PP}, microbatch {a.mb}x{a.seq}; {a.rounds} round(s) x {a.steps} timed steps; torch "
              f"{torch.__version__}, {os.cpu_count()} CPUs, load {'/'.join(f'{x:.2f}' for x in os.getloadavg())}")
    for m in ms:
        a.microbatches = m
        run(a, con)


if __name__ == "__main__":
    main()
