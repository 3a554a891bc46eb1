"""Benchmark: autopar pipeline parallelism vs torch.distributed.pipelining (pp=2, CPU, gloo).

Trains the same nanoGPT-style ``gpt`` model (same seed, same weights, same
batches, AdamW) on 2 gloo ranks (1 thread each) with, for every schedule,

1. autopar ``parallelize(model, pp=2, virtual_stages=v, microbatches=m, schedule=...)``,
2. ``torch.distributed.pipelining``: manual ``PipelineStage``s (static shapes)
   and ``ScheduleGPipe`` / ``Schedule1F1B`` / ``ScheduleInterleaved1F1B``,

where the schedules are gpipe (v=1), 1f1b (v=1) and interleaved (v=2: 4 chunks,
chunk c on rank c % 2). Both systems run the same split: the torch stages are
cut at the layer boundaries that autopar's cost-balanced splitter chose (first
chunk: embeddings + blocks, last chunk: blocks + ln_f + lm_head), printed below.

Fairness notes:

- The LM head is **untied** (``tie_embeddings=False``) for both systems:
  torch.distributed.pipelining does not tie a parameter across stages.
- Loss: per microbatch ``F.cross_entropy(logits.flatten(0, -2), y.flatten())``
  (autopar's default). autopar backpropagates ``loss_i / m`` and reports the mean
  of the m losses; torch's schedules backpropagate ``loss_i`` and divide the
  gradients by m afterwards (``scale_grads=True``), so both produce the gradient
  of the mean. Both return the mean loss on every rank (autopar broadcasts it from
  the last stage inside ``train_step``; the torch step does the same broadcast);
  torch's ``return_outputs`` is off (autopar does not return the logits either).
- One timed step = [dist.barrier()] then perf_counter around
  ``train_step`` / ``schedule.step`` + loss broadcast + ``opt.step()`` + ``zero_grad``.

Rank 0's medians, IQR, min, CPU time, first/last losses and the autopar/torch
ratios per schedule are printed. Each ``--rounds`` round spawns one pair of
ranks that builds, per schedule, both systems side by side and runs their steps
alternately (step i of autopar next to step i of torch, which one goes first
alternating), so bursts of background load on a shared machine hit both alike;
the per-step times of all rounds are pooled, and the ratio table also gives the
median of the per-step paired ratios (the most load-robust number here).

``--profile`` adds, per configuration, a torch.profiler table of 3 steps on rank 0
and the wall time per step spent in p2p calls (autopar: ``engine.p2p.post``,
which posts a run of consecutive sends/receives as one ``batch_isend_irecv``; its
receives are waited for where they are read; torch: ``_wait_batch_p2p``, its runtime posts
receives early and waits for sends late). torch's stages initialise lazily, so
its "setup" is ~0 and its cost shows in the "1st step" column instead.

    .venv/bin/python bench/pipeline_vs_torch.py [--steps 8 --rounds 2 --schedules gpipe,1f1b -m 8 --mb 1 --profile]
"""

from __future__ import annotations

import argparse
import gc
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist
import torch.nn as nn

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import autopar  # noqa: E402
from autopar.reference.models import ModelConfig, build  # noqa: E402
from tp_vs_dtensor import _nullctx, make_batches, stats  # noqa: E402 - sibling bench's helpers
from gpt_flags import add_gpt_flags  # noqa: E402
from pooling import pool_round  # noqa: E402

PP = 2
SCHEDULES = {"gpipe": 1, "1f1b": 1, "interleaved": 2}  # schedule -> virtual stages per rank
SYSTEMS = ("autopar", "torch")


# ----------------------------------------------------------------- helpers
def make_cfg(a) -> ModelConfig:
    return ModelConfig(vocab_size=a.vocab, seq_len=a.seq, n_layer=a.layers, n_head=a.heads, d_model=a.d_model,
                       tie_embeddings=False)


def make_model(a):
    torch.manual_seed(0)  # identical initial weights in every configuration / rank
    return build("gpt", make_cfg(a))


def example_microbatch(a):
    g = torch.Generator().manual_seed(99)
    return (torch.randint(0, a.vocab, (a.mb, a.seq), generator=g),
            torch.randint(0, a.vocab, (a.mb, a.seq), generator=g))


def compile_autopar(model, a, schedule: str):
    x, y = example_microbatch(a)
    return autopar.parallelize(model, pp=PP, virtual_stages=SCHEDULES[schedule], microbatches=a.microbatches,
                               schedule=schedule, example_inputs=(x,), example_targets=y)


