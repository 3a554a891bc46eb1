"""A tuned profile's measured layers and the runtime's own data-parallel costs, priced (tier a: no process
group): the layer of a matching model is scaled to its measurement, at the nearest micro-batch, and
only there; the gradient reduction's passes and exposure are the runtime's on a tuned profile and
Megatron's on a preset."""

from __future__ import annotations

import dataclasses
import json

import pytest

from autopar.planning.cost.hardware import (PROFILES, MeasuredDataParallel, MeasuredLayer, MeasuredPipeline,
                                            RuntimeOverheads)
from autopar.planning.cost.hardware_profile import (
    GemmFigure,
    HardwareProfile,
    LinkFigure,
    load_profile,
    to_hardware,
    write_profile,
)
from autopar.planning.cost.layout import Cluster, Layout
from autopar.planning.cost.models import ModelSpec, get_model, params_per_stage
from autopar.planning.cost.network import allreduce_time, dp_link
from autopar.planning.cost.op_times import _dense_layer, layer_scale, layer_times
from autopar.planning.cost.precision import RUNTIME_FP32
from autopar.planning.cost.data_parallel_cost import DDP_BUCKET_BYTES, GRAD_SYNC_PASSES_ALLREDUCE
from autopar.planning.cost.step_estimate import (estimate, fitted_layers, interleaved_send_extra,
                                                 split_pipeline_seconds)
from autopar.planning.cost.tune_plan import model_gemm_shapes
from autopar.planning.errors import ProfileFieldError

SPEC = ModelSpec(layers=4, hidden=64, heads=4, seq_len=32, vocab=256, fused_attention=True, dropout=False,
                 graph_nodes=(3, 20, 6))
RUNTIME = dict(step_s=3e-4, action_s=1e-4, node_s=2e-5, checkpoint_s=6e-4, optimizer_per_param_s=4e-9, send_s=5e-4, distopt_step_s=8e-4,
               split_node_s=3e-5, split_pipeline_s=6e-4, tp_collective_s=9e-4, world_step_s=1.2e-3, layer_nodes=20, end_nodes=6)


def _profile(layers: tuple[MeasuredLayer, ...] = (), runtime: dict | None = None) -> HardwareProfile:
    gemm = tuple(GemmFigure("fp32", name, *shape, flops_per_s=6e10, seconds=1e-4)
                 for name, shape in model_gemm_shapes(SPEC, 1, (1, 2)))
    links = tuple(LinkFigure(op, 2, "intra", 2e-4, 1e9, (4096, 1 << 20), (2e-4, 1e-3))
                  for op in ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "p2p"))
    return HardwareProfile(device_kind="cpu", device_name="CPU", devices_per_node=2, nodes=1, memory_bytes=8e9,
                           gemm=gemm, memory_bw=1.4e10, eager_op_s=1e-6, collectives=links,
                           runtime=runtime if runtime is not None else RUNTIME, layers=layers)


def _priced(b: int, t: int = 1, sp: bool = False) -> float:
    hw = to_hardware(_profile())
    f, bw = _dense_layer(SPEC, hw, b, t, sp, False, 1)
    return f.total + bw.total


def test_a_measured_layer_scales_the_priced_one_at_its_micro_batch_and_the_nearest():
    priced = _priced(2)
    measured = MeasuredLayer(SPEC.layer_signature, 20, micro_batch=2, tp=1, sequence_parallel=False,
                             seconds=1.5 * priced)
    hw = to_hardware(_profile((measured,)))
    plain = to_hardware(_profile())
    assert layer_scale(SPEC, hw, 2, 1) == pytest.approx(1.5)
    at2, before = layer_times(SPEC, hw, 2, 1, fused=False), layer_times(SPEC, plain, 2, 1, fused=False)
    assert at2["layer_f"].total + at2["layer_b"].total == pytest.approx(measured.seconds)
    assert at2["layer_f"].total / at2["layer_b"].total == pytest.approx(
        before["layer_f"].total / before["layer_b"].total)  # the split between forward and backward is the priced one
    assert at2["head_f"] == before["head_f"] and at2["emb_b"] == before["emb_b"]  # only the layer is measured
    # micro-batch 4 was not measured: the ratio at the nearest measured one (2) carries
    at4, before4 = layer_times(SPEC, hw, 4, 1, fused=False), layer_times(SPEC, plain, 4, 1, fused=False)
    assert at4["layer_b"].total == pytest.approx(1.5 * before4["layer_b"].total)
    # the estimate says what it did
    lay = Layout(t=1, p=2, d=1, b=2, recompute="none", fused_kernels=False, precision=RUNTIME_FP32)
    assert estimate(SPEC, Cluster(2, hw, 8), lay).layer_scale == pytest.approx(1.5)
    assert estimate(SPEC, Cluster(2, plain, 8), lay).layer_scale == 1.0


