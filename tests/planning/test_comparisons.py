"""The planner against the paper's measured layout comparisons (sections 5.2, 5.4, 5.5, 5.7), and
the formulas of the effects that decide them (docs/performance-model.md, section 11)."""

from __future__ import annotations

import json
import math

import pytest

from autopar.cli import main
from autopar.planning.cost.hardware import get_hardware
from autopar.planning.cost.layout import Cluster, Layout
from autopar.planning.cost.models import param_count
from autopar.planning.cost.network import (
    flat_ring_allreduce_time,
    hierarchical_allreduce_time,
    stage_link,
    tp_allreduce_time,
)
from autopar.planning.cost.op_times import gemm_efficiency, tile_fill
from autopar.planning.cost.step_estimate import estimate
from autopar.planning.search.paper_comparisons import COMPARISONS, GPT_5_9B, GPT_162B, Comparison, rank
from autopar.planning.search.versus import term_rows

A100 = get_hardware("dgx-a100-80gb")
BY_KEY = {c.key: c for c in COMPARISONS}


# ------------------------------------------------------------------ the formulas


def test_reconstructed_model_sizes():
    # the paper's parameter counts: 162.2B (Fig. 13) and 5.9B (Figs. 14, 15)
    assert param_count(GPT_162B) / 1e9 == pytest.approx(162.2, abs=0.1)
    assert param_count(GPT_5_9B) / 1e9 == pytest.approx(5.9, abs=0.05)


def test_flat_ring_across_nodes_is_paced_by_the_nics():
    S, t = 84e6, 16  # b s h fp16 of the 162B model, a group of two nodes
    bus = min(300e9 * 0.78, 8 * 25e9 * 0.92)  # min(NVLink, 8 NICs): 184 GB/s
    assert flat_ring_allreduce_time(S, t, A100) == pytest.approx(2 * 15 / 16 * S / bus + 2 * 15 * 10e-6, rel=1e-12)


def test_hierarchical_all_reduce_is_three_steps():
    S, t = 84e6, 32  # four nodes
    inside = 7 / 8 * S / (300e9 * 0.78) + 7 * 5e-6  # reduce-scatter, then all-gather, over NVLink
    across = 2 * 3 / 4 * (S / 8) / (25e9 * 0.92) + 2 * 3 * 10e-6  # 1/8 of it over 4 nodes, one NIC each
    assert hierarchical_allreduce_time(S, t, A100) == pytest.approx(2 * inside + across, rel=1e-12)


def test_tensor_parallel_all_reduce_picks_the_faster_algorithm():
    for S in (1e5, 1e7, 84e6, 1e9):
        for t in (16, 32, 64):
            assert tp_allreduce_time(S, t, A100) == min(flat_ring_allreduce_time(S, t, A100),
                                                        hierarchical_allreduce_time(S, t, A100))
    # small tensors: latency-bound, the hierarchical one (2 (N-1) slow steps, not 2 (t-1)) wins
    assert hierarchical_allreduce_time(1e5, 32, A100) < flat_ring_allreduce_time(1e5, 32, A100)
    # across nodes is slower than any group inside a node, per byte
    assert tp_allreduce_time(84e6, 16, A100) > 1.5 * tp_allreduce_time(84e6, 8, A100)


def test_pipeline_crossing_a_node_is_paced_by_infiniband():
    # t d = 4: two stages per node, but a 16-stage pipeline crosses nodes between some of them
    assert stage_link(A100, 4, 1, 16) == (25e9 * 0.92, 10e-6)
    assert stage_link(A100, 4, 1, 2) == (300e9 * 0.78, 5e-6)  # 8 ranks, one node
    assert stage_link(A100, 8, 1, 2)[0] == 25e9 * 0.92


def test_wave_fill_takes_the_best_tile():
    # b=2 at t=8, 91B's QKV: M 4096, N 3840: 480 tiles of 256x128 in 5 waves of 108 (0.889);
    # 960 tiles of 128x128 in 9 waves (0.988)
    assert tile_fill(4096, 3840, A100, tile=(256, 128)) == pytest.approx(480 / 540, rel=1e-12)
    assert tile_fill(4096, 3840, A100, tile=(128, 128)) == pytest.approx(960 / 972, rel=1e-12)
    k = 10240 / (10240 + 64)
    assert gemm_efficiency(4096, 3840, 10240, A100) == pytest.approx(A100.eff.gemm * 960 / 972 * k, rel=1e-12)


