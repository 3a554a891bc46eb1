"""Tier (a): the performance model's formulas and its calibration, no processes."""

from __future__ import annotations

import dataclasses
import math

import pytest

from autopar.core.config import ParallelConfig, Recompute, microbatch_errors, optimizer_bytes_per_param
from autopar.planning import cost
from autopar.planning.cost.calibration import PAPER_RUNS, fit_efficiency
from autopar.planning.cost.formulas import FORMULAS, explain
from autopar.planning.cost.hardware import get_hardware
from autopar.planning.cost.layout import Cluster, Layout, layout_errors
from autopar.planning.cost.memory import activation_bytes_per_layer, layer_backward_transient, memory_per_gpu
from autopar.planning.cost.models import PRESETS, ModelSpec, get_model, param_count, params_per_stage
from autopar.planning.cost.op_costs import attention_flops, linear_bytes, linear_flops, matmul_flops
from autopar.planning.cost.op_times import gemm_efficiency, tile_fill
from autopar.planning.cost.step_estimate import estimate
from autopar.planning.cost.transformer import graph_flops, layer_ops, paper_flops

A100 = get_hardware("dgx-a100-80gb")


def test_per_node_flops_and_bytes_from_shapes():
    # Y (4, 5) = X (4, 3) W (3, 5): 2*4*3*5 FLOPs; reads X (12) and W (15), writes Y (20), fp16
    assert linear_flops(4, 3, 5) == 120
    assert linear_bytes(4, 3, 5) == (12 + 15 + 20) * 2
    assert matmul_flops(7, 4, 5, 3) == 7 * 120
    # Q K^T and P V for b=2, a=3, s=10, d=8: 2 * (2*2*3*10*10*8)
    assert attention_flops(2, 3, 10, 10, 8) == 4 * 2 * 3 * 10 * 10 * 8


def test_layer_forward_flops_are_24bsh2_plus_4bs2h():
    # the paper: one layer's forward is 24 b s h^2 + 4 b s^2 h (GEMMs); element-wise ops add < 1%
    spec = get_model("gpt-7.5b")
    b, s, h = 2, spec.seq_len, spec.hidden
    ops = layer_ops(spec, b, 1).forward
    gemm = sum(o.flops for o in ops if o.kind == "gemm")
    assert gemm == pytest.approx(24 * b * s * h * h + 4 * b * s * s * h, rel=1e-3)  # biases are not GEMM FLOPs
    bwd = sum(o.flops for o in layer_ops(spec, b, 1).backward if o.kind == "gemm")
    assert bwd == pytest.approx(2 * gemm, rel=1e-9)


def test_tensor_parallel_splits_gemm_flops():
    spec = get_model("gpt-18b")
    f1 = sum(o.flops for o in layer_ops(spec, 1, 1).forward if o.kind == "gemm")
    f8 = sum(o.flops for o in layer_ops(spec, 1, 8).forward if o.kind == "gemm")
    assert f8 == pytest.approx(f1 / 8, rel=1e-9)
    ars = [o for o in layer_ops(spec, 1, 8).forward if o.kind == "tp_allreduce"]
    assert len(ars) == 2 and ars[0].bytes == 2 * spec.seq_len * spec.hidden  # b s h fp16


@pytest.mark.parametrize("name", sorted(PRESETS))
@pytest.mark.parametrize("recompute", [True, False])
def test_graph_flops_match_paper_formula_within_2_percent(name, recompute):
    spec = PRESETS[name]
    ours, paper = graph_flops(spec, 512, recompute), paper_flops(spec, 512, recompute)
    assert abs(ours / paper - 1) < 0.02, f"{name}: node-by-node {ours:.4g} vs paper {paper:.4g}"


def test_param_count_matches_paper_formula():
    for spec in PRESETS.values():
        l, h, V, s = spec.layers, spec.hidden, spec.vocab, spec.seq_len
        paper = 12 * l * h * h * (1 + 13 / (12 * h) + (V + s) / (12 * l * h))
        assert param_count(spec) == pytest.approx(paper + 2 * h, rel=1e-12)  # + final LayerNorm
    assert param_count(get_model("gpt-39b")) / 1e9 == pytest.approx(39.1, abs=0.05)
    assert param_count(get_model("gpt-76b")) / 1e9 == pytest.approx(76.1, abs=0.05)