def test_a_layer_is_scaled_only_by_a_measurement_of_the_same_layer_and_layout():
    priced = _priced(1, 2)
    measured = MeasuredLayer(SPEC.layer_signature, 20, micro_batch=1, tp=2, sequence_parallel=False, seconds=2 * priced)
    hw = to_hardware(_profile((measured,)))
    assert layer_scale(SPEC, hw, 1, 2) == pytest.approx(2.0)
    assert layer_scale(SPEC, hw, 1, 1) == 1.0  # another t
    assert layer_scale(SPEC, hw, 1, 2, sequence_parallel=True) == 1.0  # sequence parallelism is measured apart
    assert layer_scale(SPEC, hw, 1, 2, fused=True) == 1.0  # compiled chunks: the eager measurement does not hold
    assert layer_scale(SPEC, hw, 1, 2, cp=2) == 1.0
    assert layer_scale(dataclasses.replace(SPEC, gated_mlp=True), hw, 1, 2) == 1.0  # another layer
    assert layer_scale(dataclasses.replace(SPEC, graph_nodes=(3, 35, 6)), hw, 1, 2) == 1.0  # same sizes, other code
    assert layer_scale(dataclasses.replace(SPEC, graph_nodes=None), hw, 1, 2) == pytest.approx(2.0)  # nodes unknown
    # the same model traced another way (on the meta device a constant or two folds): within 10% of 20
    # (the priced layer has 2 nodes' overhead less: the scale is a little above 2)
    assert layer_scale(dataclasses.replace(SPEC, graph_nodes=(3, 18, 6)), hw, 1, 2) == pytest.approx(2.0, rel=0.05)
    assert layer_scale(dataclasses.replace(SPEC, graph_nodes=(3, 17, 6)), hw, 1, 2) == 1.0
    assert layer_scale(SPEC, PROFILES["dgx-a100-80gb"], 1, 2) == 1.0  # a preset measures none


def test_recomputation_and_the_split_backward_are_priced_as_measured():
    priced = _priced(1)
    f_priced = _dense_layer(SPEC, to_hardware(_profile()), 1, 1, False, False, 1)[0].total
    measured = MeasuredLayer(SPEC.layer_signature, 20, micro_batch=1, tp=1, sequence_parallel=False, seconds=priced,
                             recompute_seconds=2e-3, split_seconds=4e-4)
    hw = to_hardware(_profile((measured,)))
    assert f_priced + RUNTIME["checkpoint_s"] != pytest.approx(2e-3)  # the measurement is not the price
    cluster = Cluster(2, hw, 8)
    base = Layout(t=1, p=2, d=1, b=1, recompute="none", fused_kernels=False, precision=RUNTIME_FP32)
    plain = estimate(SPEC, cluster, base)
    L = plain.chunk_layers
    # each recomputed layer adds its measured replay (its region's bookkeeping in it)
    rc = estimate(SPEC, cluster, dataclasses.replace(base, recompute="layer"))
    assert rc.t_chunk_b - plain.t_chunk_b == pytest.approx(L * 2e-3, rel=1e-9)
    # a split backward: W's action, each layer's measured split and the stage's own per-microbatch cost
    zb = estimate(SPEC, cluster, dataclasses.replace(base, schedule="zb-h1"))
    assert zb.t_chunk_b - plain.t_chunk_b == pytest.approx(
        RUNTIME["action_s"] + L * 4e-4 + RUNTIME["split_pipeline_s"], rel=1e-9)


def _train_step(hw, depth: int, b: int = 1, microbatches: int = 4) -> float:
    """The priced ``train_step`` of the model at ``depth`` on 2 tensor-parallel ranks, one stage."""
    lay = Layout(t=2, p=1, d=1, b=b, schedule="1f1b", recompute="none", fused_kernels=False, precision=RUNTIME_FP32)
    est = estimate(dataclasses.replace(SPEC, layers=depth), Cluster(2, hw, b * microbatches), lay)
    return est.t_pipeline + est.t_step


