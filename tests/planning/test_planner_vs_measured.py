"""``bench/planner_vs_measured.py``'s pieces that need no ranks: the layouts of 2 ranks it runs, Spearman's
rank correlation, the error figures and the table."""

from __future__ import annotations

import importlib.util
import math
import sys
from pathlib import Path

import pytest

from autopar.planning.cost.hardware import PROFILES
from autopar.planning.cost.layout import Cluster, layout_errors
from autopar.planning.cost.models import ModelSpec
from autopar.planning.errors import PlanError

BENCH = Path(__file__).resolve().parents[2] / "bench" / "planner_vs_measured.py"


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("planner_vs_measured", BENCH)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up by name
    try:
        spec.loader.exec_module(module)
    finally:
        del sys.modules[spec.name]
    return module


SPEC = ModelSpec(layers=4, hidden=128, heads=4, seq_len=64, vocab=512)
HW = PROFILES["dgx-a100-80gb"]


def test_every_layout_of_two_ranks_once_and_valid(bench):
    lays = bench.enumerate_layouts(SPEC, HW, global_batch=8, micro_batches=(1, 2))
    # d=2: 2 b x 2 recompute x 2 distopt; p=2: 4 schedules x 2 b x 2 recompute; t=2: 2 b x 2 recompute x 2 sp
    assert len(lays) == 8 + 16 + 8
    assert len(set(lays)) == len(lays)
    assert all(not layout_errors(SPEC, Cluster(2, HW, 8), lay) and lay.world == 2 for lay in lays)
    assert {(lay.schedule, lay.v) for lay in lays if lay.p == 2} == set(bench.PIPELINE_SCHEDULES)
    assert all(lay.sp == lay.sequence_parallel for lay in lays) and any(lay.sp for lay in lays)
    assert all(lay.distopt == lay.distributed_optimizer for lay in lays) and any(lay.distopt for lay in lays)


def test_layouts_the_model_cannot_take_are_left_out(bench):
    # 3 layers: no pipeline of p v = 2 or 4 chunks divides them; 3 heads: no t = 2
    odd = ModelSpec(layers=3, hidden=96, heads=3, seq_len=64, vocab=512)
    lays = bench.enumerate_layouts(odd, HW, global_batch=8, micro_batches=(1, 2))
    assert len(lays) == 8 and {(lay.t, lay.p, lay.d) for lay in lays} == {(1, 1, 2)}
    # a global batch of 2 leaves m = 1 microbatch at b = 2 with p = 2: interleaved needs m % p == 0
    few = bench.enumerate_layouts(SPEC, HW, global_batch=2, micro_batches=(1, 2))
    assert not [lay for lay in few if lay.schedule == "interleaved" and lay.b == 2]


def test_parallelize_arguments_follow_the_layout(bench):
    lay = next(lay for lay in bench.enumerate_layouts(SPEC, HW, 8) if lay.schedule == "zbv" and lay.b == 2)
    kw = bench.parallelize_kwargs(lay, 8)
    assert kw == dict(tp=1, pp=2, dp=1, world_size=2, virtual_stages=2, microbatches=4, schedule="zbv",
                      recompute=str(lay.recompute), sequence_parallel=False)


def test_spearman_on_known_data(bench):
    assert bench.spearman([1, 2, 3, 4], [10, 20, 30, 40]) == pytest.approx(1.0)
    assert bench.spearman([1, 2, 3, 4], [4, 3, 2, 1]) == pytest.approx(-1.0)
    # the textbook example (IQ against hours of TV, no ties): sum d^2 = 194, rho = 1 - 6 * 194 / (10 * 99) = -29/165
    x, y = [106, 86, 100, 101, 99, 103, 97, 113, 112, 110], [7, 0, 27, 50, 28, 29, 20, 12, 6, 17]
    assert bench.spearman(x, y) == pytest.approx(-29 / 165)
    assert bench.ranks([3.0, 1.0, 3.0, 2.0]) == [3.5, 1.0, 3.5, 2.0]  # ties share their mean rank
    assert math.isnan(bench.spearman([1, 1, 1], [1, 2, 3]))
    with pytest.raises(PlanError):
        bench.spearman([1.0], [2.0])


def _rows(bench):
    Row = bench.Row
    return [Row("slow", pred_s=0.100, meas_s=0.200, pred_bytes=11 * 2**20, meas_bytes=10 * 2**20, min_s=0.100),
            Row("fast", pred_s=0.120, meas_s=0.100, pred_bytes=10 * 2**20, meas_bytes=10 * 2**20, min_s=0.080),
            Row("mid", pred_s=0.150, meas_s=0.150, pred_bytes=9 * 2**20, meas_bytes=10 * 2**20, min_s=0.120)]


def test_figures_and_the_planners_pick(bench):
    f = bench.figures(_rows(bench))
    assert f["layouts"] == 3
    assert f["time_median_abs_err"] == pytest.approx(0.2) and f["time_max_abs_err"] == pytest.approx(0.5)
    assert f["time_over_25"] == 1
    # predicted order slow < fast < mid, measured fast < mid < slow: ranks (1, 2, 3) against (3, 1, 2)
    assert f["spearman"] == pytest.approx(-0.5)
    assert (f["pick"], f["pick_rank"], f["fastest"]) == ("slow", 3, "fast")
    assert f["pick_gap"] == pytest.approx(1.0)
    assert f["mem_max_abs_err"] == pytest.approx(0.1) and f["mem_over_10"] == 0
    assert "Spearman rank correlation (predicted vs measured step time): -0.500" in bench.format_figures(f)
    # against the fastest steps (0.100, 0.080, 0.120): errors 0, +50%, +25%; ranks (1, 2, 3) against (2, 1, 3)
    assert f["min_median_abs_err"] == pytest.approx(0.25) and f["min_spearman"] == pytest.approx(0.5)
    assert (f["min_pick_rank"], f["min_fastest"]) == (2, "fast") and f["min_pick_gap"] == pytest.approx(0.25)


def test_table_lists_layouts_fastest_measured_first(bench):
    lines = bench.format_table(_rows(bench)).splitlines()
    assert lines[0].split()[:3] == ["layout", "pred", "ms"]
    assert [line.split()[0] for line in lines[2:]] == ["fast", "mid", "slow"]
    assert lines[2].split()[1:] == ["120.0", "100.0", "+20.0%", "80.0", "+50.0%", "10.00", "10.00", "+0.0%"]
    assert lines[4].split()[3] == "-50.0%"