def test_gemm_efficiency_depends_on_shape():
    big = gemm_efficiency(8192, 8192, 8192, A100)
    # 32 x 64 = 2048 tiles of 256x128 run in 19 waves of 108 SMs: 2048 / 2052 of the slots are used
    k_factor = 8192 / (8192 + A100.eff.gemm_k_overhead)
    assert big == pytest.approx(A100.eff.gemm * 2048 / 2052 * k_factor, rel=1e-9)
    # head_dim 64 attention matmul: K small -> the tile prologue/epilogue dominates
    assert gemm_efficiency(2048, 2048, 64, A100, batch=64) < 0.6 * big
    # 109 tiles of 256x128 on 108 SMs: two waves, the second almost empty (fill 109/216); in
    # 128x128 tiles, 218 tiles in three waves (218/324): cuBLAS's pick, the better fill
    assert tile_fill(256 * 109, 128, A100, tile=(256, 128)) == pytest.approx(109 / 216, rel=1e-12)
    assert tile_fill(256 * 109, 128, A100, tile=(128, 128)) == pytest.approx(218 / 324, rel=1e-12)
    assert gemm_efficiency(256 * 109, 128, 8192, A100) == pytest.approx(A100.eff.gemm * 218 / 324 * k_factor,
                                                                        rel=1e-9)


# ------------------------------------------------------------------- memory


def test_memory_hand_computed_example():
    # 4 layers, h=1024, 16 heads, s=512, V=1000; t=2, p=2, b=2, m=4, 1F1B, full recomputation
    spec = ModelSpec(layers=4, hidden=1024, heads=16, seq_len=512, vocab=1000)
    h, T = 1024, 2 * 512
    # one layer on one of 2 ranks: QKV 3h^2+3h, proj h^2, fc1 4h^2+4h, fc2 4h^2 split; proj/fc2 bias, 2 LN replicated
    layer = (3 * h * h + 3 * h + h * h + 4 * h * h + 4 * h + 4 * h * h) // 2 + 6 * h
    assert layer == 6_301_184
    stage0 = 2 * layer + 500 * h + 512 * h  # + word embedding V/t rows + position embedding
    stage1 = 2 * layer + 2 * h + 500 * h  # + final LN + tied LM-head copy
    assert params_per_stage(spec, 2, 2) == [stage0, stage1]
    ckpt = 2 * T * h  # one layer input, fp16
    full_layer = 512 * 2 * (10 * h + 24 * h / 2 + 5 * 16 * 512 / 2)  # s b (10h + 24h/t + 5as/t)
    assert activation_bytes_per_layer(spec, 2, 2) == full_layer == 44_040_192
    # the backward of a layer allocates, on top of it, the larger of the gradient of the GeLU output
    # (2 b s f/t) and the gradient of the attention probabilities (2 b a/t s^2) minus the MLP block's
    # activations already released (s b (5h + 2*2f/t)); here the MLP one: 2 * 1024 * 2048
    f_l = 4 * h // 2
    assert layer_backward_transient(spec, 2, 2) == max(2 * T * f_l, 2 * 2 * 8 * 512**2 - T * (5 * h + 4 * f_l))
    assert layer_backward_transient(spec, 2, 2) == 4_194_304
    # stage 0 holds min(p, m) = 2 microbatches x (2 layers of checkpoints + the chunk's output kept
    # for its backward), then one re-materialised layer + that transient + the incoming and
    # outgoing gradients (2 ckpt); each in-flight microbatch of the first chunk also keeps the
    # embedding's int64 token ids (8 bytes per token) and its 1-byte dropout mask (h per token)
    act0 = 2 * (2 + 1) * ckpt + (full_layer + 4_194_304 + 2 * ckpt) + 2 * T * (8 + h)
    mem = memory_per_gpu(spec, Layout(t=2, p=2, d=1, b=2), m=4)
    assert mem.stage == 0
    assert mem.weights == 2 * stage0 and mem.grads == 2 * stage0 and mem.optimizer == 12 * stage0
    assert mem.buffers == 0 and mem.activations == act0
    assert mem.total == 16 * stage0 + act0 == 285_343_744
    # with a large vocabulary the last stage is the fullest: 1 microbatch in flight (2 layers of
    # checkpoints; its output is the loss) keeping the head's inputs (final LN's and the LM head's,
    # 2 ckpt), the fp32 softmax (4 bytes per local logit) and the int64 targets; then the loss's
    # working set, the 16-bit logits (then their gradient) + the gradient of the head's input, is
    # larger than a layer's backward working set (they never coexist: the max)
    big = ModelSpec(layers=4, hidden=1024, heads=16, seq_len=512, vocab=64000)
    last = memory_per_gpu(big, Layout(t=2, p=2, d=1, b=2), m=4)
    head = 2 * ckpt + T * (4 * 32000 + 8)
    loss = 2 * T * 32000 + ckpt
    assert loss > full_layer + 4_194_304 + 2 * ckpt
    assert last.stage == 1 and last.activations == 1 * 2 * ckpt + head + loss
    # without recomputation: 2 in flight x (2 layers x full activations + the chunk's output + the
    # embedding's ids and mask), the transient and gradients
    none = memory_per_gpu(spec, Layout(t=2, p=2, d=1, b=2, recompute="none"), m=4)
    assert none.activations == 2 * (2 * full_layer + ckpt + T * (8 + h)) + 4_194_304 + 2 * ckpt