def test_a_layer_at_t_2_is_priced_to_match_the_steps_the_tune_measured():
    """The layer's seconds come from the steps themselves (least squares over the depths, the rest of each
    step priced), not from their difference: a planted layer of 7 ms is found from steps made with it, whatever
    the difference said."""
    truth = MeasuredLayer(SPEC.layer_signature, 20, micro_batch=1, tp=2, sequence_parallel=False, seconds=7e-3)
    steps = tuple((n, _train_step(to_hardware(_profile((truth,))), n)) for n in (2, 4))
    assert steps[1][1] - steps[0][1] == pytest.approx(2 * 4 * 7e-3)  # each of the 4 microbatches: 2 more layers
    measured = dataclasses.replace(truth, seconds=5e-3, steps=steps, microbatches=4)  # the difference said 5 ms
    hw = to_hardware(_profile((measured,)))
    fitted = fitted_layers(SPEC, hw, RUNTIME_FP32)
    assert fitted.layers[0].seconds == pytest.approx(7e-3, rel=1e-9) and not fitted.layers[0].steps
    assert _train_step(hw, 4) == pytest.approx(steps[1][1], rel=1e-9)  # the measured step, priced as measured
    from autopar.cli.plan import measured_note

    lay = Layout(t=2, p=1, d=1, b=1, recompute="none", fused_kernels=False, precision=RUNTIME_FP32)
    assert "(fitted to the steps measured at t=2)" in measured_note(SPEC, hw, estimate(SPEC, Cluster(2, hw, 4), lay))
    # steps that do not lie on a line: the least-squares layer, 8 and 16 layer passes weighed by their count
    off = tuple((n, t + (2e-3 if n == 2 else -2e-3)) for n, t in steps)
    hw_off = to_hardware(_profile((dataclasses.replace(measured, steps=off),)))
    assert fitted_layers(SPEC, hw_off, RUNTIME_FP32).layers[0].seconds == pytest.approx(
        7e-3 + (8 * 2e-3 - 16 * 2e-3) / (8 ** 2 + 16 ** 2), rel=1e-9)
    # without steps (t = 1, an older tune's entries), or of another model's layer: the seconds as measured
    assert fitted_layers(SPEC, to_hardware(_profile((truth,))), RUNTIME_FP32).layers[0].seconds == 7e-3
    other = dataclasses.replace(SPEC, gated_mlp=True)
    assert fitted_layers(other, hw, RUNTIME_FP32).layers[0].seconds == 5e-3


def test_measured_layers_round_trip_and_are_checked(tmp_path):
    layers = (MeasuredLayer("h64 a4 kv4 f256 s32 gelu fused-attn no-dropout causal", 20, 1, 2, True, 4.5e-3,
                            steps=[[2, 0.09], [4, 0.15]], microbatches=4),)
    assert layers[0].steps == ((2, 0.09), (4, 0.15))  # hashable, as the cost model's caches need
    path = tmp_path / "hw.json"
    write_profile(_profile(layers), path)
    assert load_profile(path).layers == layers
    data = json.loads(path.read_text())
    data["layers"][0]["steps"] = [[2, 0.09], [4, -1.0]]
    path.write_text(json.dumps(data))
    with pytest.raises(ProfileFieldError,
                       match=r"layers\[0\]\.steps holds \[4, -1\.0\], not a \[layers, seconds\] pair"):
        load_profile(path)
    data["layers"][0] |= {"steps": [[2, 0.09], [4, 0.15]], "microbatches": 0}
    path.write_text(json.dumps(data))
    with pytest.raises(ProfileFieldError, match=r"layers\[0\]\.microbatches is 0, but layers\[0\]\.steps holds"):
        load_profile(path)
    data["layers"][0]["microbatches"] = 4
    data["layers"][0]["sequence_parallel"] = "yes"
    path.write_text(json.dumps(data))
    with pytest.raises(ProfileFieldError, match=r"layers\[0\]\.sequence_parallel is 'yes', not a bool"):
        load_profile(path)
    data["layers"][0] |= {"sequence_parallel": True, "seconds": 0.0}
    path.write_text(json.dumps(data))
    with pytest.raises(ProfileFieldError, match=r"layers\[0\]\.seconds must be positive"):
        load_profile(path)


