"""Tier (a): the layout search: divisibility, memory, speed, and the paper's layouts."""

from __future__ import annotations

import json

import pytest

from autopar.core.config import Recompute
from autopar.planning.cost.calibration import PAPER_RUNS
from autopar.planning.cost.layout import Cluster, layout_errors
from autopar.planning.cost.models import ModelSpec, get_model
from autopar.planning.search.planner import SearchSpace, candidate_layouts, search, why_differs


def test_candidates_respect_divisibility():
    # 12 heads (t=8 impossible), 30 layers, batch 96 on 64 GPUs
    spec = ModelSpec(layers=30, hidden=1536, heads=12, seq_len=1024)
    cl = Cluster.of(64, "dgx-a100-80gb", 96)
    rejected: dict[str, int] = {}
    lays = list(candidate_layouts(spec, cl, SearchSpace(), rejected))
    assert lays, "some layouts must be valid"
    for lay in lays:
        assert layout_errors(spec, cl, lay) == []
        assert lay.t * lay.p * lay.d == 64 and lay.t <= 8
        assert spec.heads % lay.t == 0
        assert spec.layers % (lay.p * lay.v) == 0
        m = 96 // (lay.d * lay.b)
        assert 96 % (lay.d * lay.b) == 0
        if lay.schedule == "interleaved":
            assert lay.v > 1 and m % lay.p == 0
        else:  # 1F1B and GPipe also run m < p
            assert lay.v == 1
    assert any(96 // (lay.d * lay.b) < lay.p for lay in lays)  # m < p is a candidate too
    assert {lay.t for lay in lays} == {1, 2, 4}  # t=8 rejected by heads % t
    assert {lay.p for lay in lays} <= {1, 2}  # p=4, 8, ... do not divide 30 layers
    assert rejected["heads % t != 0"] > 0 and rejected["layers % (p*v) != 0"] > 0
    assert rejected.get("interleaved: m < p", 0) + rejected.get("interleaved: m % p != 0", 0) > 0


def test_uneven_layers_allowed_on_request():
    spec = ModelSpec(layers=30, hidden=1536, heads=12, seq_len=1024)
    cl = Cluster.of(64, "dgx-a100-80gb", 96)
    even = {(x.p, x.v) for x in candidate_layouts(spec, cl, SearchSpace(divisible_layers=False))}
    assert (4, 1) in even and (4, 7) in even and all(p * v <= 30 for p, v in even)


def test_memory_filter_and_message():
    # a 76B model cannot train on 8 GPUs: 16 bytes per parameter alone is 1.2 TB
    plan = search(get_model("gpt-76b"), Cluster.of(8, "dgx-a100-80gb", 64))
    assert plan.ranked == [] and plan.rejected["does not fit in memory"] > 0
    with pytest.raises(ValueError, match="no layout of gpt-76b fits"):
        _ = plan.best
    for e in plan.too_big:
        assert e.memory.total > e.cluster.hardware.usable_bytes


def test_every_ranked_layout_fits_and_is_sorted():
    run = PAPER_RUNS[4]
    plan = search(run.spec, run.cluster(), top=15)
    times = [e.t_iter for e in plan.ranked]
    assert times == sorted(times)
    assert all(e.fits for e in plan.ranked)
    assert plan.ranked[0].simulated  # the head of the list ran the real schedule


def test_full_search_covers_the_space():
    # all (t, p, v, b, schedule, recompute) for the paper's 39B on 512 GPUs; how long it takes is
    # bench/plan_speed.py's figure (a shared machine makes a time limit in a test flaky)
    run = PAPER_RUNS[4]
    plan = search(run.spec, run.cluster())
    assert plan.evaluated > 500


@pytest.mark.parametrize("run", PAPER_RUNS, ids=lambda r: r.model)
def test_paper_tp_pp_best_or_within_3_percent(run):
    """With the paper's (t, p) fixed, its micro-batch and v are best or within 3%."""
    space = SearchSpace.megatron_2021(t=(run.t,), p=(run.p,), dp_overlap=run.dp_overlap)
    plan = search(run.spec, run.cluster(), space)
    assert plan.reference is not None and plan.reference.fits
    gain = plan.reference.t_iter / plan.best.t_iter - 1
    assert gain <= 0.03, "\n".join(plan.why())


# Where the full search still disagrees with the paper after modelling memory (DDP buckets, the
# optimizer step's fp32 gradient copy, the backward's working set) and Megatron-LM 2021's
# no-overlap rule for pipelined data parallelism (docs/performance-model.md, section 8):
MODEL_PREFERS_OTHER_LAYOUT = {
    # t=1 p=2 has no tensor-parallel all-reduces; with local DDP (no buckets) it needs
    # 20 B/param at the optimizer step = 71.6 GiB, just under the 72.0 GiB usable
    "gpt-7.5b": "+4.6%: t=1 p=2 v=6 b=1 fits by 0.4 GiB and avoids t=4's all-reduces",
    # t=8 without sequence parallelism pays 2 all-reduces of b s h per layer in each of forward,
    # recompute and backward and runs LayerNorm/dropout/residual unsplit; a short interleaved
    # pipeline at t=2 costs a few percent of bubble and sends
    "gpt-18b": "+12.2%: t=2 p=4 v=5 b=2 avoids t=8's all-reduces and replicated element-wise work",
    "gpt-39b": "+13.0%: t=2 p=8 v=6 b=2 avoids t=8's all-reduces and replicated element-wise work",
}


@pytest.mark.parametrize(
    "run",
    [pytest.param(r, marks=pytest.mark.xfail(strict=True, reason=MODEL_PREFERS_OTHER_LAYOUT[r.model]))
     if r.model in MODEL_PREFERS_OTHER_LAYOUT else r for r in PAPER_RUNS],
    ids=lambda r: r.model,
)
def test_full_search_best_is_paper_or_within_3_percent(run, show):
    """The issue's criterion, over the whole space (layer recomputation, as in every paper run);
    ``pytest -s`` prints each row's comparison (docs/performance-model.md, section 8)."""
    space = SearchSpace.megatron_2021(dp_overlap=run.dp_overlap)
    plan = search(run.spec, run.cluster(), space)
    gain = plan.reference.t_iter / plan.best.t_iter - 1
    gib = 2**30
    show(f"\n{run.model}: best {plan.best.layout.short} {plan.best.tflops_per_gpu:.1f} TFLOP/s "
          f"{plan.best.memory.total / gib:.1f} GiB, paper {plan.reference.layout.short} "
          f"{plan.reference.tflops_per_gpu:.1f} TFLOP/s {plan.reference.memory.total / gib:.1f} GiB, "
          f"gain {gain:+.1%}")
    assert gain <= 0.03, "\n".join(plan.why())


@pytest.mark.parametrize("run", [r for r in PAPER_RUNS if r.model in MODEL_PREFERS_OTHER_LAYOUT],
                         ids=lambda r: r.model)
def test_disagreements_are_explained(run):
    space = SearchSpace.megatron_2021(dp_overlap=run.dp_overlap)
    plan = search(run.spec, run.cluster(), space)
    why = plan.why()
    assert why[0].startswith(f"best {plan.best.layout.short} is predicted +")
    # the largest saving is tensor-parallel communication: the best uses a smaller t
    assert plan.best.layout.t < run.t
    assert "tensor-parallel all-reduces" in why[1]
    assert any(line.strip().startswith("memory per GPU") and "usable" in line for line in why)


def test_paper_layout_wins_because_faster_ones_do_not_fit():
    """3.6B: t=1 would be faster, but with PyTorch DDP (buckets, 2 B/param) and the optimizer
    step's fp32 gradient copy (4 B/param) it needs 22 B/param = 73.0 GiB > 72.0 GiB."""
    run = next(r for r in PAPER_RUNS if r.model == "gpt-3.6b")
    plan = search(run.spec, run.cluster(), SearchSpace.megatron_2021(dp_overlap=run.dp_overlap))
    assert plan.best.layout == plan.reference.layout
    why = plan.why()
    assert why[0] == f"the best layout is the reference layout ({run.layout().short})"
    line = next(x for x in why if "faster but does not fit" in x)
    assert "t=1 p=1" in line and "DDP buckets" in line and "fp32 grad copy" in line


def test_pipelined_layouts_do_not_overlap_the_gradient_all_reduce_by_default():
    # Megatron-LM 2021: PyTorch DDP (overlap) only without a pipeline; local DDP after the flush otherwise
    run = PAPER_RUNS[3]
    plan = search(run.spec, run.cluster(), SearchSpace.megatron_2021(dp_overlap=True), top=30)
    assert {e.layout.dp_overlap for e in plan.ranked if e.layout.p > 1} == {False}
    assert {e.layout.dp_overlap for e in plan.ranked if e.layout.p == 1} <= {True}
    both = search(run.spec, run.cluster(), SearchSpace.megatron_2021(dp_overlap=True,
                                                       pipeline_dp_overlap=True), top=30)
    assert {e.layout.dp_overlap for e in both.ranked} == {True}


def test_no_recompute_wins_when_it_fits_and_says_so():
    run = PAPER_RUNS[0]  # 1.7B: 80 GB holds the full activations at a small micro-batch
    plan = search(run.spec, run.cluster(), SearchSpace(sequence_parallel=(False,), distributed_optimizer=(False,), dp_overlap=True))
    assert plan.best.layout.recompute is Recompute.NONE and plan.best.fits
    why = plan.why()
    assert "faster" in why[0] and any("no recomputation" in line for line in why)


def test_why_for_identical_layouts():
    run = PAPER_RUNS[5]
    est = run.predict()
    assert why_differs(est, est) == [f"the best layout is the reference layout ({est.layout.short})"]


def test_cli_plan_json_and_fixed_layout(capsys):
    from autopar.cli import main

    args = ["plan", "--model", "gpt-76b", "--gpus", "1024", "--batch", "1792", "--tp", "8", "--pp", "4",
            "--vp", "3", "--micro-batch", "2", "--recompute", "layer", "--json", "--explain"]
    rc = main(args)
    assert rc == 0
    out = json.loads(capsys.readouterr().out)
    # 'full' (Megatron's name) is an alias of 'layer': the same plan, spoken in the config's words
    assert main([a if a != "layer" else "full" for a in args]) == 0
    alias = json.loads(capsys.readouterr().out)
    assert alias["ranked"] == out["ranked"] and out["ranked"][0]["recompute"] == "layer"
    assert out["evaluated"] == 1
    row = out["ranked"][0]
    assert (row["t"], row["p"], row["d"], row["v"], row["b"], row["m"]) == (8, 4, 32, 3, 2, 28)
    assert row["tflops_per_gpu"] == pytest.approx(PAPER_RUNS[5].predict().tflops_per_gpu)
    assert out["reference"]["tflops_per_gpu"] == pytest.approx(row["tflops_per_gpu"])
    assert {e["name"] for e in out["explain"]} >= {"F", "P", "bubble", "X"}


def test_cli_plan_by_dimensions_prints_table(capsys):
    from autopar.cli import main

    # the paper's GPT: dropout, unfused attention, head tied to the embedding, learned positions
    # (a model given by its dimensions is by default a current one: none of these)
    rc = main(["plan", "--layers", "24", "--hidden", "2304", "--heads", "24", "--gpus", "32", "--batch", "512",
               "--recompute", "full", "--top", "3", "--dropout", "--no-fused-attention", "--tied-head",
               "--learned-positions"])
    assert rc == 0
    out = capsys.readouterr().out
    # the same dimensions as the paper's 1.7B row: its layout is the reference, and it is the best
    spec = ModelSpec(layers=24, hidden=2304, heads=24)
    plan = search(spec, Cluster.of(32, "dgx-a100-80gb", 512), SearchSpace.megatron_2021(), top=3)
    assert plan.reference is not None and plan.best.layout == plan.reference.layout
    assert "compared with the paper's layout" in out
    assert plan.why()[0] == "the best layout is the reference layout (t=1 p=1 d=32 b=16)"
    assert plan.why()[0] in out
    lines = out.splitlines()
    rows = [line.split() for line in lines[lines.index(next(x for x in lines if x.startswith("──"))) + 1:]]
    best, paper = rows[0], next(r for r in rows if r[0] == "paper")
    assert best[:3] == ["1", "1", "1"]
    assert best[1:] == paper[1:]  # the same layout, the same numbers
    assert f"{plan.best.tflops_per_gpu:.1f}" in rows[0] and "layer" in rows[0]


def test_cli_rejects_bad_fixed_layout(capsys):
    from autopar.cli import main

    rc = main(["plan", "--model", "gpt-39b", "--gpus", "512", "--batch", "1536", "--tp", "3"])
    assert rc == 1
    assert "no layout of gpt-39b fits" in capsys.readouterr().out
