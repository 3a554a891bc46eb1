"""Mixture-of-experts layers and expert parallelism in the performance model, without processes.

A rank of an expert group of ep holds E/ep whole experts of each expert layer (each split t ways
on its width); its expert GEMMs compute, on average, its share S = k b s of the group's ep S
routed rows whatever ep is; the rows travel by an all-gather and a reduce-scatter of ep S rows of
h ('allgather') or by all-to-alls of (ep-1)/ep of S rows ('alltoall'), after an all-gather of
each rank's E counts; the experts' gradients are all-reduced over the d/ep replicas holding them.
"""

import json
from dataclasses import replace

import pytest

from autopar.core.config import ParallelConfig
from autopar.planning.cost.activations import activation_bytes_per_layer
from autopar.planning.cost.hardware import get_hardware
from autopar.planning.cost.layout import Cluster, Layout, layout_errors
from autopar.planning.cost.memory import memory_per_gpu
from autopar.planning.cost.models import (
    ModelSpec,
    expert_params_per_rank,
    expert_params_per_stage,
    get_model,
    param_count,
    params_per_stage,
)
from autopar.planning.cost.network import allreduce_time, dp_link, ep_collective_time
from autopar.planning.cost.op_times import layer_times
from autopar.planning.cost.precision import MIXED
from autopar.planning.cost.step_estimate import estimate
from autopar.planning.cost.transformer import graph_flops, layer_ops
from autopar.planning.errors import PlanError
from autopar.planning.search.planner import SearchSpace, candidate_layouts, search

A100 = get_hardware("dgx-a100-80gb")
NVLINK = 300e9 * 0.78  # bus bandwidth, bytes/s
NIC = 25e9 * 0.92

# 8 SwiGLU experts of width 96, top-2, on hidden 64: one expert is 3 * 64 * 96 = 18432 parameters
SMALL = ModelSpec(layers=2, hidden=64, heads=4, seq_len=16, vocab=128, ffn=96, gated_mlp=True, experts=8, top_k=2,
                  dropout=False, fused_attention=True, tied_head=False, learned_positions=False, name="moe-small")
# the same experts on a model big enough for the GPU's memory to matter
MEDIUM = ModelSpec(layers=8, hidden=2048, heads=16, seq_len=1024, vocab=32000, ffn=8192, gated_mlp=True, experts=16,
                   top_k=2, dropout=False, fused_attention=True, tied_head=False, learned_positions=False, name="moe-m")


def _ep_ops(ops):
    return [(o.name, o.kind, o.bytes) for o in ops if o.kind.startswith("ep_")]


# ------------------------------------------------------------------ parameters