def test_the_runtimes_gradient_reduction_is_priced_as_it_runs():
    hw = to_hardware(_profile())
    lay = Layout(t=1, p=1, d=2, b=1, recompute="none", fused_kernels=False, dp_overlap=True, precision=RUNTIME_FP32)
    est = estimate(SPEC, Cluster(2, hw, 8), lay)
    P = max(params_per_stage(SPEC, 1, 1))
    counted = 4 * hw.byte_scale * P  # fp32 gradients, as the fp32 profile counts bytes (its bandwidths halved)
    assert hw.byte_scale == 0.5
    # one chunk: its buckets start after its last backward, so none of the all-reduce hides; the runtime's
    # own passes (flatten, average, copy back) run on the step's thread
    passes = GRAD_SYNC_PASSES_ALLREDUCE * counted / hw.hbm_bw
    assert est.t_dp_exposed == pytest.approx(est.t_dp + passes, rel=1e-9)
    # the distributed optimizer: the same gradient bytes reduce-scattered, the parameters all-gathered
    sharded = estimate(SPEC, Cluster(2, hw, 8), dataclasses.replace(lay, distributed_optimizer=True))
    assert sharded.t_dp_exposed == pytest.approx(sharded.t_dp + (2 + 2 / 2) * counted / hw.hbm_bw, rel=1e-9)
    # a preset prices Megatron's overlap (each bucket as its gradients are final), no runtime passes: all
    # but the last 25 MB bucket hides behind the last backward
    gpt = get_model("gpt-1.7b")
    megatron = estimate(gpt, Cluster(32, PROFILES["dgx-a100-80gb"], 512), Layout(t=1, p=1, d=32, b=4, dp_overlap=True))
    assert megatron.t_dp_exposed == pytest.approx(max(megatron.t_dp - megatron.t_chunk_b, allreduce_time(
        DDP_BUCKET_BYTES, 32, *dp_link(PROFILES["dgx-a100-80gb"], 1, 32))), rel=1e-9)
    assert megatron.t_dp_exposed < megatron.t_dp


def test_a_multi_rank_step_costs_its_own_collectives():
    hw = to_hardware(_profile())
    one = Layout(t=1, p=1, d=1, b=1, recompute="none", fused_kernels=False, precision=RUNTIME_FP32)
    two = dataclasses.replace(one, p=2)
    assert estimate(SPEC, Cluster(1, hw, 8), one).t_step == pytest.approx(RUNTIME["step_s"])
    assert estimate(SPEC, Cluster(2, hw, 8), two).t_step == pytest.approx(RUNTIME["step_s"] + RUNTIME["world_step_s"])
    assert RuntimeOverheads(**RUNTIME).world_step_s == RUNTIME["world_step_s"]


def test_the_models_data_parallel_side_scales_the_priced_reduction_and_distributed_optimizer(tmp_path):
    lay = Layout(t=1, p=1, d=2, b=1, recompute="none", fused_kernels=False, dp_overlap=True, precision=RUNTIME_FP32)
    plain_hw = to_hardware(_profile())
    ref_plain = estimate(SPEC, Cluster(2, plain_hw, 8), lay)
    ref_do = estimate(SPEC, Cluster(2, plain_hw, 8), dataclasses.replace(lay, distributed_optimizer=True))
    P = max(params_per_stage(SPEC, 1, 1))
    # measured on a model of these very parameters: the reduction 1.5x its price, the distributed optimizer's
    # step (reduce-scatter, inner step, all-gather) 2x
    measured = MeasuredDataParallel(SPEC.layer_signature, 20, params=P, sync_seconds=1.5 * ref_plain.t_dp_exposed,
                                    optimizer_seconds=ref_plain.t_optimizer,
                                    distopt_seconds=2 * (ref_do.t_dp_exposed + ref_do.t_optimizer))
    hw = to_hardware(dataclasses.replace(_profile(), data_parallel=(measured,)))
    plain = estimate(SPEC, Cluster(2, hw, 8), lay)
    assert plain.data_parallel_scale == pytest.approx(1.5)
    assert plain.t_dp_exposed == pytest.approx(1.5 * ref_plain.t_dp_exposed)
    assert plain.t_optimizer == pytest.approx(ref_plain.t_optimizer)  # AdamW is priced as measured already
    do = estimate(SPEC, Cluster(2, hw, 8), dataclasses.replace(lay, distributed_optimizer=True))
    assert do.data_parallel_scale == pytest.approx(2.0)
    assert do.t_dp_exposed + do.t_optimizer == pytest.approx(2 * (ref_do.t_dp_exposed + ref_do.t_optimizer))
    # another model, one replica, or no runtime figures: priced as before
    other = dataclasses.replace(SPEC, hidden=128)
    assert estimate(other, Cluster(2, hw, 8), lay).data_parallel_scale == 1.0
    assert estimate(SPEC, Cluster(2, hw, 8), dataclasses.replace(lay, d=1, p=2)).data_parallel_scale == 1.0
    write_profile(dataclasses.replace(_profile(), data_parallel=(measured,)), tmp_path / "hw.json")
    assert load_profile(tmp_path / "hw.json").data_parallel == (measured,)