def test_imbalance_is_the_end_stages_work_beyond_their_share():
    spec, cluster = GPT_162B, Cluster(64, A100, 128)
    est = estimate(spec, cluster, Layout(t=8, p=8, d=1, b=1, v=2))
    head, emb = est.t_head_f + est.t_head_b, est.t_emb_f + est.t_emb_b
    assert est.breakdown["imbalance"] == pytest.approx(est.m * (max(head, emb) - (head + emb) / 8), rel=1e-12)
    flat = estimate(spec, Cluster(64, A100, 64), Layout(t=8, p=1, d=8, b=1))
    assert flat.breakdown["imbalance"] == 0.0  # one stage holds both ends
    rows = term_rows(est, flat)
    assert sum(r.a for r in rows[:-1]) == pytest.approx(est.t_iter, rel=0.02)


def test_fewer_microbatches_than_stages_is_priced():
    # batch 32 on t=1 p=32 d=2 b=1: m = 16 < p; 1F1B's bubble (p-1)/m over m (F + B)
    cluster = Cluster(64, A100, 32)
    est = estimate(GPT_5_9B, cluster, Layout(t=1, p=32, d=2, b=1))
    assert est.m == 16
    assert est.bubble == pytest.approx(31 / 16, rel=1e-12)
    sim = estimate(GPT_5_9B, cluster, Layout(t=1, p=32, d=2, b=1), simulate=True)
    assert sim.simulated and sim.t_pipeline == pytest.approx(est.t_pipeline, rel=0.05)


def test_unrunnable_layout_is_priced_and_marked_when_asked():
    cluster = Cluster(64, A100, 36)  # m = 36, 36 % p = 8 != 0: interleaving cannot run it
    lay = Layout(t=8, p=8, d=1, b=1, v=2)
    with pytest.raises(ValueError, match="multiple of p"):
        estimate(GPT_162B, cluster, lay)
    est = estimate(GPT_162B, cluster, lay, simulate=True, runnable=False)
    assert not est.runnable and not est.simulated and any("multiple" in e for e in est.runtime_errors)
    assert est.t_iter > 0


# ------------------------------------------------------------------ the rankings


@pytest.fixture(scope="module")
def ranked() -> dict:
    """Every comparison at every batch size, ranked once (about 20 s)."""
    return {(c.key, B): rank(c, B) for c in COMPARISONS for B in c.batches}


@pytest.fixture(scope="module")
def rankings(ranked) -> dict[tuple[str, int], list[int]]:
    """Candidate indices, fastest first."""
    return {key: list(r.order) for key, r in ranked.items()}


@pytest.mark.parametrize("comp", [c for c in COMPARISONS if c.key != "micro-batch"], ids=lambda c: c.key)
def test_planner_picks_the_measured_best(comp: Comparison, rankings):
    # (the micro-batch sweep has a tie at batch 512: test_micro_batch_sweep)
    for B, best in zip(comp.batches, comp.measured_best):
        assert rankings[(comp.key, B)][0] == best, (B, rankings[(comp.key, B)])


@pytest.mark.parametrize("comp", [c for c in COMPARISONS if c.measured_order], ids=lambda c: c.key)
def test_planner_orders_as_measured(comp: Comparison, rankings):
    for B, order in zip(comp.batches, comp.measured_order):
        assert tuple(rankings[(comp.key, B)]) == order, B


def test_tensor_vs_pipeline_falls_on_both_sides_of_t8(rankings):
    # Fig. 13: throughput falls from t=8 p=8 towards t=2 and towards t=32 (candidates by t)
    for B in BY_KEY["tensor-vs-pipeline"].batches:
        pos = {c: k for k, c in enumerate(rankings[("tensor-vs-pipeline", B)])}
        assert pos[2] < pos[1] < pos[0] and pos[2] < pos[3] < pos[4], (B, pos)


def test_larger_batches_are_faster(ranked):
    # Figs. 14 and 15: the same layout, batch 32 < 128 < 512 in throughput (the bubble, the
    # data-parallel all-reduce and the optimizer step amortised over more samples)
    for key in ("pipeline-vs-data", "tensor-vs-data"):
        comp = BY_KEY[key]
        per_batch = [ranked[(key, B)].estimates for B in comp.batches]
        for k in range(len(comp.candidates)):
            tf = [ests[k].tflops_per_gpu for ests in per_batch]
            assert tf == sorted(tf), (key, k, tf)