@pytest.mark.parametrize("ep", [1, 2, 4, 8])
@pytest.mark.parametrize("t", [1, 2])
def test_expert_params_per_rank_are_exactly_E_over_ep_experts(ep, t):
    assert SMALL.expert_params == 3 * 64 * 96 == 18432
    assert expert_params_per_rank(SMALL, t, ep) == (8 // ep) * 18432 // t
    # both layers are expert layers: the stage holds two blocks of E/ep experts
    assert expert_params_per_stage(SMALL, t, 1, ep) == [2 * (8 // ep) * 18432 // t]
    # nothing else depends on ep: going from ep=1 drops exactly the other (E - E/ep) experts
    dropped = params_per_stage(SMALL, t, 1, 1)[0] - params_per_stage(SMALL, t, 1, ep)[0]
    assert dropped == 2 * (8 - 8 // ep) * 18432 // t


def test_moe_every_places_the_expert_layers_and_counts_them():
    spec = replace(SMALL, layers=6, moe_every=2)  # layers 1, 3 and 5
    assert [spec.is_moe_layer(i) for i in range(6)] == [False, True, False, True, False, True]
    assert expert_params_per_stage(spec, 1, 3, 4) == [2 * 18432] * 3  # one expert layer per stage, 2 experts
    assert expert_params_per_stage(spec, 1, 2, 2) == [4 * 18432, 2 * 4 * 18432]  # layers 0-2: 1; 3-5: 3, 5
    dense = replace(spec, experts=0)
    # a dense layer's MLP (two fc1 halves with biases, fc2) vs an expert layer's router (h E) and 8 experts
    mlp = 2 * (64 * 96 + 96) + 96 * 64 + 64
    assert param_count(spec) - param_count(dense) == 3 * (64 * 8 + 8 * 18432 - mlp)


def test_mixtral_8x7b_has_its_published_parameter_count():
    assert param_count(get_model("mixtral-8x7b")) / 1e9 == pytest.approx(46.7, abs=0.05)


# ------------------------------------------------------------------ FLOPs


@pytest.mark.parametrize("ep", [1, 2, 4, 8])
@pytest.mark.parametrize("t", [1, 2])
def test_expert_gemm_flops_per_rank_are_the_ranks_share_of_the_group(ep, t):
    b = 2
    S = 2 * b * 16  # k b s rows
    fwd = layer_ops(SMALL, b, t, moe=True, ep=ep, dispatch="alltoall").forward
    experts = {o.name: o for o in fwd if o.name.startswith("expert_fc")}
    # E/ep grouped GEMMs of S ep / E rows each: S rows in all, through gate+up (2 f_e/t) and down (f_e/t)
    assert experts["expert_fc1"].gemm == (8 // ep, S * ep / 8, 2 * 96 // t, 64)
    assert experts["expert_fc2"].gemm == (8 // ep, S * ep / 8, 64, 96 // t)
    assert sum(o.flops for o in experts.values()) == pytest.approx(2 * S * 64 * 3 * 96 / t, rel=1e-12)


def test_iteration_flops_count_k_experts_per_token():
    one = replace(SMALL, top_k=1)
    per_token_expert = 2 * 3 * 64 * 96  # forward FLOPs of one expert on one token

    def gemms(spec):
        ops = layer_ops(spec, 1, 1, moe=True)
        return sum(o.flops for o in ops.forward + ops.backward if o.kind == "gemm")

    # one more expert per token: its GEMMs' FLOPs, forward and two backward GEMMs each (3x)
    assert gemms(SMALL) - gemms(one) == pytest.approx(3 * 16 * per_token_expert, rel=1e-12)
    # the iteration (no recomputation, batch 4, two expert layers) adds those and the rows' element-wise work
    diff = graph_flops(SMALL, 4, recompute=False) - graph_flops(one, 4, recompute=False)
    assert 2 * 4 * 3 * 16 * per_token_expert < diff < 1.05 * 2 * 4 * 3 * 16 * per_token_expert


# ------------------------------------------------------------------ traffic


def test_dispatch_traffic_allgather_hand_computed():
    b, ep = 2, 4
    S, h = 2 * b * 16, 64  # 64 rows of 64
    ops = layer_ops(SMALL, b, 1, moe=True, ep=ep, dispatch="allgather")
    rows = ep * S * h * 2.0  # the group's ep S rows, fp16: 32768 bytes
    assert rows == 32768
    assert _ep_ops(ops.forward) == [("expert_route", "ep_allgather", ep * 8 * 8.0),
                                    ("expert_dispatch", "ep_allgather", rows),
                                    ("expert_combine", "ep_reduce_scatter", rows)]
    assert _ep_ops(ops.backward) == [("expert_combine.bwd", "ep_allgather", rows),
                                     ("expert_dispatch.bwd", "ep_reduce_scatter", rows)]
    # a ring over the 4 ranks of the group inside a node: (ep-1)/ep of the tensor over NVLink, ep-1 steps
    one = 3 / 4 * rows / NVLINK + 3 * A100.nvlink_latency
    assert ep_collective_time("ep_allgather", rows, ep, 1, A100) == pytest.approx(one, rel=1e-12)
    assert ep_collective_time("ep_reduce_scatter", rows, ep, 1, A100) == pytest.approx(one, rel=1e-12)
    route = 3 / 4 * 256 / NVLINK + 3 * A100.nvlink_latency
    moe = layer_times(SMALL, A100, b, 1, ep=ep, dispatch="allgather")
    assert moe["moe_f"].ep == pytest.approx(route + 2 * one, rel=1e-12)
    assert moe["moe_b"].ep == pytest.approx(2 * one, rel=1e-12)


def test_dispatch_traffic_alltoall_hand_computed():
    b, ep = 2, 4
    S, h = 2 * b * 16, 64
    ops = layer_ops(SMALL, b, 1, moe=True, ep=ep, dispatch="alltoall")
    mine = S * h * 2.0  # this rank's S rows: 8192 bytes, (ep-1)/ep of them leave
    assert _ep_ops(ops.forward) == [("expert_route", "ep_allgather", 256.0),
                                    ("expert_dispatch", "ep_alltoall", mine),
                                    ("expert_combine", "ep_alltoall", mine)]
    assert _ep_ops(ops.backward) == [("expert_combine.bwd", "ep_alltoall", mine),
                                     ("expert_dispatch.bwd", "ep_alltoall", mine)]
    inside = 3 / 4 * mine / NVLINK + 3 * A100.nvlink_latency
    assert ep_collective_time("ep_alltoall", mine, ep, 1, A100) == pytest.approx(inside, rel=1e-12)
    # t = 8: the group's 4 ranks are on 4 nodes, every peer is through the rank's own NIC
    across = 3 / 4 * mine / NIC + 3 * A100.ib_latency
    assert ep_collective_time("ep_alltoall", mine, ep, 8, A100) == pytest.approx(across, rel=1e-12)
    # t = 4: two of the group per node: 1/4 of the rows over NVLink, 2/4 through the NIC, at once
    mixed = max(1 / 4 * mine / NVLINK, 2 / 4 * mine / NIC) + 3 * A100.ib_latency
    assert ep_collective_time("ep_alltoall", mine, ep, 4, A100) == pytest.approx(mixed, rel=1e-12)
    # the all-gather's ring over 4 nodes runs at one NIC per member (dp_link)
    ring = 3 / 4 * (ep * mine) / NIC + 3 * A100.ib_latency
    assert ep_collective_time("ep_allgather", ep * mine, ep, 8, A100) == pytest.approx(ring, rel=1e-12)


@pytest.mark.parametrize("ep", [2, 4, 8])
def test_allgather_puts_ep_times_the_alltoalls_bytes_on_the_wire(ep):
    b = 8
    ag = layer_times(MEDIUM, A100, b, 1, ep=ep, dispatch="allgather")["moe_f"].ep
    a2a = layer_times(MEDIUM, A100, b, 1, ep=ep, dispatch="alltoall")["moe_f"].ep
    latency = (ep - 1) * A100.nvlink_latency
    route = ep_collective_time("ep_allgather", ep * 16 * 8, ep, 1, A100)
    assert (ag - route - 2 * latency) / (a2a - route - 2 * latency) == pytest.approx(ep, rel=1e-9)


def test_no_exchange_at_ep_1_and_the_dense_layer_is_unchanged():
    assert _ep_ops(layer_ops(SMALL, 2, 1, moe=True, ep=1).forward) == []
    dense = replace(SMALL, experts=0)
    assert layer_ops(dense, 2, 1, moe=True, ep=4) == layer_ops(dense, 2, 1)
    est = estimate(MEDIUM, Cluster(8, A100, 64), Layout(t=1, p=1, d=8, b=1))
    assert est.breakdown["ep_comm"] == 0.0


# ------------------------------------------------------------------ memory


def test_memory_falls_with_ep_by_exactly_the_experts_a_rank_no_longer_holds():
    per_expert_layer = MEDIUM.experts * MEDIUM.expert_params
    mems = {}
    for ep in (1, 2, 4, 8):
        lay = Layout(t=1, p=1, d=8, b=1, recompute="none", ep=ep, expert_dispatch="alltoall")
        mems[ep] = memory_per_gpu(MEDIUM, lay, m=8)
    for ep in (2, 4, 8):
        gone = 8 * per_expert_layer * (1 - 1 / ep)  # 8 expert layers, (E - E/ep) experts each
        assert mems[1].weights - mems[ep].weights == pytest.approx(MIXED.weight * gone, rel=1e-12)
        assert mems[1].grads - mems[ep].grads == pytest.approx(MIXED.grad * gone, rel=1e-12)
        assert mems[1].optimizer - mems[ep].optimizer == pytest.approx(MIXED.optimizer_state * gone, rel=1e-12)
    totals = [mems[ep].total for ep in (1, 2, 4, 8)]
    assert totals == sorted(totals, reverse=True) and len(set(totals)) == 4
    # the all-to-all's rows are the rank's S whatever ep is: what its microbatches keep does not move
    # (the activation entry is the optimizer step's fp32 gradient copy here, which falls with ep too)
    assert len({round(mems[ep].kept) for ep in (1, 2, 4, 8)}) == 1
    assert [mems[ep].step_copy for ep in (1, 2, 4, 8)] == sorted((mems[ep].step_copy for ep in (1, 2, 4, 8)),
                                                                   reverse=True)


def test_allgather_activations_grow_with_ep_alltoall_ones_do_not():
    b, S, h, f_l, A = 2, 2 * 2 * 1024, 2048, 8192, 2
    kept = {(ep, d): activation_bytes_per_layer(MEDIUM, b, 1, moe=True, ep=ep, dispatch=d)
            for ep in (1, 2, 4, 8) for d in ("allgather", "alltoall")}
    for ep in (2, 4, 8):
        assert kept[ep, "alltoall"] == kept[1, "alltoall"]
        # ep S rows in the grouped GEMMs' tensors instead of S: (ep - 1) S (h + 3 f_e) more
        assert kept[ep, "allgather"] - kept[ep, "alltoall"] == pytest.approx(A * (ep - 1) * S * (h + 3 * f_l))
    lay = Layout(t=1, p=1, d=8, b=b, recompute="none", ep=8, expert_dispatch="allgather")
    ag, a2a = memory_per_gpu(MEDIUM, lay, m=4), memory_per_gpu(MEDIUM, replace(lay, expert_dispatch="alltoall"), m=4)
    # 8 expert layers keep their activations (no recomputation): 8 x the difference above
    assert ag.kept - a2a.kept == pytest.approx(8 * A * 7 * S * (h + 3 * f_l))
    assert ag.total > a2a.total


# ------------------------------------------------------------------ gradient reduction


@pytest.mark.parametrize("ep", [1, 2, 4, 8])
def test_expert_gradients_are_reduced_over_their_own_replicas(ep):
    lay = Layout(t=1, p=1, d=8, b=1, ep=ep, expert_dispatch="alltoall")
    est = estimate(MEDIUM, Cluster(8, A100, 64), lay)
    P, P_exp = params_per_stage(MEDIUM, 1, 1, ep)[0], expert_params_per_stage(MEDIUM, 1, 1, ep)[0]
    if ep == 1:
        want = allreduce_time(2 * P, 8, *dp_link(A100, 1, 8))
    else:  # dense over d = 8; the experts over the d/ep replicas holding them (none to sum with at ep = d)
        want = allreduce_time(2 * (P - P_exp), 8, *dp_link(A100, 1, 8)) + allreduce_time(
            2 * P_exp, 8 // ep, *dp_link(A100, ep, 8 // ep))
    assert est.t_dp == pytest.approx(want, rel=1e-12)
    if ep == 8:
        assert est.t_dp == pytest.approx(allreduce_time(2 * (P - P_exp), 8, *dp_link(A100, 1, 8)), rel=1e-12)


# ------------------------------------------------------------------ rules, planner, output


def test_an_ep_that_does_not_divide_the_experts_is_refused_with_the_fix():
    with pytest.raises(PlanError, match=r"ep=3 does not divide the 8 experts.*Fix: ep in \[1, 2, 4, 8\]"):
        estimate(SMALL, Cluster(6, A100, 12), Layout(t=1, p=1, d=6, b=1, ep=3))
    errs = layout_errors(SMALL, Cluster(8, A100, 16), Layout(t=1, p=1, d=8, b=1, ep=16))
    assert any("ep=16 does not divide d=8" in e for e in errs)
    dense = replace(SMALL, experts=0)
    with pytest.raises(PlanError, match="has none"):
        estimate(dense, Cluster(2, A100, 4), Layout(t=1, p=1, d=2, b=1, ep=2))
    rejected: dict[str, int] = {}
    space = SearchSpace(t=(1,), p=(1,), ep=(3,), b=(1,), recompute=("layer",), distributed_optimizer=(False,))
    assert list(candidate_layouts(SMALL, Cluster(6, A100, 12), space, rejected)) == []
    assert rejected == {"experts % ep != 0": 2}  # one layout per dispatcher


def test_the_planner_picks_ep_when_the_experts_do_not_fit_otherwise():
    # one key/value head: t = 1 only; 128 experts of 3 x 2048 x 8192: 6.4B parameters per layer
    spec = ModelSpec(layers=2, hidden=2048, heads=16, kv_heads=1, seq_len=1024, vocab=32000, ffn=8192, gated_mlp=True,
                     experts=128, top_k=2, dropout=False, fused_attention=True, tied_head=False,
                     learned_positions=False, name="moe-wide")
    plan = search(spec, Cluster(8, A100, 64), SearchSpace(distributed_optimizer=(False,)))
    assert plan.ranked and plan.best.layout.ep > 1
    assert all(e.layout.ep > 1 for e in plan.ranked)
    assert any(e.layout.ep == 1 for e in plan.too_big)  # ep = 1 was priced, and does not fit
    assert plan.best.layout.short.endswith(f"ep={plan.best.layout.ep} "
                                           + ("a2a" if plan.best.layout.expert_dispatch == "alltoall" else "ag"))
    row = plan.best.as_dict()
    assert (row["ep"], row["expert_dispatch"]) == (plan.best.layout.ep, plan.best.layout.expert_dispatch)


def test_a_dense_model_searches_ep_1_only_and_the_config_carries_ep():
    dense = replace(MEDIUM, experts=0)
    lays = list(candidate_layouts(dense, Cluster(8, A100, 64), SearchSpace(b=(1,), recompute=("layer",))))
    assert lays and {lay.ep for lay in lays} == {1}
    moe = list(candidate_layouts(MEDIUM, Cluster(8, A100, 64), SearchSpace(t=(1,), p=(1,), b=(1,),
                                                                          recompute=("layer",),
                                                                          distributed_optimizer=(False,))))
    assert sorted((lay.ep, lay.expert_dispatch) for lay in moe) == [
        (1, "alltoall"), (2, "allgather"), (2, "alltoall"), (4, "allgather"), (4, "alltoall"),
        (8, "allgather"), (8, "alltoall")]
    cfg = ParallelConfig(dp=4, ep=2, expert_dispatch="alltoall")
    lay = Layout.from_config(cfg, 1)
    assert (lay.d, lay.ep, lay.expert_dispatch, lay.edp) == (4, 2, "alltoall", 2)


def test_autopar_plan_shows_ep_and_the_dispatcher(capsys):
    from autopar.cli import main

    args = ["plan", "--model", "mixtral-8x7b", "--gpus", "32", "--batch", "32", "--tp", "1", "--pp", "4",
            "--micro-batch", "1", "--recompute", "layer", "--schedule", "1f1b", "--top", "40", "--hardware", "dgx-h200"]
    assert main(args + ["--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["model"]["experts"] == 8 and out["model"]["top_k"] == 2
    seen = {(r["ep"], r["expert_dispatch"]) for r in out["ranked"]}
    # d = 8: ep in 1, 2, 4, 8, each ep > 1 with both dispatchers; all 8 experts of 8 layers do not fit (ep = 1)
    assert seen == {(ep, d) for ep in (2, 4, 8) for d in ("allgather", "alltoall")}
    assert out["rejected"] == {"does not fit in memory": 1}
    assert main(args) == 0
    text = capsys.readouterr().out
    header = next(line.split() for line in text.splitlines() if line.startswith("#"))
    assert header[:5] == ["#", "t", "p", "d", "ep"]
    assert "8 a2a" in text and "8 ag" in text