def _microbatch(hw, schedule: str, v: int, b: int = 1) -> float:
    """What a microbatch adds to the priced step of SPEC at 4 layers over 2 stages (as the tune measures it)."""
    spec = dataclasses.replace(SPEC, layers=4)

    def step(m: int) -> float:
        lay = Layout(t=1, p=2, d=1, b=b, v=v, schedule=schedule, recompute="none", fused_kernels=False,
                     precision=RUNTIME_FP32)
        return estimate(spec, Cluster(2, hw, m * b), lay, simulate=True).t_iter
    return (step(8) - step(2)) / 6


def test_the_models_pipeline_prices_its_schedules_exchange(tmp_path):
    layers = (MeasuredLayer(SPEC.layer_signature, 20, 1, 1, False, seconds=_priced(1), split_seconds=2e-4),)
    base = dataclasses.replace(_profile(layers), runtime=RUNTIME | {"split_pipeline_s": 0.0})
    plain = to_hardware(base)
    # a pipeline measured as the cost model would price it with each interleaved send 0.8 ms dearer and a
    # split backward's pipeline part 0.5 ms a chunk (ZB-H1) and 0.3 ms (ZB-V)
    dearer = to_hardware(dataclasses.replace(base, runtime=RUNTIME | {"send_s": RUNTIME["send_s"] + 8e-4}))
    measured = MeasuredPipeline(
        SPEC.layer_signature, 20, micro_batch=1, one_f_one_b_seconds=_microbatch(plain, "1f1b", 1),
        interleaved_seconds=_microbatch(dearer, "interleaved", 2),
        zb_h1_seconds=_microbatch(to_hardware(dataclasses.replace(base, runtime=RUNTIME | {"split_pipeline_s": 5e-4})),
                                  "zb-h1", 1),
        zbv_seconds=_microbatch(to_hardware(dataclasses.replace(base, runtime=RUNTIME | {"split_pipeline_s": 3e-4})),
                                "zbv", 2))
    hw = to_hardware(dataclasses.replace(_profile(layers), pipeline=(measured,)))  # its own split_pipeline_s: 6e-4
    one = Layout(t=1, p=2, d=1, b=1, recompute="none", fused_kernels=False, precision=RUNTIME_FP32)
    interleaved = dataclasses.replace(one, v=2, schedule="interleaved")
    assert interleaved_send_extra(SPEC, hw, interleaved) == pytest.approx(8e-4, rel=1e-6)
    assert split_pipeline_seconds(SPEC, hw, dataclasses.replace(one, schedule="zb-h1")) == pytest.approx(5e-4, rel=1e-6)
    zbv = dataclasses.replace(one, v=2, schedule="zbv")
    assert split_pipeline_seconds(SPEC, hw, zbv) == pytest.approx(3e-4, rel=1e-6)
    # priced into the layouts: each interleaved send, at the nearest measured micro-batch too
    send = estimate(SPEC, Cluster(2, plain, 8), one).t_p2p
    est = estimate(SPEC, Cluster(2, hw, 8), interleaved)
    assert est.t_p2p == pytest.approx(send + 8e-4, rel=1e-6)
    b2 = dataclasses.replace(interleaved, b=2)
    assert estimate(SPEC, Cluster(2, hw, 8), b2).t_p2p == pytest.approx(
        estimate(SPEC, Cluster(2, plain, 8), b2).t_p2p + 8e-4, rel=1e-6)
    from autopar.cli.plan import measured_note

    assert "each interleaved send +800 us beyond a 1F1B send's" in measured_note(SPEC, hw, est)
    assert measured_note(SPEC, hw, estimate(SPEC, Cluster(2, hw, 8), zbv)).endswith(
        "a split backward's pipeline part 300 us a chunk")
    # 1F1B, another model, a profile without the measurement: as before
    assert estimate(SPEC, Cluster(2, hw, 8), one).t_p2p == pytest.approx(send)
    other = dataclasses.replace(SPEC, hidden=128)
    assert interleaved_send_extra(other, hw, interleaved) == 0.0
    assert split_pipeline_seconds(other, hw, zbv) == RUNTIME["split_pipeline_s"]
    assert split_pipeline_seconds(SPEC, to_hardware(_profile(layers)), zbv) == RUNTIME["split_pipeline_s"]
    write_profile(dataclasses.replace(_profile(), pipeline=(measured,)), tmp_path / "hw.json")
    assert load_profile(tmp_path / "hw.json").pipeline == (measured,)
    data = json.loads((tmp_path / "hw.json").read_text())
    data["pipeline"][0]["zbv_seconds"] = -1.0
    (tmp_path / "hw.json").write_text(json.dumps(data))
    with pytest.raises(ProfileFieldError, match=r"pipeline\[0\]\.zbv_seconds must be positive"):
        load_profile(tmp_path / "hw.json")


