"""Context parallelism in the performance model and the planner, without processes.

Under cp a rank holds s/cp tokens of each sequence: every kernel runs on them, its attention is
1/cp of the score matrix, ring attention passes the key/value blocks (cp-1 hops forward; the blocks
again and fp32 dK/dV accumulators backward) behind its blocks' computation, activations are per
token (1/cp of them), parameters are replicated and their gradients reduced over d cp ranks.
"""

import json

import pytest

from autopar.planning.cost.activations import activation_bytes_per_layer
from autopar.planning.cost.hardware import get_hardware
from autopar.planning.cost.layout import Cluster, Layout, layout_errors
from autopar.planning.cost.memory import memory_per_gpu
from autopar.planning.cost.models import ModelSpec, params_per_stage
from autopar.planning.cost.network import allreduce_time, cp_ring_link, dp_link, p2p_time, stage_link
from autopar.planning.cost.op_times import layer_times, op_time, ring_hop_time
from autopar.planning.cost.ring_costs import ring_block_shares, ring_exposed_time
from autopar.planning.cost.step_estimate import estimate
from autopar.planning.cost.transformer import layer_ops
from autopar.planning.errors import PlanError
from autopar.planning.search.planner import SearchSpace, candidate_layouts, search

A100 = get_hardware("dgx-a100-80gb")
MiB = 2**20


def llama(seq_len: int, **over) -> ModelSpec:
    """A Llama-2-7B-like decoder (32 layers, h 4096, 32 heads of 128, 8 key/value heads, SwiGLU 11008,
    fused attention, no dropout) at ``seq_len`` tokens."""
    fields = dict(layers=32, hidden=4096, heads=32, kv_heads=8, seq_len=seq_len, vocab=32000, ffn=11008,
                  gated_mlp=True, dropout=False, fused_attention=True, tied_head=False, learned_positions=False,
                  name=f"llama-7b-{seq_len // 1024}k")
    return ModelSpec(**{**fields, **over})


def _ring_bytes(ops) -> dict[str, float]:
    return {o.name: o.bytes for o in ops if o.kind in ("cp_ring", "cp_ring_grad")}


def test_ring_bytes_per_layer_for_a_known_shape():
    # 8 key/value heads of 128, 4096 tokens on cp=4 (1024 a rank), one sequence, bf16: a block of K and
    # V is 2 * 8 * 1024 * 128 * 2 B = 4 MiB; 3 hops forward = 12 MiB; backward the blocks again (12 MiB)
    # and 3 fp32 accumulators of the same elements (24 MiB): 36 MiB (docs/context-parallel.md's example)
    ops = layer_ops(llama(4096), 1, 1, cp=4)
    assert _ring_bytes(ops.forward) == {"ring_kv": 12 * MiB}
    assert _ring_bytes(ops.backward) == {"ring_kv.bwd": 12 * MiB, "ring_grad": 24 * MiB}
    # t = 2 carries 4 key/value heads per rank, b = 2 two sequences: 2/2 of the bytes
    assert _ring_bytes(layer_ops(llama(4096), 2, 2, cp=4).forward) == {"ring_kv": 12 * MiB}
    assert _ring_bytes(layer_ops(llama(4096), 1, 1, cp=1).forward) == {}  # no ring at cp = 1


def test_every_kernel_runs_on_s_over_cp_tokens_and_attention_is_1_over_cp():
    spec = llama(16384)
    one, four = layer_ops(spec, 1, 2), layer_ops(spec, 1, 2, cp=4)
    for phase in ("forward", "backward"):
        a, b = getattr(one, phase), getattr(four, phase)
        gemm = lambda ops, attn: sum(o.flops for o in ops if o.kind == "gemm" and o.attention == attn)  # noqa: E731
        assert gemm(b, True) == gemm(a, True) / 4  # the rank's s/4 queries against all s keys
        assert gemm(b, False) == gemm(a, False) / 4  # the linears on s/4 tokens
        tp = lambda ops: sum(o.bytes for o in ops if o.kind == "tp_allreduce")  # noqa: E731
        assert tp(b) == tp(a) / 4
    scores = next(o for o in four.forward if o.name == "scores")
    assert scores.gemm == (1 * 16, 4096, 16384, 128)  # (b a/t, s/cp, s, d)


def test_ring_overlap_by_hand():
    # causal, cp = 4: steps weigh 1, 1/2, 1/2, 1/2 -> shares 0.4, 0.2, 0.2, 0.2
    assert ring_block_shares(4, True) == pytest.approx([0.4, 0.2, 0.2, 0.2])
    assert ring_block_shares(4, False) == pytest.approx([0.25] * 4)
    # forward, a hop of 1 s beside 2 s of attention: steps 0..2 hide 0.8, 0.4, 0.4 s -> 0.2 + 0.6 + 0.6
    assert ring_exposed_time(1.0, 2.0, 4, True) == pytest.approx(1.4)
    # backward, accumulators of 2 s a hop: step 0: 1 - 0.8; step 1: 1 - 0.4; step 2: 1 + 2 - 0.4;
    # step 3: 2 - 0.4; and the last accumulator after every block: 2
    assert ring_exposed_time(1.0, 2.0, 4, True, accumulator_hop=2.0) == pytest.approx(0.2 + 0.6 + 2.6 + 1.6 + 2.0)
    assert ring_exposed_time(1.0, 100.0, 4, True) == 0.0  # long blocks hide every hop
    assert ring_exposed_time(1.0, 2.0, 1, True) == 0.0