def test_ddp_buckets_and_the_optimizer_step_peak():
    # 3.6B at t=1 on 64 GPUs: 16 B/param of state, + 2 B/param of PyTorch DDP buckets when the
    # all-reduce overlaps the backward, + the step's fp32 gradient copy (4 B/param) once the
    # activations are freed: 22 B/param = 73 GiB, over 90% of 80 GiB whatever the micro-batch
    spec, cl = get_model("gpt-3.6b"), Cluster.of(64, "dgx-a100-80gb", 512)
    P = params_per_stage(spec, 1, 1)[0]
    for b in (1, 8):
        ddp = estimate(spec, cl, Layout(t=1, p=1, d=64, b=b, dp_overlap=True))
        assert ddp.memory.buffers == 2 * P and ddp.memory.activations == 4 * P
        assert ddp.memory.total == 22 * P and not ddp.fits
        local = estimate(spec, cl, Layout(t=1, p=1, d=64, b=b, dp_overlap=False))
        assert local.memory.buffers == 0 and local.memory.total == 20 * P and local.fits
    # no data parallelism, no DDP buckets
    one = memory_per_gpu(spec, Layout(t=1, p=1, d=1, b=1, dp_overlap=True), m=8)
    assert one.buffers == 0


# -------------------------------------------------------------- divisibility


def test_layout_errors_name_each_rule():
    spec = ModelSpec(layers=30, hidden=1536, heads=12)
    cl = Cluster.of(64, "dgx-a100-80gb", 96)

    def errs(**kw):
        return " | ".join(layout_errors(spec, cl, Layout(**kw)))

    assert errs(t=8, p=1, d=8, b=1).count("heads (12") == 1  # 12 % 8
    assert "layers (30) must be divisible by p*v = 4" in errs(t=2, p=4, d=8, b=1, v=1, schedule="gpipe")
    assert "not divisible by d*b" in errs(t=2, p=1, d=32, b=2)  # 96 % 64
    # m = 2: the microbatch rules of core.config, with where m comes from
    mb = [e for e in layout_errors(spec, cl, Layout(t=1, p=3, d=16, b=3, v=2)) if e.startswith("with m")]
    assert mb == [f"with m = B/(d b) = 96/(16*3) = 2 microbatches, {e}"
                  for e in microbatch_errors("interleaved", 3, 2, 2)]
    assert "m=2 < p=3" in mb[0] and "multiple of p" in mb[1] and mb[1].endswith("Use m=3")
    assert "t(4) * p(2) * d(4) = 32" in errs(t=4, p=2, d=4, b=1)
    assert "cannot fill" in errs(t=1, p=2, d=32, b=1, v=16)
    assert errs(t=4, p=2, d=8, b=2, v=3) == ""  # valid: m = 6, 30 % 6 == 0


def test_recompute_speaks_the_config_vocabulary():
    lay = Layout(t=1, p=1, d=1, b=1)
    assert lay.recompute is Recompute.LAYER  # Megatron's full recomputation, as in every paper run
    assert Layout(t=1, p=1, d=1, b=1, recompute="none").recompute is Recompute.NONE
    assert Layout(t=1, p=1, d=1, b=1, recompute="layer") == lay
    with pytest.raises(ValueError, match=r"got 'full' \('full', Megatron's name, is 'layer'\)"):
        Layout(t=1, p=1, d=1, b=1, recompute="full")
    with pytest.raises(ValueError, match="prices recompute 'layer' or 'none', not 'chunk'"):
        Layout(t=1, p=1, d=1, b=1, recompute=Recompute.CHUNK)