def test_the_plan_says_what_of_the_models_measurements_priced_it():
    from autopar.cli.plan import measured_note

    priced = _priced(2)
    measured = MeasuredLayer(SPEC.layer_signature, 20, micro_batch=2, tp=1, sequence_parallel=False, seconds=1.25 * priced)
    hw = to_hardware(_profile((measured,)))
    lay = Layout(t=1, p=2, d=1, b=2, recompute="none", fused_kernels=False, precision=RUNTIME_FP32)
    est = estimate(SPEC, Cluster(2, hw, 8), lay)
    assert measured_note(SPEC, hw, est) == ("priced with this model's own measurements from `autopar tune` "
                                            "(measured over priced from the kernels): its layer x1.25")
    other = dataclasses.replace(SPEC, hidden=128)
    note = measured_note(other, hw, estimate(other, Cluster(2, hw, 8), lay))
    assert note.startswith(f"the profile measured the layer of {SPEC.layer_signature}, not this model's "
                           f"({other.layer_signature}, 20 graph nodes)")
    # this model's layer, but not as the layout runs it: each reason named, with what prices it instead
    fused = measured_note(SPEC, hw, estimate(SPEC, Cluster(2, hw, 8), dataclasses.replace(lay, fused_kernels=True)))
    assert "fused kernels" in fused and "--kernels op-by-op" in fused
    at2 = measured_note(SPEC, hw, estimate(SPEC, Cluster(2, hw, 8), dataclasses.replace(lay, t=2, p=1)))
    assert "measured it at t=1, not at t=2" in at2 and "autopar tune --nproc 2" in at2
    assert measured_note(SPEC, to_hardware(_profile()), est) == ""


def test_a_plan_prices_the_eager_chunks_where_the_profile_measured_the_models_layer_on_them():
    from autopar.cli.arguments import build_parser
    from autopar.cli.layout_args import search_space

    measured = MeasuredLayer(SPEC.layer_signature, 20, micro_batch=1, tp=1, sequence_parallel=False,
                             seconds=_priced(1))
    hw, plain = to_hardware(_profile((measured,))), to_hardware(_profile())
    args = build_parser().parse_args(["plan", "--layers", "4", "--hidden", "64", "--heads", "4", "--gpus", "2",
                                      "--batch", "8"])
    assert search_space(args, SPEC, hw).fused_kernels is False  # the measured kernels
    assert search_space(args, SPEC, plain).fused_kernels is True  # nothing measured: Megatron's fused kernels
    assert search_space(args, dataclasses.replace(SPEC, hidden=128), hw).fused_kernels is True  # another model's
    args.kernels = "fused"
    assert search_space(args, SPEC, hw).fused_kernels is True  # the flag decides when given


