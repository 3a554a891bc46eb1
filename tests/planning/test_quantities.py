"""Figures in words at a cluster's scale and at two CPU ranks' (tier a): never a 0 for a small value."""

from __future__ import annotations

import dataclasses

from autopar.cli.render import plan_table, plan_units
from autopar.planning.cost.layout import Cluster
from autopar.planning.cost.models import get_model
from autopar.planning.quantities import count, nbytes, rate, seconds
from autopar.planning.search.planner import SearchSpace, search


def test_each_figure_takes_the_prefix_that_keeps_it_between_1_and_1000():
    assert seconds(12.5) == "12.5 s"
    assert seconds(0.0312) == "31.2 ms"
    assert seconds(4.2e-5) == "42 us"
    assert seconds(0.0) == "0 s"
    assert rate(2.2e11, "FLOP") == "220 GFLOP/s"
    assert rate(1.55e12, "B") == "1.55 TB/s"
    assert rate(5.59e8, "B") == "559 MB/s"
    assert count(4.71e5) == "471k"
    assert count(1.7e9) == "1.7B"
    assert nbytes(2.5 * 2**30) == "2.5 GiB"
    assert nbytes(23 * 2**20) == "23 MiB"
    assert nbytes(999.9 * 2**20) == "1000 MiB" and nbytes(1023 * 2**20) == "1023 MiB"


def test_the_plan_table_of_a_small_model_reads_in_ms_gflops_and_mib():
    spec = dataclasses.replace(get_model("gpt-1.7b"), layers=4, hidden=128, heads=4, seq_len=64, vocab=512)
    plan = search(spec, Cluster.of(2, "dgx-a100-80gb", 8), SearchSpace(), top=5)
    units = plan_units(plan.ranked[:5])
    assert units["iter s"] == ("iter ms", 1e3) and units["GiB"] == ("MiB", 1 / 2**20)
    table = plan_table(plan, 5)
    headers = [c.header for c in table.columns]
    assert "iter ms" in headers and "MiB" in headers and "comm ms" in headers
    best = plan.ranked[0]
    assert next(iter(table.columns[headers.index("iter ms")].cells)) == f"{best.t_iter * 1e3:.3f}"
    # a cluster's plan keeps seconds, TFLOP/s and GiB
    big = search(get_model("gpt-39b"), Cluster.of(512, "dgx-a100-80gb", 1536), SearchSpace(), top=3)
    assert {h: u[0] for h, u in plan_units(big.ranked[:3]).items()} == {
        "iter s": "iter s", "comm s": "comm s", "TFLOP/s": "TFLOP/s", "GiB": "GiB"}