def test_micro_batch_sweep(ranked):
    # Fig. 16: b=2 measured best. Predicted best at batch 128; at 512, b=2 and b=4 within 0.5%
    # (below what this model resolves: its calibration rows scatter by 1.4%); b=1 and b=8 slower
    comp = BY_KEY["micro-batch"]
    at128, at512 = ranked[("micro-batch", 128)], ranked[("micro-batch", 512)]
    assert at128.best == 1
    t = [e.t_iter for e in at512.estimates]
    assert t[1] / min(t) - 1 < 0.005 and t[1] < t[0] and t[1] < t[3]


def test_interleaving_gap_closes_with_the_batch(ranked):
    comp = BY_KEY["interleaved"]
    gaps = [r.estimates[1].t_iter / r.estimates[0].t_iter for r in (ranked[(comp.key, B)] for B in comp.batches)]
    assert all(g > 1 for g in gaps) and gaps == sorted(gaps, reverse=True)


def test_scatter_gather_gain_is_largest_at_small_batch(ranked):
    # Fig. 18: up to 11% at the smallest batch; predicted 11.7% at batch 12, shrinking with it
    comp = BY_KEY["scatter-gather"]
    gains = [r.estimates[1].t_iter / r.estimates[0].t_iter - 1 for r in (ranked[(comp.key, B)] for B in comp.batches)]
    assert 0.05 < gains[0] < 0.15 and gains == sorted(gains, reverse=True)


# ------------------------------------------------------------------ the CLI's code path


def _plan_json_recompute_layer(capsys, *args: str) -> dict:
    rc = main(["plan", *args, "--json", "--recompute", "layer"])
    out = json.loads(capsys.readouterr().out)
    assert rc == 0, out.get("error")
    return out


@pytest.mark.parametrize("key", ["tensor-vs-pipeline", "pipeline-vs-data", "tensor-vs-data"])
def test_every_section_5_4_layout_through_the_cli(key, capsys):
    comp = BY_KEY[key]
    dims = ["--layers", str(comp.spec.layers), "--hidden", str(comp.spec.hidden), "--heads", str(comp.spec.heads)]
    for c in comp.candidates:
        out = _plan_json_recompute_layer(capsys, *dims, "--gpus", str(comp.gpus), "--batch", str(min(comp.batches)),
                         "--tp", str(c.t), "--pp", str(c.p), "--micro-batch", str(c.b), "--top", "1")
        row = out["ranked"][0]
        assert (row["t"], row["p"], row["b"]) == (c.t, c.p, c.b)
        assert row["m"] == min(comp.batches) // (comp.gpus // (c.t * c.p) * c.b)
        assert math.isfinite(row["iteration_s"]) and row["runnable"]


def test_cli_versus_table(capsys):
    dims = ["--layers", "32", "--hidden", "20480", "--heads", "128", "--gpus", "64", "--batch", "128"]
    out = _plan_json_recompute_layer(capsys, *dims, "--tp", "8", "--pp", "8", "--micro-batch", "1", "--vs-tp", "16",
                                     "--vs-pp", "4")
    terms = {r["term"]: r for r in out["versus"]["terms"]}
    assert out["versus"]["layout"]["t"] == 16 and out["versus"]["layout"]["p"] == 4
    # t=16 crosses nodes: its tensor-parallel all-reduces cost more than twice t=8's
    assert terms["tensor-parallel communication"]["other_s"] > 2 * terms["tensor-parallel communication"]["best_s"]
    parts = sum(r["difference_s"] for k, r in terms.items() if k != "iteration")
    assert parts == pytest.approx(terms["iteration"]["difference_s"], rel=0.05)


def test_cli_prices_a_fixed_unrunnable_layout_and_marks_it(capsys):
    dims = ["--layers", "32", "--hidden", "20480", "--heads", "128", "--gpus", "64", "--batch", "36"]
    out = _plan_json_recompute_layer(capsys, *dims, "--tp", "8", "--pp", "8", "--vp", "2", "--micro-batch", "1",
                     "--schedule", "interleaved")
    row = out["ranked"][0]
    assert not row["runnable"] and "multiple of p" in row["runtime_errors"][0]
