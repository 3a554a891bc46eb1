"""Benchmark: time and memory of compiling a GPT-3 175B-shaped model (or the paper's 1T) on the meta device.

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

    .venv/bin/python bench/compile_meta.py [--repeat 3] [--no-tracemalloc] [--layout 1t]

``--layout 1t``: the paper's 1T model (128 layers, hidden 25600) at tp=8 x pp=64
for 3,072 ranks. Both print ``parallelize``'s phases (trace, sharding, local
shapes, the pipeline split, the schedules) and the time of ``program.code`` for
every distinct rank program.

Prints figures only (no assertions).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys

LAYOUTS = {
    "175b": ("GPT-3 175B shape (V=50257, s=2048, l=96, a=96, h=12288)",
             dict(vocab_size=50257, seq_len=2048, n_layer=96, n_head=96, d_model=12288),
             dict(tp=8, pp=16, virtual_stages=3, microbatches=64)),
    "1t": ("the paper's 1T shape (V=51200, s=2048, l=128, a=160, h=25600)",
           dict(vocab_size=51200, seq_len=2048, n_layer=128, n_head=160, d_model=25600),
           dict(tp=8, pp=64, microbatches=64, world_size=3072)),
}
"""--layout -> (what it is, the model's config, parallelize's layout)."""
PHASES = ("trace_once", "normalize", "find_layers", "analyze_sharding", "apply_sequence_parallel",
          "annotate_local_shapes", "_split", "_schedules")
"""The steps of ``compiler/compile.compile_program`` timed one by one (the rest: the Program's own work)."""

CHILD = r"""
import json, resource, sys, time, tracemalloc
trace = sys.argv[1] == "1"
model_cfg, layout, phases = json.loads(sys.argv[2]), json.loads(sys.argv[3]), json.loads(sys.argv[4])
rss0 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
import torch, autopar
import autopar.compiler.compile as compile_module
from autopar.reference.models import ModelConfig, build
spent = {}

def timed(name, fn):
    def run(*args, **kwargs):
        t = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            spent[name] = spent.get(name, 0.0) + time.perf_counter() - t
    return run

for name in phases:
    setattr(compile_module, name, timed(name, getattr(compile_module, name)))
rss_import = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
t0 = time.perf_counter()
with torch.device("meta"):
    model = build("gpt", ModelConfig(**model_cfg))
t_build = time.perf_counter() - t0
x = torch.zeros(1, model_cfg["seq_len"], dtype=torch.long)
rss_built = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
if trace:
    tracemalloc.start()
t0 = time.perf_counter()
program = autopar.parallelize(model, example_inputs=(x,), example_targets=x.clone(), **layout)
t_compile = time.perf_counter() - t0
t0 = time.perf_counter()
distinct = program.config.mesh.tp * program.config.mesh.pp
for rank in range(distinct):  # the ranks of one replica: every distinct rank program
    program.code(rank)
spent["code (every distinct rank)"] = time.perf_counter() - t0
peak_py = tracemalloc.get_traced_memory()[1] if trace else None
if trace:
    tracemalloc.stop()
rss_end = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
n_nodes = len(program.traced.gm.graph.nodes)
chunks = len(program.split.chunks)
actions = sum(len(a) for a in program.schedule.actions.values())
print(json.dumps({"build_s": t_build, "compile_s": t_compile, "rss_import_kb": rss_import,
                  "rss_built_kb": rss_built, "rss_end_kb": rss_end, "tracemalloc_peak_b": peak_py,
                  "nodes": n_nodes, "chunks": chunks, "schedule_actions": actions, "phases": spent,
                  "distinct_ranks": distinct}))
"""


def _child(trace: bool, layout: str) -> dict:
    _, model_cfg, par = LAYOUTS[layout]
    out = subprocess.run([sys.executable, "-c", CHILD, "1" if trace else "0", json.dumps(model_cfg),
                          json.dumps(par), json.dumps(PHASES)], capture_output=True, text=True, check=False)
    if out.returncode != 0:
        raise SystemExit(f"child failed ({out.returncode}):\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeat", type=int, default=3, help="timed runs, each in a fresh process (median reported)")
    ap.add_argument("--no-tracemalloc", action="store_true", help="skip the tracemalloc run")
    ap.add_argument("--layout", choices=tuple(LAYOUTS), default="175b",
                    help="175b: GPT-3 at tp=8 x pp=16 (v=3); 1t: the paper's 1T at tp=8 x pp=64 (3,072 ranks)")
    args = ap.parse_args()

    runs = []
    for i in range(args.repeat):
        print(f"  run {i + 1}/{args.repeat} (a fresh process)...", flush=True)
        runs.append(_child(False, args.layout))
    mib = 1024  # ru_maxrss is in KiB on Linux
    r0 = runs[0]
    what, _, par = LAYOUTS[args.layout]
    print(f"{what} on meta; parallelize({', '.join(f'{k}={v}' for k, v in par.items())})")
    print(f"  graph nodes {r0['nodes']}, pipeline chunks {r0['chunks']}, lowered schedule actions "
          f"{r0['schedule_actions']}")
    comp = [r["compile_s"] for r in runs]
    build = [r["build_s"] for r in runs]
    print(f"  build model on meta: median {statistics.median(build):.2f} s")
    print(f"  parallelize:         median {statistics.median(comp):.2f} s  (min {min(comp):.2f}, max {max(comp):.2f}, "
          f"{len(comp)} fresh processes)")
    for name in (*PHASES, "code (every distinct rank)"):
        times = [r["phases"].get(name, 0.0) for r in runs]
        print(f"    {name:28} median {statistics.median(times):6.2f} s")
    print(f"  ({r0['distinct_ranks']} distinct rank programs: tp x pp)")
    rss = [r["rss_end_kb"] / mib for r in runs]
    grow = [(r["rss_end_kb"] - r["rss_built_kb"]) / mib for r in runs]
    print(f"  peak RSS after import {statistics.median([r['rss_import_kb'] / mib for r in runs]):.0f} MiB, "
          f"after building {statistics.median([r['rss_built_kb'] / mib for r in runs]):.0f} MiB, "
          f"after parallelize {statistics.median(rss):.0f} MiB (parallelize adds {statistics.median(grow):.0f} MiB)")
    if not args.no_tracemalloc:
        t = _child(True, args.layout)
        print(f"  tracemalloc peak of Python allocations during parallelize: {t['tracemalloc_peak_b'] / 2**20:.0f} MiB "
              f"(that run, slowed by tracing: {t['compile_s']:.2f} s)")


if __name__ == "__main__":
    main()
