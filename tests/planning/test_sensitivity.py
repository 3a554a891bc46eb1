"""Tier (a): flip points -- how far an uncertain input must move for another layout to catch up."""

from __future__ import annotations

import json
import math

import pytest

from autopar.planning.cost.calibration import PAPER_RUNS
from autopar.planning.cost.layout import Cluster
from autopar.planning.cost.models import ModelSpec
from autopar.planning.cost.step_estimate import estimate
from autopar.planning.search.planner import SearchSpace, memory_line, search
from autopar.planning.search.sensitivity import KNOBS, flip_lines, flip_points, memory_margin_line


def _ratio_at(chosen, other, knob, factor):
    """other / chosen iteration time with ``knob`` scaled by ``factor`` (closed form, as flip_points)."""
    hw = knob.scale(chosen.cluster.hardware, factor)
    cl = Cluster(chosen.cluster.gpus, hw, chosen.cluster.global_batch)
    a = estimate(chosen.spec, cl, chosen.layout, divisible_layers=False)
    b = estimate(other.spec, cl, other.layout, divisible_layers=False)
    return b.t_iter / a.t_iter


def _plan(run):
    return search(run.spec, run.cluster(), SearchSpace.megatron_2021(dp_overlap=run.dp_overlap))


@pytest.mark.parametrize("model", ["gpt-7.5b", "gpt-18b", "gpt-39b"])
def test_flip_factor_is_where_the_order_changes(model):
    run = next(r for r in PAPER_RUNS if r.model == model)
    plan = _plan(run)
    best, ref = plan.best, plan.reference
    assert best.layout != ref.layout
    pts = flip_points(best, ref)
    assert [fp.knob.name for fp in pts] == [k.name for k in KNOBS]
    found = 0
    for fp in pts:
        if fp.factor is None:
            # no factor in [1/8, 8] makes the reference as fast: it stays slower at both ends
            assert _ratio_at(best, ref, fp.knob, 8.0) > 1 and _ratio_at(best, ref, fp.knob, 1 / 8) > 1
            continue
        found += 1
        away = fp.factor * (1.01 if fp.factor > 1 else 1 / 1.01)
        toward = fp.factor / (1.01 if fp.factor > 1 else 1 / 1.01)
        assert _ratio_at(best, ref, fp.knob, away) <= 1.0, (fp.knob.name, fp.factor)
        assert _ratio_at(best, ref, fp.knob, toward) > 1.0, (fp.knob.name, fp.factor)
        assert fp.physical == (fp.knob.ceiling is None or fp.factor <= fp.knob.ceiling(best.cluster.hardware))
    assert found >= 1  # GEMM throughput moves every one of these comparisons


def test_seven_b_needs_impossible_nvlink_and_is_tight_on_memory():
    run = next(r for r in PAPER_RUNS if r.model == "gpt-7.5b")
    plan = _plan(run)
    pts = {fp.knob.name: fp for fp in flip_points(plan.best, plan.reference)}
    nv, hw = pts["nvlink"], plan.best.cluster.hardware
    # NVLink would need to carry more than its line rate: the factor passes the ceiling 1/efficiency
    ceiling = nv.knob.ceiling(hw)
    assert ceiling == pytest.approx(1 / hw.nvlink_efficiency)
    assert nv.factor is not None and nv.factor > ceiling and not nv.physical
    lines = flip_lines(plan.best, plan.reference)
    nv_line = next(ln for ln in lines if ln.strip().startswith(nv.knob.what))
    assert f"x{nv.factor:.2f} ({nv.knob.value(hw)} -> {nv.knob.value(nv.knob.scale(hw, nv.factor))})" in nv_line
    assert nv_line.endswith(f"impossible: beyond the {hw.gpu}'s peak or line rate (at most x{ceiling:.2f})")
    # the nearest flip point is listed first
    factors = [abs(math.log(fp.factor)) for fp in sorted(pts.values(), key=lambda f: abs(math.log(f.factor))
                                                          if f.factor else math.inf) if fp.factor]
    assert factors == sorted(factors)
    # the best layout leaves less than 2% of the HBM below the usable line: said, with its numbers
    spare = hw.usable_bytes - plan.best.memory.total
    assert 0 <= spare < 0.02 * hw.hbm_bytes
    margin = memory_margin_line(plan.best)
    assert f"leaves {spare / 2**30:.1f} GiB ({spare / hw.hbm_bytes:.1%} of HBM) below the usable line - tight" in margin
    assert margin in plan.why()