def timed_steps(steps: dict, batches, warmup: int, flip: bool):
    """Run every system's ``step(x, y) -> float`` on every batch, the systems alternating step by step.

    Each step starts after a barrier. Step i of one system runs right next to step i of the other, and
    which goes first alternates (and is flipped per round), so a burst of background load on a shared
    machine hits both alike; the steps after ``warmup`` are timed.
    """
    names = list(steps)
    out = {n: {"times": [], "cpu": [], "losses": [], "first_s": 0.0} for n in names}
    for i, (x, y) in enumerate(batches):
        for n in (names if (i % 2 == 0) != flip else names[::-1]):
            dist.barrier()
            c0, t0 = time.process_time(), time.perf_counter()
            out[n]["losses"].append(steps[n](x, y))
            t1, c1 = time.perf_counter(), time.process_time()
            if i == 0:
                out[n]["first_s"] = t1 - t0  # includes lazy initialisation (torch's stages exchange metadata)
            if i >= warmup:
                out[n]["times"].append(t1 - t0)
                out[n]["cpu"].append(c1 - c0)
    return out


class _P2PTimer:
    """While active, wrap a p2p function in ``record_function(label)`` and add up its wall time.

    autopar: ``engine.p2p.post`` (posts a run of sends and receives as one ``batch_isend_irecv``; the
    receives are waited for where they are read); torch: ``schedules._wait_batch_p2p`` (the runtime posts ops early and waits for receives
    right before use, for sends late). Only used for the profiled steps, never for the timed ones.
    """

    def __init__(self, owner, attr: str, label: str):
        self.owner, self.attr, self.label, self.seconds = owner, attr, label, 0.0

    def __enter__(self):
        from torch.profiler import record_function

        fn = self.orig = getattr(self.owner, self.attr)

        def wrapped(*args, **kwargs):
            t0 = time.perf_counter()
            with record_function(self.label):
                r = fn(*args, **kwargs)
            self.seconds += time.perf_counter() - t0
            return r

        setattr(self.owner, self.attr, wrapped)
        return self

    def __exit__(self, *exc):
        if self.owner.__dict__.get(self.attr) is not None and isinstance(self.owner, nn.Module):
            delattr(self.owner, self.attr)  # back to the class's method
        else:
            setattr(self.owner, self.attr, self.orig)
        return False


def profile_steps(step, batch, n: int = 3):
    """torch.profiler ``n`` steps on rank 0 (the other rank runs them unrecorded: p2p); top ops by self CPU.

    Also reports the wall time per step and the part of it spent in p2p calls (see ``_P2PTimer``).
    """
    from torch.distributed.pipelining import schedules as tsched
    from torch.profiler import ProfilerActivity, profile as tprofile

    if step.engine is not None:
        timer = _P2PTimer(step.engine.p2p, "post", "autopar p2p: batch_isend_irecv posted")
    else:
        timer = _P2PTimer(tsched, "_wait_batch_p2p", "torch p2p: _wait_batch_p2p")
    record = dist.get_rank() == 0
    with timer, (tprofile(activities=[ProfilerActivity.CPU]) if record else _nullctx()) as prof:
        wall = 0.0
        for _ in range(n):
            dist.barrier()
            t0 = time.perf_counter()
            step(*batch)
            wall += time.perf_counter() - t0
    if not record:
        return None
    return (f"{n} steps: wall {wall / n * 1e3:.1f} ms/step, of which in p2p calls {timer.seconds / n * 1e3:.1f} "
            f"ms/step ({timer.label})\n"
            + prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=18))


def _record_grad_sq(rec: dict, params) -> None:
    """On the first step only (a warm-up step): sum of squared gradients of this rank's parameters."""
    if "grad_sq" not in rec:
        rec["grad_sq"] = sum(float(q.grad.double().square().sum()) for q in params if q.grad is not None)


# ------------------------------------------------------------------ autopar
def build_autopar(a, schedule: str, rec: dict):
    """-> step(x, y) -> float: train_step + AdamW step."""
    model = make_model(a)
    t0 = time.perf_counter()
    program = compile_autopar(model, a, schedule)
    engine = program.materialize()
    rec["setup_s"] = time.perf_counter() - t0
    params = list(engine.parameters())
    opt = torch.optim.AdamW(params, lr=a.lr)

    def step(x, y):
        loss = engine.train_step(x, y)  # mean loss, on every rank
        _record_grad_sq(rec, params)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss

    step.engine = engine  # for profile_steps
    return step


