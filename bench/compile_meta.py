"""Benchmark: time and memory of compiling a GPT-3 175B-shaped model on the meta device.

The model (vocabulary 50257, sequence 2048, 96 layers, 96 heads, hidden 12288)
is built under ``torch.device("meta")`` (no weights are allocated) and compiled
by ``autopar.parallelize`` for tp=8, pp=16, 3 virtual stages per rank and 64
microbatches: tracing, the tensor-parallel rewrite, rank-local shapes, the
pipeline split into 48 chunks and the lowered schedule.

Each measurement runs in a fresh subprocess, so imports and caches of one run
do not leak into the next:

- ``time`` runs: wall time of ``parallelize`` (and of building the model), and the
  process's peak resident set (``resource.getrusage(RUSAGE_SELF).ru_maxrss``)
  before and after compiling;
- one ``tracemalloc`` run: the peak of Python-level allocations during
  ``parallelize`` (tracemalloc slows the run down, so its time is not reported).

    .venv/bin/python bench/compile_meta.py [--repeat 3] [--no-tracemalloc]

Prints figures only (no assertions).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys

CHILD = r"""
import json, resource, sys, time, tracemalloc
trace = sys.argv[1] == "1"
rss0 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
import torch, autopar
from autopar.reference.models import ModelConfig, build
rss_import = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
t0 = time.perf_counter()
with torch.device("meta"):
    model = build("gpt", ModelConfig(vocab_size=50257, seq_len=2048, n_layer=96, n_head=96, d_model=12288))
t_build = time.perf_counter() - t0
x = torch.zeros(1, 2048, dtype=torch.long)
rss_built = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
if trace:
    tracemalloc.start()
t0 = time.perf_counter()
program = autopar.parallelize(model, tp=8, pp=16, virtual_stages=3, microbatches=64,
                              example_inputs=(x,), example_targets=x.clone())
t_compile = time.perf_counter() - t0
peak_py = tracemalloc.get_traced_memory()[1] if trace else None
if trace:
    tracemalloc.stop()
rss_end = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
n_nodes = len(program.traced.gm.graph.nodes)
chunks = len(program.split.chunks)
actions = sum(len(a) for a in program.schedule.actions.values())
print(json.dumps({"build_s": t_build, "compile_s": t_compile, "rss_import_kb": rss_import,
                  "rss_built_kb": rss_built, "rss_end_kb": rss_end, "tracemalloc_peak_b": peak_py,
                  "nodes": n_nodes, "chunks": chunks, "schedule_actions": actions}))
"""


def _child(trace: bool) -> dict:
    out = subprocess.run([sys.executable, "-c", CHILD, "1" if trace else "0"], capture_output=True, text=True,
                         check=False)
    if out.returncode != 0:
        raise SystemExit(f"child failed ({out.returncode}):\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeat", type=int, default=3, help="timed runs, each in a fresh process (median reported)")
    ap.add_argument("--no-tracemalloc", action="store_true", help="skip the tracemalloc run")
    args = ap.parse_args()

    runs = [_child(False) for _ in range(args.repeat)]
    mib = 1024  # ru_maxrss is in KiB on Linux
    r0 = runs[0]
    print("GPT-3 175B shape (V=50257, s=2048, l=96, a=96, h=12288) on meta; "
          "parallelize(tp=8, pp=16, virtual_stages=3, microbatches=64)")
    print(f"  graph nodes {r0['nodes']}, pipeline chunks {r0['chunks']}, lowered schedule actions "
          f"{r0['schedule_actions']}")
    comp = [r["compile_s"] for r in runs]
    build = [r["build_s"] for r in runs]
    print(f"  build model on meta: median {statistics.median(build):.2f} s")
    print(f"  parallelize:         median {statistics.median(comp):.2f} s  (min {min(comp):.2f}, max {max(comp):.2f}, "
          f"{len(comp)} fresh processes)")
    rss = [r["rss_end_kb"] / mib for r in runs]
    grow = [(r["rss_end_kb"] - r["rss_built_kb"]) / mib for r in runs]
    print(f"  peak RSS after import {statistics.median([r['rss_import_kb'] / mib for r in runs]):.0f} MiB, "
          f"after building {statistics.median([r['rss_built_kb'] / mib for r in runs]):.0f} MiB, "
          f"after parallelize {statistics.median(rss):.0f} MiB (parallelize adds {statistics.median(grow):.0f} MiB)")
    if not args.no_tracemalloc:
        t = _child(True)
        print(f"  tracemalloc peak of Python allocations during parallelize: {t['tracemalloc_peak_b'] / 2**20:.0f} MiB "
              f"(that run, slowed by tracing: {t['compile_s']:.2f} s)")


if __name__ == "__main__":
    main()