def test_without_a_reference_the_runner_up_has_another_decomposition():
    spec = ModelSpec(layers=32, hidden=4096, heads=32)  # not a paper row: no reference
    plan = search(spec, Cluster.of(64, "dgx-a100-80gb", 512), SearchSpace.megatron_2021())
    assert plan.reference is None
    other, label = plan.compared_with()
    assert label == "the runner-up"
    assert (other.layout.t, other.layout.p) != (plan.best.layout.t, plan.best.layout.p)
    assert other.t_iter >= plan.best.t_iter
    why = plan.why()
    assert why[0].startswith(f"best {plan.best.layout.short} is predicted +")
    assert "than the runner-up" in why[0]
    assert any(ln.strip().startswith(f"what would make {other.layout.short} as fast") for ln in why)


def test_cli_memory_headroom_and_flip_points_json(capsys):
    from autopar.cli import main

    args = ["plan", "--model", "gpt-7.5b", "--gpus", "128", "--batch", "512", "--recompute", "full",
            "--dp-overlap", "--top", "3", "--json"]
    run = next(r for r in PAPER_RUNS if r.model == "gpt-7.5b")
    # the CLI's search: the paper's recomputation, no sequence parallelism or distributed optimizer
    # unless asked, every schedule
    space = SearchSpace.megatron_2021(dp_overlap=True, schedules=SearchSpace().schedules)
    best = search(run.spec, run.cluster(), space, top=3).best
    assert main(args) == 0
    out = json.loads(capsys.readouterr().out)
    assert (out["ranked"][0]["t"], out["ranked"][0]["p"], out["ranked"][0]["v"]) == (best.layout.t, best.layout.p,
                                                                                       best.layout.v)
    assert out["ranked"][0]["memory_gib"] == pytest.approx(best.memory.total / 2**30)
    assert {fp["input"] for fp in out["flip_points"]} == {k.name for k in KNOBS}
    # keep a little more of the HBM free than the best layout leaves: it no longer fits
    hbm_gib = best.cluster.hardware.hbm_bytes / 2**30
    headroom = math.floor(best.memory.total / best.cluster.hardware.hbm_bytes * 100) / 100
    assert main(args + ["--memory-headroom", f"{headroom:.2f}"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["ranked"] and all(r["memory_gib"] <= headroom * hbm_gib for r in out["ranked"])
    assert (out["ranked"][0]["t"], out["ranked"][0]["p"]) != (best.layout.t, best.layout.p)
    with pytest.raises(SystemExit, match="--memory-headroom must be in"):
        main(args + ["--memory-headroom", "1.5"])


def test_seven_b_with_one_percent_more_headroom_comes_within_3_percent_of_the_paper_and_names_the_near_miss():
    from dataclasses import replace

    run = next(r for r in PAPER_RUNS if r.model == "gpt-7.5b")
    space = SearchSpace.megatron_2021(dp_overlap=run.dp_overlap)
    unconstrained = search(run.spec, run.cluster(), space).best  # fits by less than 1% of the HBM
    hw = replace(run.cluster().hardware, memory_headroom=0.89)
    assert unconstrained.memory.total > hw.usable_bytes
    plan = search(run.spec, Cluster(run.gpus, hw, run.batch), space)
    # t=2 p=2 (no t=4 all-reduces, a short interleaved pipeline) is then best, by 1.3%: the criterion
    assert plan.best.layout.t < run.t and plan.reference.t_iter / plan.best.t_iter - 1 < 0.03
    near = [ln for ln in plan.why() if "faster but does not fit" in ln]
    # the nearest miss among all faster layouts, not only the fastest few: the layout that just fitted
    assert len(near) == 1
    assert f"faster but does not fit: {unconstrained.layout.short} would be " in near[0]
    assert f"needs {memory_line(unconstrained)} > {hw.usable_bytes / 2**30:.1f} GiB usable" in near[0]
