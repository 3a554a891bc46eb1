"""Benchmark: ``overlap=`` on against off, on 2 CPU gloo ranks (1 thread each).

The same reference GPT (same seed, weights, batches, AdamW), each layout
compiled twice, with and without the overlap it can have:

- ``tp2 sp``: tp=2 with sequence parallelism, ``overlap={'tp'}`` (each
  all-gather decomposed with the GEMMs that read it, each reduce-scatter with
  the GEMM that writes it: ``passes/async_tp.py``) against ``overlap=False``;
- ``pp2 1f1b`` and ``pp2 interleaved`` (v=2): ``overlap={'p2p'}`` (receives
  posted as early as the exchanges allow: ``schedules/early_receives.py``)
  against ``overlap=False``.

All systems are built in one spawn and their steps alternate (step i of one
right next to step i of the other, which goes first alternating:
``pipeline_vs_torch.timed_steps``), so the load of a shared machine hits both
alike; ``--rounds`` spawns again and pools the steps of every round. Printed
per layout: rank 0's and rank 1's median step (ms) on and off, on / off (rank
0), and the median of the per-step paired ratios (step i on over step i off:
the most load-robust number here); the loss of the last step on and off
(equal: the overlap changes no value).

    .venv/bin/python bench/overlap.py [--steps 20 --rounds 3 --layouts "tp2 sp,pp2 1f1b" --d-model 256 -m 4]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import autopar  # noqa: E402
from gpt_flags import add_gpt_flags  # noqa: E402
from pipeline_vs_torch import timed_steps  # noqa: E402
from pooling import pool_round  # noqa: E402
from compiled import build_autopar  # noqa: E402
from tp_vs_dtensor import make_batches  # noqa: E402

LAYOUTS = {  # name -> (parallelize() layout, the overlap it gets)
    "tp2 sp": (dict(tp=2, sequence_parallel=True), {"tp"}),
    "pp2 1f1b": (dict(pp=2, schedule="1f1b"), {"p2p"}),
    "pp2 interleaved": (dict(pp=2, virtual_stages=2, schedule="interleaved"), {"p2p"}),
}


def worker(a):
    torch.set_num_threads(1)
    steps = {}
    for name in a.layouts:
        layout, overlap = LAYOUTS[name]
        steps[(name, "on")] = build_autopar(a, layout, {}, overlap=overlap)
        steps[(name, "off")] = build_autopar(a, layout, {}, overlap=False)
    res = timed_steps(steps, make_batches(a), a.warmup, flip=False)
    return {key: {"times": r["times"], "losses": r["losses"][-1:]} for key, r in res.items()}


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=20, help="timed steps per round (after warm-up)")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--rounds", type=int, default=1, help="spawns, their steps pooled")
    p.add_argument("-m", "--microbatches", type=int, default=4, help="microbatches of the pipeline layouts")
    p.add_argument("--mb", type=int, default=2, help="sequences per microbatch")
    p.add_argument("--layouts", default=",".join(LAYOUTS), help=f"comma-separated, of {list(LAYOUTS)}")
    add_gpt_flags(p, d_model=256, layers=4, heads=4, seq=128, vocab=4096)
    p.add_argument("--lr", type=float, default=1e-3)
    a = p.parse_args()
    a.layouts = [n.strip() for n in a.layouts.split(",")]
    a.batch = a.mb * a.microbatches
    print(f"gpt d_model={a.d_model} layers={a.layers} heads={a.heads} seq={a.seq} vocab={a.vocab}; global batch "
          f"{a.batch}x{a.seq}, m={a.microbatches} on the pipelines; {a.rounds} x {a.steps} timed steps; torch "
          f"{torch.__version__}, {os.cpu_count()} CPUs", flush=True)
    runs: dict = {}
    for _ in range(a.rounds):
        ranks = autopar.spawn(worker, nprocs=2, args=(a,), timeout_s=3600)
        for key in ranks[0]:
            pool_round(runs, key, [r[key] for r in ranks])
    print(f"{'layout':<18}{'overlap on ms':>15}{'off ms':>10}{'rank 1 on/off ms':>20}{'on / off':>10}"
          f"{'paired':>9}   loss on / off")
    for name in a.layouts:
        (on0, on1), (off0, off1) = runs[(name, "on")], runs[(name, "off")]
        med = {k: statistics.median(r["times"]) for k, r in (("on0", on0), ("on1", on1), ("off0", off0),
                                                               ("off1", off1))}
        paired = statistics.median(t1 / t0 for t1, t0 in zip(on0["times"], off0["times"]))
        other = f"{med['on1'] * 1e3:.1f} / {med['off1'] * 1e3:.1f}"
        print(f"{name:<18}{med['on0'] * 1e3:>15.1f}{med['off0'] * 1e3:>10.1f}{other:>20}"
              f"{med['on0'] / med['off0']:>10.3f}{paired:>9.3f}   {on0['losses'][0]:.6f} / {off0['losses'][0]:.6f}")


if __name__ == "__main__":
    main()