def test_layer_times_price_the_exposed_ring_over_its_link():
    spec, b, t, cp = llama(32768), 1, 2, 8  # t cp = 16 > 8 GPUs a node: the ring crosses nodes
    assert cp_ring_link(A100, t, cp)[0] == A100.ib_bw * A100.ib_efficiency
    assert cp_ring_link(A100, 2, 4)[0] == A100.nvlink_bw * A100.nvlink_efficiency
    times = layer_times(spec, A100, b, t, cp=cp)
    ops = layer_ops(spec, b, t, cp=cp)

    def exposed(phase: str) -> float:
        ring = _ring_bytes(getattr(ops, phase))
        attention = sum(op_time(o, A100, t, 1, cp) for o in getattr(ops, phase) if o.attention)
        kv = ring.get("ring_kv", ring.get("ring_kv.bwd"))
        return ring_exposed_time(ring_hop_time(kv, A100, t, cp), attention, cp, True,
                                 ring_hop_time(ring.get("ring_grad", 0.0), A100, t, cp))

    hop = ring_hop_time(_ring_bytes(ops.forward)["ring_kv"], A100, t, cp)
    assert hop == pytest.approx(p2p_time(2 * 4 * 4096 * 128 * 2, *cp_ring_link(A100, t, cp)))
    assert times["layer_f"].cp == pytest.approx(exposed("forward"))
    # the backward's last accumulator arrives after every block: never hidden
    assert times["layer_b"].cp == pytest.approx(exposed("backward")) and times["layer_b"].cp > 0
    assert layer_times(spec, A100, b, t)["layer_f"].cp == 0.0


def test_activations_at_cp_4_are_a_quarter_of_cp_1():
    spec = llama(65536)
    for t, sp in ((1, False), (4, True)):
        one = activation_bytes_per_layer(spec, 1, t, sp)
        assert activation_bytes_per_layer(spec, 1, t, sp, cp=4) == one / 4
    # what a whole stage keeps (layers, embedding's ids, head's softmax): a quarter too; model state unchanged
    cl = Cluster(32, A100, 32)
    one = memory_per_gpu(spec, Layout(t=4, p=1, d=8, b=1, recompute="none", sequence_parallel=True), 4)
    four = memory_per_gpu(spec, Layout(t=4, p=1, d=2, b=1, recompute="none", sequence_parallel=True, cp=4), 16)
    assert four.kept == pytest.approx(one.kept / 4, rel=1e-12)
    assert (four.weights, four.grads, four.optimizer) == (one.weights, one.grads, one.optimizer)
    # the distributed optimizer shards over the d cp ranks holding the same parameters: 12/(d cp) bytes each
    P = params_per_stage(spec, 4, 1)[0]
    sharded = estimate(spec, cl, Layout(t=4, p=1, d=2, b=1, cp=4, sequence_parallel=True,
                                        distributed_optimizer=True))
    assert sharded.memory.optimizer == pytest.approx(12 * P / 8)