def test_layout_from_config():
    config = ParallelConfig(tp=4, pp=2, virtual_stages=3, microbatches=8, schedule="interleaved", dp=4,
                            recompute="layer", scatter_gather=False)
    lay = Layout.from_config(config, micro_batch_size=2)
    assert lay == Layout(t=4, p=2, d=4, b=2, v=3, schedule="interleaved", recompute=Recompute.LAYER,
                         scatter_gather=False, dp_overlap=True)
    # sequence_parallel=None ("where it fits") is priced as on at t > 1
    fits = ParallelConfig(tp=4, pp=2, virtual_stages=3, microbatches=8, schedule="interleaved", dp=4,
                          recompute="layer", scatter_gather=False, sequence_parallel=None)
    assert Layout.from_config(fits, micro_batch_size=2) == dataclasses.replace(lay, sequence_parallel=True)
    # on a cluster of t p d GPUs with B = m d b, the estimate runs the config's microbatches
    est = estimate(ModelSpec(layers=12, hidden=1024, heads=16), Cluster.of(32, "dgx-a100-80gb", 8 * 4 * 2), lay)
    assert est.m == config.microbatches
    plain = Layout.from_config(ParallelConfig(world_size=8), micro_batch_size=1)
    assert (plain.t, plain.p, plain.d, plain.v, plain.schedule, plain.recompute) == (1, 1, 8, 1, "1f1b",
                                                                                      Recompute.NONE)
    with pytest.raises(ValueError, match="not 'chunk'"):
        Layout.from_config(ParallelConfig(recompute="chunk"), micro_batch_size=1)


def test_optimizer_state_and_step_traffic_are_two_numbers():
    """16 bytes of state per parameter (weights, gradients, then Adam's 12); the step moves 52."""
    from autopar.planning.cost.data_parallel_cost import OPTIMIZER_STEP_TRAFFIC_PER_PARAM

    spec, lay = get_model("gpt-1.7b"), Layout(t=1, p=1, d=32, b=16)
    P = params_per_stage(spec, 1, 1)[0]
    mem = memory_per_gpu(spec, lay, m=1)
    assert mem.optimizer == optimizer_bytes_per_param(2) * P == 12 * P  # 16-bit parameters: mixed precision
    assert mem.weights + mem.grads + mem.optimizer == 16 * P
    assert OPTIMIZER_STEP_TRAFFIC_PER_PARAM == (2 + 4) + (4 + 4) + 4 + (4 * 4 + 3 * 4) + (4 + 2) == 52
    run = PAPER_RUNS[0]
    est = run.predict()
    hw = run.cluster().hardware
    assert est.t_optimizer == pytest.approx(P * 52 / (hw.hbm_bw * hw.eff.hbm), rel=1e-12)


def test_tensor_parallel_fills_a_node_or_whole_nodes():
    spec = get_model("gpt-76b")  # 80 heads: t = 16 divides them, t = 5 splits a node unevenly
    cluster = Cluster.of(1024, "dgx-a100-80gb", 1792)
    assert layout_errors(spec, cluster, Layout(t=16, p=2, d=32, b=2)) == []
    errs = layout_errors(spec, Cluster.of(960, "dgx-a100-80gb", 1920), Layout(t=5, p=4, d=48, b=2))
    assert any("t=5 must divide the 8 GPUs of a node or be a multiple of it" in e for e in errs)


# --------------------------------------------------------------- calibration