# ------------------------------------------------------------------- torch
class FirstChunk(nn.Module):
    """Embeddings (token + learned positions) and the first blocks."""

    def __init__(self, model, layers):
        super().__init__()
        self.wte, self.wpe, self.drop = model.wte, model.wpe, model.drop
        self.blocks = nn.ModuleList(model.h[i] for i in layers)

    def forward(self, idx):
        x = self.drop(self.wte(idx) + self.wpe(torch.arange(idx.shape[1], device=idx.device)))
        for b in self.blocks:
            x = b(x)
        return x


class MiddleChunk(nn.Module):
    def __init__(self, model, layers):
        super().__init__()
        self.blocks = nn.ModuleList(model.h[i] for i in layers)

    def forward(self, x):
        for b in self.blocks:
            x = b(x)
        return x


class LastChunk(nn.Module):
    """The last blocks, final LayerNorm and the (untied) LM head: returns the logits."""

    def __init__(self, model, layers):
        super().__init__()
        self.blocks = nn.ModuleList(model.h[i] for i in layers)
        self.ln_f, self.lm_head = model.ln_f, model.lm_head

    def forward(self, x):
        for b in self.blocks:
            x = b(x)
        return self.lm_head(self.ln_f(x))


def build_torch(a, schedule: str, rec: dict, layer_of_chunk):
    """-> step(x, y) -> float: schedule.step + loss broadcast + AdamW step."""
    from torch.distributed.pipelining import (PipelineStage, Schedule1F1B, ScheduleGPipe,
                                              ScheduleInterleaved1F1B)

    rank = dist.get_rank()
    n_chunks = len(layer_of_chunk)
    model = make_model(a)
    t0 = time.perf_counter()
    # static stage metadata (no shape-inference round trip); requires_grad is part of it: without it the
    # receiving stage's input would not require grad and no gradient would flow back to the previous stage
    hidden = torch.empty(a.mb, a.seq, a.d_model, requires_grad=True)
    tokens = torch.zeros(a.mb, a.seq, dtype=torch.long)
    logits = torch.empty(a.mb, a.seq, a.vocab, requires_grad=True)
    stages, modules = [], []
    for c in range(rank, n_chunks, PP):  # chunk c lives on rank c % pp (torch's loop-style placement)
        if c == 0:
            mod, inp = FirstChunk(model, layer_of_chunk[c]), tokens
        elif c == n_chunks - 1:
            mod, inp = LastChunk(model, layer_of_chunk[c]), hidden
        else:
            mod, inp = MiddleChunk(model, layer_of_chunk[c]), hidden
        out = logits if c == n_chunks - 1 else hidden
        modules.append(mod)
        stages.append(PipelineStage(mod, c, n_chunks, torch.device("cpu"), input_args=(inp,), output_args=(out,)))
    loss_fn = autopar.lm_cross_entropy  # F.cross_entropy(logits.flatten(0, -2), y.flatten())
    if schedule == "interleaved":
        sched = ScheduleInterleaved1F1B(stages, n_microbatches=a.microbatches, loss_fn=loss_fn)
    else:
        cls = ScheduleGPipe if schedule == "gpipe" else Schedule1F1B
        sched = cls(stages[0], n_microbatches=a.microbatches, loss_fn=loss_fn)
    rec["setup_s"] = time.perf_counter() - t0
    params = [p for mod in modules for p in mod.parameters()]
    opt = torch.optim.AdamW(params, lr=a.lr)
    first, last = rank == 0, rank == (n_chunks - 1) % PP

    def step(x, y):
        losses = []
        args = (x,) if first else ()
        sched.step(*args, target=y if last else None, losses=losses if last else None, return_outputs=False)
        # the mean loss on every rank, as autopar's train_step returns it
        loss = torch.stack(losses).detach().mean().reshape(1) if last else torch.empty(1)
        dist.broadcast(loss, src=(n_chunks - 1) % PP)
        _record_grad_sq(rec, params)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return float(loss)

    step.engine = None
    return step


# ----------------------------------------------------------------- worker
def worker(a, rnd: int, splits):
    """Every configuration of one round on this rank: per schedule, both systems side by side."""
    batches = make_batches(a)
    out = {}
    for schedule in a.schedules:
        recs = {system: {} for system in SYSTEMS}
        steps = {"autopar": build_autopar(a, schedule, recs["autopar"]),
                 "torch": build_torch(a, schedule, recs["torch"], splits[schedule])}
        res = timed_steps(steps, batches, a.warmup, flip=rnd % 2 == 1)
        for system in SYSTEMS:
            out[(schedule, system)] = {**res[system], **recs[system]}
            if a.profile and rnd == 0:
                out[(schedule, system)]["profile"] = profile_steps(steps[system], batches[-1])
        del steps
        gc.collect()
    return out