def test_gradients_are_reduced_over_d_cp_and_pipeline_sends_carry_s_over_cp():
    spec = llama(16384)
    cl = Cluster(64, A100, 16)
    lay = Layout(t=2, p=2, d=4, b=1, cp=4, scatter_gather=False)
    est = estimate(spec, cl, lay)
    P = max(params_per_stage(spec, 2, 2))
    assert est.t_dp == pytest.approx(allreduce_time(2 * P, 16, *dp_link(A100, 2, 16)), rel=1e-12)
    assert est.t_p2p == pytest.approx(p2p_time(2 * 16384 // 4 * 4096, *stage_link(A100, 8, 4, 2)), rel=1e-12)
    assert est.breakdown["cp_comm"] > 0 and est.as_dict()["cp"] == 4
    assert lay.short == "t=2 cp=4 p=2 d=4 b=1 1F1B"


def test_a_layout_that_does_not_fill_the_world_or_cut_the_sequence_is_refused_with_the_numbers():
    spec = llama(10240)
    errs = layout_errors(spec, Cluster(16, A100, 16), Layout(t=2, p=1, d=2, b=1, cp=2))
    assert any("t(2) * cp(2) * p(1) * d(2) = 8, but the cluster has 16 GPUs" in e for e in errs)
    errs = layout_errors(spec, Cluster(12, A100, 12), Layout(t=1, p=1, d=4, b=1, cp=3))
    assert any("2*cp = 6 equal chunks" in e and "10240 % 6 = 4" in e and "Fix: cp in [2, 4, 5, 8" in e
               for e in errs)
    with pytest.raises(PlanError, match="cp=3"):
        estimate(spec, Cluster(12, A100, 12), Layout(t=1, p=1, d=4, b=1, cp=3))
    bidirectional = llama(10240, causal=False)  # cp chunks: 10240 % 5 == 0
    assert layout_errors(bidirectional, Cluster(5, A100, 5), Layout(t=1, p=1, d=1, b=1, cp=5)) == []


def test_the_search_proposes_only_cps_that_fill_the_world_and_cut_the_sequence():
    # 48 GPUs, 10240 = 2^11 * 5 tokens, causal: 2 cp must divide 10240, so cp in 1, 2, 4, 8, 16 of 48's divisors
    spec, cl = llama(10240), Cluster(48, A100, 48)
    space = SearchSpace(b=(1,), recompute=("layer",), schedules=("1f1b",), sequence_parallel=(False,),
                        distributed_optimizer=(False,))
    lays = list(candidate_layouts(spec, cl, space))
    assert {lay.cp for lay in lays} == {1, 2, 4, 8, 16}
    assert all(lay.world == 48 and spec.seq_len % (2 * lay.cp) == 0 for lay in lays)
    rejected: dict[str, int] = {}
    named = SearchSpace(t=(1,), p=(1,), b=(1,), cp=(3, 5), recompute=("layer",), distributed_optimizer=(False,))
    assert list(candidate_layouts(spec, cl, named, rejected)) == []
    assert rejected == {"seq_len % (2*cp) != 0 (causal; cp bidirectional)": 1, "t*cp does not divide n": 1}
    # a short sequence: cp > 1 only when named
    assert {lay.cp for lay in candidate_layouts(llama(4096), cl, space)} == {1}


def test_the_planner_picks_cp_when_nothing_else_fits_and_cp_1_for_short_sequences():
    # a million tokens of a 7B model on 64 A100s: no layout of cp = 1 fits, whatever t, p, d, b
    long, cl = llama(1 << 20), Cluster(64, A100, 16)
    space = SearchSpace(recompute=("layer",), schedules=("1f1b",))
    assert search(long, cl, SearchSpace(cp=(1,), recompute=("layer",), schedules=("1f1b",))).ranked == []
    plan = search(long, cl, space, top=3)
    assert plan.best.layout.cp > 1 and plan.best.fits
    assert plan.best.memory.total <= A100.usable_bytes
    # 4096 tokens, a batch of 256 sequences (d can be 64): offered cp = 1, 2, 4, 8, the planner keeps the
    # sequence whole (with fewer sequences than GPUs, cp competes with t to use them)
    short = search(llama(4096), Cluster(64, A100, 256), SearchSpace(cp=(1, 2, 4, 8), recompute=("layer",),
                                                                      schedules=("1f1b",)), top=3)
    assert short.best.layout.cp == 1


def test_attention_dropout_keeps_cp_out_of_runnable_plans():
    spec = llama(16384, dropout=True)
    cl = Cluster(16, A100, 16)
    est = estimate(spec, cl, Layout(t=1, p=1, d=4, b=1, cp=4), runnable=False)
    assert not est.runnable and "ring attention (cp=4) has no attention dropout" in est.runtime_errors[0]
    lays = list(candidate_layouts(spec, cl, SearchSpace(t=(1,), p=(1,), b=(1,), recompute=("layer",))))
    assert {lay.cp for lay in lays} == {1}


def test_autopar_plan_cp_flag(capsys):
    from autopar.cli import main

    args = ["plan", "--layers", "32", "--hidden", "4096", "--heads", "32", "--kv-heads", "8", "--ffn", "11008",
            "--gated-mlp", "--vocab", "32000", "--seq-len", "65536", "--gpus", "32", "--batch", "16",
            "--recompute", "layer", "--schedule", "1f1b", "--cp", "1,2,4", "--top", "40"]
    assert main(args + ["--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    rows = out["ranked"]
    by_cp = {entry["cp"]: entry["layout"] for entry in out["by_cp"]}  # the fastest layout at each cp named
    assert sorted(by_cp) == [1, 2, 4] and all(by_cp[cp]["cp"] == cp for cp in by_cp)
    assert min(r["iteration_s"] for r in rows) == pytest.approx(min(e["iteration_s"] for e in by_cp.values()))
    assert {r["cp"] for r in rows} <= {1, 2, 4} and any(r["cp"] > 1 for r in rows)
    assert all(r["t"] * r["cp"] * r["p"] * r["d"] == 32 for r in rows)
    assert main(args) == 0
    header = next(line.split() for line in capsys.readouterr().out.splitlines() if line.lstrip().startswith("#"))
    assert header[:5] == ["#", "t", "cp", "p", "d"]
    with pytest.raises(SystemExit):
        main(args[:-4] + ["--cp", "0"])