def test_calibration_rows_within_5_percent(show):
    """The paper's weak-scaling rows: predicted TFLOP/s per GPU at the paper's layout vs reported
    (``pytest -s`` prints the table of docs/performance-model.md, section 7)."""
    lines = [f"{'model':10} {'t':>2} {'p':>2} {'v':>2} {'GPUs':>5} {'B':>5} {'b':>3} "
             f"{'predicted':>9} {'reported':>8} {'error':>7}"]
    worst = 0.0
    for run in PAPER_RUNS:
        est = run.predict()
        err = est.tflops_per_gpu / run.tflops - 1
        worst = max(worst, abs(err))
        lines.append(f"{run.model:10} {run.t:2} {run.p:2} {run.v:2} {run.gpus:5} {run.batch:5} {run.micro:3} "
                     f"{est.tflops_per_gpu:9.1f} {run.tflops:8.0f} {err:+7.1%}")
    table = "\n".join(lines)
    show("\n" + table)
    for run in PAPER_RUNS:
        est = run.predict()
        assert abs(est.tflops_per_gpu / run.tflops - 1) < 0.05, table
    assert worst < 0.05


def test_throughput_is_flops_over_time_and_gpus():
    run = PAPER_RUNS[4]
    est = run.predict()
    assert est.flops == paper_flops(run.spec, run.batch, True)
    assert est.tflops_per_gpu == pytest.approx(est.flops / (est.t_iter * run.gpus) / 1e12)
    assert est.t_iter == pytest.approx(est.t_pipeline + est.t_dp_exposed + est.t_emb_sync + est.t_optimizer)
    assert sum(est.breakdown.values()) == pytest.approx(est.t_iter, rel=0.02)


def test_model_reacts_to_layout_in_the_right_direction():
    spec, cl = get_model("gpt-18b"), Cluster.of(256, "dgx-a100-80gb", 1024)
    t8 = estimate(spec, cl, Layout(t=8, p=1, d=32, b=8))
    t4 = estimate(spec, cl, Layout(t=4, p=2, d=32, b=8, v=2))
    assert t8.breakdown["tp_comm"] > 2 * t4.breakdown["tp_comm"]  # (t-1)/t and the same b s h
    full = estimate(spec, cl, Layout(t=8, p=1, d=32, b=1))
    none = estimate(spec, cl, Layout(t=8, p=1, d=32, b=1, recompute="none"))
    assert none.t_chunk_b < full.t_chunk_b and none.memory.activations > full.memory.activations
    sg = estimate(spec, cl, Layout(t=4, p=2, d=32, b=8, v=2))
    nosg = estimate(spec, cl, Layout(t=4, p=2, d=32, b=8, v=2, scatter_gather=False))
    assert nosg.t_p2p > 2 * sg.t_p2p


def test_explain_substitutes_the_formulas():
    run = PAPER_RUNS[5]
    est = run.predict()
    rows = {x.key: x for x in explain(est)}
    assert set(FORMULAS) <= set(rows)
    assert rows["F"].value == pytest.approx(paper_flops(run.spec, run.batch), rel=1e-12)
    assert rows["bubble"].value == pytest.approx((4 - 1) / (3 * 28))
    assert rows["m"].value == 28
    assert rows["X"].value == pytest.approx(est.tflops_per_gpu)
    assert rows["P"].value == pytest.approx(param_count(run.spec) - 2 * run.spec.hidden, rel=1e-12)
    assert "p - 1" in str(rows["bubble"].expr)
    assert math.isfinite(rows["bubble_sim"].value)


def test_default_constants_are_the_fit():
    """The two free constants are the least-squares fit on the paper's rows (a local search
    around the defaults, one grid step either way, returns the defaults)."""
    e = A100.eff
    g, hb, worst = fit_efficiency(gemm=(e.gemm - 0.02, e.gemm + 0.02, 0.01), hbm=(e.hbm - 0.02, e.hbm + 0.02, 0.01))
    assert (g, hb) == (pytest.approx(e.gemm), pytest.approx(e.hbm))
    assert worst < 0.05


def test_cost_module_re_exports_the_model():
    """``autopar.planning.cost`` keeps every public name of the model importable from one place,
    each the very object of the file that defines it."""
    import importlib

    homes = ("calibration", "step_estimate", "data_parallel_cost", "step_timelines", "formulas", "layout", "memory",
             "models", "network", "op_costs", "op_times", "ring_costs", "transformer")
    defined = {}
    for home in homes:
        mod = importlib.import_module(f"autopar.planning.cost.{home}")
        defined.update({name: getattr(mod, name) for name in mod.__all__})
    for name in cost.__all__:
        assert getattr(cost, name) is defined.get(name, getattr(cost, name)), name
    assert set(cost.__all__) - set(defined) == {"inflight_units"}  # the schedules' in_flight_bound