# -------------------------------------------------------------------- main
def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=16, help="timed steps (after warm-up) per round")
    p.add_argument("--warmup", type=int, default=2, help="untimed warm-up steps per round")
    p.add_argument("--rounds", type=int, default=3,
                   help="spawn the ranks this many times, each running every configuration; times are pooled")
    p.add_argument("--schedules", default="gpipe,1f1b,interleaved",
                   help=f"comma-separated subset of {list(SCHEDULES)}")
    p.add_argument("--microbatches", "-m", type=int, default=4, help="microbatches per step")
    p.add_argument("--mb", type=int, default=2, help="sequences per microbatch (global batch = mb * m)")
    add_gpt_flags(p, d_model=256, layers=4, heads=4, seq=64, vocab=4096)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--profile", action="store_true",
                   help="after timing (round 1), torch.profiler 3 steps on rank 0 of every configuration, with the "
                        "time spent in p2p calls")
    a = p.parse_args()
    a.schedules = [s.strip() for s in a.schedules.split(",") if s.strip()]
    bad = [s for s in a.schedules if s not in SCHEDULES]
    if bad:
        p.error(f"unknown schedule(s) {bad}; choose from {list(SCHEDULES)}")
    if a.d_model % a.heads:
        p.error("d_model must be divisible by heads")
    if a.microbatches < PP or a.microbatches % PP:
        p.error(f"microbatches must be a multiple of pp={PP} (1f1b/interleaved)")
    if a.layers < PP * max(SCHEDULES[s] for s in a.schedules):
        p.error("need at least one layer per chunk")
    a.batch = a.mb * a.microbatches  # for make_batches: global batch (mb * m, T)

    from rich.console import Console
    from rich.table import Table

    con = Console(width=max(Console().width, 150))  # wide enough for the table when piped
    cfg = make_cfg(a)
    model = make_model(a)
    n_params = sum(q.numel() for q in model.parameters())
    con.print(f"[bold]model[/]: gpt (nanoGPT-style, [bold]untied[/] LM head for both systems) {cfg}")
    con.print(f"params={n_params / 1e6:.2f}M; pp={PP}, m={a.microbatches} microbatches of {a.mb}x{a.seq} tokens "
              f"(global batch {a.batch}x{a.seq}); AdamW lr={a.lr}; {a.rounds} round(s) of warm-up {a.warmup} + "
              f"{a.steps} timed steps")
    con.print(f"torch {torch.__version__}, {os.cpu_count()} CPUs, load avg at start "
              f"{'/'.join(f'{x:.2f}' for x in os.getloadavg())}; 2 gloo ranks, 1 thread each")

    # the chunk boundaries autopar picks; torch's stages use the same ones
    splits = {}
    for s in a.schedules:
        splits[s] = [list(c) for c in compile_autopar(make_model(a), a, s).split.layer_of_chunk]
        con.print(f"  {s:12s} v={SCHEDULES[s]}: blocks per chunk {splits[s]} (chunk c on rank c % {PP}; chunk 0 "
                  f"also holds the embeddings, the last chunk ln_f + lm_head + loss)")

    # reference loss of step 1 in one process (mean of the per-microbatch means = the full-batch mean)
    x0, y0 = make_batches(a)[0]
    loss = autopar.lm_cross_entropy(model(x0), y0)
    loss.backward()
    ref_loss = float(loss.detach())
    ref_gnorm = sum(float(q.grad.double().square().sum()) for q in model.parameters()) ** 0.5
    del model, loss

    runs: dict[tuple[str, str], list[dict]] = {}  # (schedule, system) -> per-rank dicts, times pooled
    t_all = time.perf_counter()
    for rnd in range(a.rounds):
        res = autopar.spawn(worker, nprocs=PP, args=(a, rnd, splits))
        for key in res[0]:
            pool_round(runs, key, [r[key] for r in res], summed=("times", "cpu"), peaks=("setup_s", "first_s"))
    total_s = time.perf_counter() - t_all

    med, medcpu = {}, {}
    tab = Table(title="step time = train_step / schedule.step + loss broadcast + AdamW step, rank 0 (cpu/wall = "
                      "process CPU time / wall time per step, <1 means waiting on the peer or descheduled; "
                      "setup = parallelize + materialize / stage + schedule construction, 1st step = the first "
                      "warm-up step, which includes lazy initialisation; both the worst over rounds)")
    for col in ("schedule", "system", "median ms", "IQR ms", "min ms", "rank 1 median ms", "CPU ms", "cpu/wall",
                "setup s", "1st step s", "loss step 1", f"loss step {a.warmup + a.steps}"):
        tab.add_column(col, justify="left" if col in ("schedule", "system") else "right")
    for (s, system), res in runs.items():
        r0 = res[0]
        m, iqr = stats(r0["times"])
        med[s, system] = m
        medcpu[s, system] = statistics.median(r0["cpu"])
        cw = statistics.median(c / t for c, t in zip(r0["cpu"], r0["times"]))
        tab.add_row(s, system, f"{m * 1e3:.1f}", f"{iqr * 1e3:.1f}", f"{min(r0['times']) * 1e3:.1f}",
                    f"{statistics.median(res[1]['times']) * 1e3:.1f}", f"{medcpu[s, system] * 1e3:.1f}",
                    f"{cw:.2f}", f"{r0['setup_s']:.2f}", f"{r0['first_s']:.2f}", f"{r0['losses'][0]:.6f}",
                    f"{r0['losses'][-1]:.6f}")
    con.print(tab)

    # sanity: both ranks report the same loss; both systems agree with the reference on step 1 and each other later
    con.print(f"reference step 1 (1 process, full batch): loss {ref_loss:.6f}, gradient norm {ref_gnorm:.6f}")
    for (s, system), res in runs.items():
        if any(abs(x - y) > 1e-6 for x, y in zip(res[0]["losses"], res[1]["losses"])):
            con.print(f"[red]WARNING[/]: {s}/{system}: ranks disagree on the loss")
        d0 = abs(res[0]["losses"][0] - ref_loss)
        gnorm = sum(r["grad_sq"] for r in res) ** 0.5  # the ranks hold disjoint parameters
        dg = abs(gnorm / ref_gnorm - 1)
        flag = "" if d0 < 1e-4 and dg < 1e-4 else "  [red]<-- step 1 differs from the reference![/]"
        con.print(f"  {s:12s} {system:8s} step 1: loss {res[0]['losses'][0]:.6f} (|diff| {d0:.1e}), "
                  f"gradient norm {gnorm:.6f} (rel. diff {dg:.1e}){flag}")
    for s in a.schedules:
        if (s, "autopar") in runs and (s, "torch") in runs:
            la, lt = runs[s, "autopar"][0]["losses"], runs[s, "torch"][0]["losses"]
            dmax = max(abs(x - y) for x, y in zip(la, lt))
            flag = "" if dmax < 1e-3 else "  [red]<-- the systems train differently![/]"
            con.print(f"  {s:12s} max |autopar - torch| loss over {len(la)} steps: {dmax:.2e}{flag}")

    rt = Table(title="autopar / torch.distributed.pipelining, ratios of rank-0 medians (<1: autopar is faster); "
                     "CPU-time ratios are less sensitive to background load")
    for col in ("schedule", "step time", "paired step time (IQR)", "min step time", "CPU time",
                "rank 1 step time"):
        rt.add_column(col, justify="left" if col == "schedule" else "right")
    for s in a.schedules:
        if (s, "autopar") in med and (s, "torch") in med:
            ta, tt = runs[s, "autopar"][0]["times"], runs[s, "torch"][0]["times"]
            pm, piqr = stats([x / y for x, y in zip(ta, tt)])  # step i of both ran back to back
            r1 = (statistics.median(runs[s, "autopar"][1]["times"]) /
                  statistics.median(runs[s, "torch"][1]["times"]))
            rt.add_row(s, f"{med[s, 'autopar'] / med[s, 'torch']:.3f}", f"{pm:.3f} ({piqr:.3f})",
                       f"{min(ta) / min(tt):.3f}", f"{medcpu[s, 'autopar'] / medcpu[s, 'torch']:.3f}", f"{r1:.3f}")
    con.print(rt)
    con.print(f"total wall time of the runs: {total_s:.1f}s; load avg now "
              f"{'/'.join(f'{x:.2f}' for x in os.getloadavg())}")

    if a.profile:
        for (s, system), res in runs.items():
            if res[0].get("profile"):
                con.print(f"\n[bold]profile, rank 0: {s} / {system}[/]")
                print(res[0]["profile"])


if __name__ == "__main__":
    main()
