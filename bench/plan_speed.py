"""Benchmark: how long the planner's full search takes for each of the paper's configurations.

For every row of the paper's weak-scaling table (the six calibration rows and
the four larger, held-out ones) this runs ``autopar.planning.search.planner.search`` over the
whole default space (every t, p, v, micro-batch, schedule, with and without
recomputation), scoring every candidate with the closed form and re-scoring the
best 8 plus the paper's layout with the event simulator, and prints the median
wall time of ``--repeat`` runs. Before each run the per-shape caches of
``autopar.planning.cost.op_times`` are cleared, so every run is a cold search (the planner as a
user meets it); ``--warm`` keeps them.

    .venv/bin/python bench/plan_speed.py [--repeat 5] [--warm]

Prints figures only (no assertions: a time limit is this benchmark's figure, not a test's).
"""

from __future__ import annotations

import argparse
import statistics
import time

from autopar.planning.cost import op_times  # its shape caches: layer_ops, embedding_ops, head_ops, layer_times
from autopar.planning.cost.calibration import PAPER_RUNS
from autopar.planning.cost.layout import Cluster
from autopar.planning.cost.models import get_model
from autopar.planning.search.planner import SearchSpace, search

# the held-out rows of the same table (t, p, GPUs, batch, micro-batch), as in docs/performance-model.md
HELD_OUT = (("gpt-145b", 8, 8, 1536, 2304), ("gpt-310b", 8, 16, 1920, 2160),
            ("gpt-530b", 8, 35, 2520, 2520), ("gpt-1t", 8, 64, 3072, 3072))


def _clear_caches() -> None:
    for fn in (op_times.layer_ops, op_times.embedding_ops, op_times.head_ops, op_times.layer_times):
        fn.cache_clear()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeat", type=int, default=5, help="runs per configuration (median reported)")
    ap.add_argument("--warm", action="store_true",
                    help="keep autopar.planning.cost.op_times's shape caches between runs")
    args = ap.parse_args()

    configs = [(r.model, r.gpus, r.batch, r.dp_overlap) for r in PAPER_RUNS]
    configs += [(name, gpus, batch, False) for name, _, _, gpus, batch in HELD_OUT]
    print(f"full planner search, default space, median of {args.repeat} {'warm' if args.warm else 'cold'} runs")
    print(f"{'model':10} {'GPUs':>5} {'batch':>5} {'layouts':>8} {'fit':>6} {'median s':>9} {'min s':>7} "
          f"{'max s':>7}  best layout")
    total = 0.0
    for name, gpus, batch, overlap in configs:
        spec = get_model(name)
        cluster = Cluster.of(gpus, "dgx-a100-80gb", batch)
        space = SearchSpace(dp_overlap=overlap)
        times, plan = [], None
        for _ in range(args.repeat):
            if not args.warm:
                _clear_caches()
            t0 = time.perf_counter()
            plan = search(spec, cluster, space)
            times.append(time.perf_counter() - t0)
        med = statistics.median(times)
        total += med
        best = plan.best.layout.short if plan.ranked else "(none fits)"
        n_fit = plan.evaluated - plan.rejected.get("does not fit in memory", 0)
        print(f"{name:10} {gpus:5} {batch:5} {plan.evaluated:8} {n_fit:6} {med:9.3f} {min(times):7.3f} "
              f"{max(times):7.3f}  {best}")
    print(f"sum of medians: {total:.2f} s")


if __name__ == "__main__":
    main()