def test_recomputation_at_t_carries_the_ratio_measured_at_t_1():
    from autopar.planning.cost.op_times import _replay, measured_recompute
    from autopar.planning.cost.transformer import layer_ops, replay_ops

    hw0 = to_hardware(_profile())
    region = RUNTIME["checkpoint_s"]
    f1 = _replay(SPEC, hw0, 1, 1, False, False, 1).total + region
    layers = (MeasuredLayer(SPEC.layer_signature, 20, 1, 1, False, seconds=_priced(1), recompute_seconds=1.3 * f1),
              MeasuredLayer(SPEC.layer_signature, 20, 1, 2, False, seconds=1.4 * _priced(1, 2)),
              MeasuredLayer(SPEC.layer_signature, 20, 1, 2, True, seconds=1.2 * _priced(1, 2, True)))
    hw = to_hardware(_profile(layers))
    assert measured_recompute(SPEC, hw, 1, 1).total == pytest.approx(1.3 * f1)
    # at t = 2 the replay keeps t = 1's measured over priced relative to the layer's there (1.3 / 1) and takes
    # the layer's own at t = 2; it replays one reduction a layer, the MLP's left out by the checkpoint's early
    # stop, and under sequence parallelism no all-gather (the replay's stands in for the backward's re-gather)
    assert layer_scale(SPEC, hw, 1, 1) == pytest.approx(1.0)
    for sp, k in ((False, 1.4), (True, 1.2)):
        assert [op.kind for op in replay_ops(SPEC, 1, 2, sp) if op.kind.startswith("tp_")] == [
            "tp_reduce_scatter" if sp else "tp_allreduce"]
        here = _replay(SPEC, hw0, 1, 2, sp, False, 1)
        assert here.comm > 0 and layer_scale(SPEC, hw, 1, 2, sp) == pytest.approx(k)
        assert measured_recompute(SPEC, hw, 1, 2, sp).total == pytest.approx(1.3 * k * (here.total + region))
        assert measured_recompute(SPEC, hw, 1, 2, sp).comm == pytest.approx(1.3 * k * here.comm)
    # the replay is the forward less its tail: the MLP's reduction and the residual add after it
    forward = [op.name for op in layer_ops(SPEC, 1, 2).forward]
    assert [op.name for op in replay_ops(SPEC, 1, 2)] == forward[:-2]
    assert measured_recompute(SPEC, hw0, 1, 2) is None


def test_the_tune_measures_the_layer_of_a_model_it_can_build_at_each_degree_the_heads_allow():
    from autopar.cli.arguments import build_parser
    from autopar.cli.tune_layers import layer_runs, model_builder, spec_of

    # t = 4 divides the 4 ranks and the 8 heads but not the 2 key/value heads
    assert layer_runs(1, 8, 2, 4) == [(1, 1, False), (2, 1, False), (1, 2, False), (1, 2, True), (2, 2, False),
                                      (2, 2, True)]
    parse = lambda *flags: build_parser().parse_args(["tune", *flags])  # noqa: E731
    assert model_builder(parse("--model", "gpt-1.7b")) is None  # a preset of the paper: nothing to build
    assert model_builder(parse("--layers", "2", "--hidden", "32", "--heads", "4", "--experts", "4")) is None
    make, seq, vocab = model_builder(parse("--layers", "8", "--hidden", "32", "--heads", "4", "--kv-heads", "2",
                                           "--gated-mlp", "--seq-len", "16", "--vocab", "64"))
    assert (seq, vocab) == (16, 64)
    spec = spec_of(make, seq)  # the reference Llama of those dimensions, at 2 layers
    assert (spec.layers, spec.hidden, spec.heads, spec.kv, spec.gated_mlp) == (2, 32, 4, 2, True)


class _CountingEngine:
    """An engine whose step sleeps ``step_s`` and counts itself."""

    def __init__(self, step_s: float):
        self.step_s, self.steps = step_s, 0

    def train_step(self, x, y):
        import time

        time.sleep(self.step_s)
        self.steps += 1


def _steps_on_a_rank_with_its_own_budget() -> int:
    import torch.distributed as dist

    from autopar.cli.tune_layers import _all_agree, _alternate

    engine = _CountingEngine(0.002)
    budget_s = 0.0 if dist.get_rank() == 0 else 0.3  # rank 0's clock says stop at once, rank 1's goes on
    _alternate({"e": (engine, None)}, budget_s, sync=dist.barrier, agree=_all_agree)
    dist.barrier()
    return engine.steps


@pytest.mark.multiprocess
def test_forked_tune_ranks_stop_on_the_same_round_whatever_their_clocks_say():
    import autopar

    # before the ranks agreed, rank 0 returned after its 6 rounds and rank 1 waited in a barrier for it
    steps = autopar.spawn(_steps_on_a_rank_with_its_own_budget, 2, timeout_s=60)
    assert steps == [3 + 6 * 2, 3 + 6 * 2]  # 3 warm-up steps, then the 6 rounds of 2 both ranks take
