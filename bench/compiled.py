"""Benchmark: compiled chunks (``compile=True``, Inductor) against eager ones, and against the peers (2 CPU ranks).

The same nanoGPT-style ``gpt`` model (same seed, weights, batches, AdamW) on 2
gloo ranks (1 thread each), every system side by side in one spawn, step by
step (``pipeline_vs_torch.timed_steps``):

- autopar at tp=2, dp=2, pp=2 1F1B, pp=2 interleaved (v=2) and the
  zero-bubble 'zb-h1' and 'zbv' (v=2), each eager and compiled (zero-bubble's
  backward graph split into B and W before compiling);
- PyTorch's pipelining on the same chunks: ``ScheduleInterleaved1F1B`` with
  eager stages and with ``torch.compile``d stages, ``ScheduleZBVZeroBubble``
  with eager stages (it refuses compiled ones);
- ``torch.compile`` of the whole model on each rank alone (no parallelism: the
  rank's step over the whole global batch, the yardstick for what compiling
  buys one process).

Reported: median step time per system (rank 0 and rank 1), its ratio to the
same layout's eager autopar, and to PyTorch's Interleaved1F1B (the faster of its
eager and compiled forms); compile seconds (autopar: ``engine.compiled()``,
summed over the rank's chunk graphs; the others: the first step's time less the
median); and the loss at the first and last step. Targets in the project's
issue: compiled at most 0.8x eager at the same layout; the best zero-bubble
schedule at least 10% faster than PyTorch's Interleaved1F1B at m = 2p.

    .venv/bin/python bench/compiled.py [--steps 10 --layers 4 --d-model 256 -m 4]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import autopar  # noqa: E402
from gpt_flags import add_gpt_flags  # noqa: E402
from pipeline_vs_torch import make_model, timed_steps  # noqa: E402
from tp_vs_dtensor import make_batches  # noqa: E402
from zero_bubble import build_torch, chunk_splits  # noqa: E402

LAYOUTS = {  # name -> parallelize() layout (m filled in from -m)
    "tp2": dict(tp=2),
    "dp2": dict(dp=2),
    "pp2 1f1b": dict(pp=2, schedule="1f1b"),
    "pp2 interleaved": dict(pp=2, virtual_stages=2, schedule="interleaved"),
    "pp2 zb-h1": dict(pp=2, schedule="zb-h1"),
    "pp2 zbv": dict(pp=2, virtual_stages=2, schedule="zbv"),
}
COMPILABLE = tuple(LAYOUTS)
BASELINE = "torch interleaved"


def build_autopar(a, layout: dict, rec: dict, **options):
    """-> step(x, y): autopar's train_step + AdamW for ``layout`` with ``parallelize``'s ``options``
    (``compile=``, ``overlap=``); with compiled chunks ``rec['compile_s']`` and ``rec['cache']`` are
    filled after the first step."""
    m = a.microbatches if layout.get("pp", 1) > 1 else 1
    x, y = make_batches(a)[0]
    rows = a.batch // (layout.get("dp", 1) * m)
    program = autopar.parallelize(make_model(a), example_inputs=(x[:rows],), example_targets=y[:rows],
                                  microbatches=m, **options, **layout)
    engine = program.materialize()
    opt = torch.optim.AdamW(engine.parameters(), lr=a.lr)

    def step(x, y):
        loss = engine.train_step(x, y)
        opt.step()
        opt.zero_grad(set_to_none=True)
        reports = engine.compiled().values()
        if reports:
            rec["compile_s"] = sum(r.seconds for r in reports)
            rec["cache"] = (sum(r.cache_hits for r in reports), sum(r.cache_misses for r in reports),
                            sum(r.waited_s for r in reports))
        return loss

    return step


def build_whole(a, rec: dict):
    """-> step(x, y): ``torch.compile`` of the unsplit model on this rank alone, AdamW."""
    from autopar import lm_cross_entropy

    model = make_model(a)
    fast = torch.compile(model)
    opt = torch.optim.AdamW(model.parameters(), lr=a.lr)

    def step(x, y):
        loss = lm_cross_entropy(fast(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return float(loss.detach())

    return step


def worker(a, splits):
    torch.set_num_threads(1)
    batches = make_batches(a)
    recs: dict[str, dict] = {}
    steps = {}
    for name, layout in LAYOUTS.items():
        for mode in (None, "inductor") if name in COMPILABLE else (None,):
            label = f"autopar {name}" + (" compiled" if mode else "")
            if a.systems and not any(k in label for k in a.systems):
                continue
            recs[label] = {}
            steps[label] = build_autopar(a, layout, recs[label], compile=mode)
    for label, sched, comp in (("torch interleaved", "torch-interleaved", False),
                               ("torch interleaved compiled", "torch-interleaved", True),
                               ("torch zbv", "torch-zbv", False)):
        if a.systems and label != BASELINE and not any(k in label for k in a.systems):
            continue
        recs[label] = {}
        steps[label] = build_torch(a, sched, recs[label], splits["zbv" if "zbv" in sched else "interleaved"],
                                   compile_stages=comp)
    if not a.systems:
        recs["torch.compile whole model, 1 rank"] = {}
        steps["torch.compile whole model, 1 rank"] = build_whole(a, recs["torch.compile whole model, 1 rank"])
    if dist.get_rank() == 0:
        print(f"built {len(steps)} systems; first steps compile (Inductor, tens of seconds per graph)", flush=True)
    res = timed_steps(steps, batches, a.warmup, flip=False)
    out = {}
    for name in steps:
        med = statistics.median(res[name]["times"])
        out[name] = {"median": med, "losses": res[name]["losses"],
                     "compile_s": recs[name].get("compile_s", res[name]["first_s"] - med)}
        if "cache" in recs[name]:
            out[name]["cache"] = recs[name]["cache"]
    return out


def _cache(rec: dict) -> str:
    """A compiled system's Inductor cache hits of all its graphs, and the seconds it waited for the
    rank compiling them first."""
    if "cache" not in rec:
        return ""
    hits, misses, waited = rec["cache"]
    return f"{hits}/{hits + misses}, {waited:.1f}"


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=10, help="timed steps (after warm-up)")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("-m", "--microbatches", type=int, default=4, help="microbatches of the pipeline layouts (2p = 4)")
    p.add_argument("--mb", type=int, default=2, help="sequences per microbatch")
    add_gpt_flags(p, d_model=256, layers=4, heads=4, seq=64, vocab=4096)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--systems", nargs="*", default=[],
                   help="run only the systems whose names hold one of these words (and the baseline)")
    a = p.parse_args()
    a.batch = a.mb * a.microbatches

    from rich.console import Console
    from rich.table import Table

    con = Console(width=max(Console().width, 130))
    con.print(f"gpt d_model={a.d_model} layers={a.layers} heads={a.heads} seq={a.seq} vocab={a.vocab}; global batch "
              f"{a.batch}x{a.seq}, m={a.microbatches} on the pipelines; {a.steps} timed steps; torch "
              f"{torch.__version__}, {os.cpu_count()} CPUs")
    ranks = autopar.spawn(worker, nprocs=2, args=(a, chunk_splits(a)), timeout_s=3600)
    base = min(ranks[0][n]["median"] for n in (BASELINE, BASELINE + " compiled") if n in ranks[0])
    tab = Table(title="step time, median of the timed steps (ms); ratios on rank 0")
    for col in ("system", "rank 0", "rank 1", "/ eager same layout", f"/ {BASELINE} (faster form)",
                "compile s r0 / r1", "r1: cache hits, waited s", "loss first / last"):
        tab.add_column(col, justify="left" if col == "system" else "right")
    for name, r0 in ranks[0].items():
        eager = ranks[0].get(name.removesuffix(" compiled"))
        same = f"{r0['median'] / eager['median']:.3f}" if name.endswith("compiled") and eager else ""
        tab.add_row(name, f"{r0['median'] * 1e3:.1f}", f"{ranks[1][name]['median'] * 1e3:.1f}", same,
                    f"{r0['median'] / base:.3f}", f"{r0['compile_s']:.1f} / {ranks[1][name]['compile_s']:.1f}",
                    _cache(ranks[1][name]),
                    f"{r0['losses'][0]:.4f} / {r0['losses'][-1]:.4f}")
    con.print(tab)


if __name__ == "__main__":
    main()
