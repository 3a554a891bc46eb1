"""Hardware profiles: the JSON ``autopar tune`` writes, read back as the planner's ``Hardware``.

Tier (a): the format's round trip, its refusals (version, missing field, a group size it lacks), the
alpha/beta fit on synthetic timings, and ``autopar plan --hardware PROFILE.json`` pricing by the
profile's numbers. Tier (c): ``autopar tune --nproc 2 --quick`` on real gloo ranks writes a valid
profile that the planner reads.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

from autopar.cli import main
from autopar.planning.cost.hardware import PROFILES
from autopar.planning.cost.hardware_profile import (
    VERSION_KEY,
    GemmFigure,
    HardwareProfile,
    LinkFigure,
    fit_alpha_beta,
    load_hardware,
    load_profile,
    resolve_hardware,
    to_hardware,
    write_profile,
)
from autopar.planning.cost.layout import Cluster, Layout
from autopar.planning.cost.models import ModelSpec, params_per_stage
from autopar.planning.cost.op_costs import gemm_op
from autopar.planning.cost.op_times import op_time
from autopar.planning.cost.precision import RUNTIME_FP32
from autopar.planning.cost.step_estimate import estimate
from autopar.planning.cost.tune_plan import model_gemm_shapes
from autopar.planning.errors import PlanError, ProfileCoverageError, ProfileFieldError, ProfileVersionError

ROOT = Path(__file__).resolve().parents[2]
MODEL_FLAGS = ["--layers", "2", "--hidden", "64", "--heads", "4", "--seq-len", "64", "--vocab", "256"]
SPEC = ModelSpec(layers=2, hidden=64, heads=4, seq_len=64, vocab=256, fused_attention=True, dropout=False,
                 tied_head=False, learned_positions=False)
"""The model ``MODEL_FLAGS`` describe (the command line's defaults for a model given by its dimensions)."""


def _profile(beta: float = 1e9, ranks: tuple[int, ...] = (2,), per_node: int = 2, ops=None) -> HardwareProfile:
    """A profile of made-up but plausible CPU figures: each collective alpha 100 us, bandwidth ``beta``."""
    ops = ops if ops is not None else ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "p2p")
    shapes = model_gemm_shapes(SPEC, 4, (1, 2))
    gemm = tuple(GemmFigure("fp32", name, *shape, flops_per_s=5e10 + 1e9 * i, seconds=1e-4)
                 for i, (name, shape) in enumerate(shapes))
    links = tuple(LinkFigure(op, 2 if op == "p2p" else n, "intra", 1e-4, beta, (4096, 1 << 20), (1e-4, 1e-3))
                  for op in ops for n in (ranks if op != "p2p" else (2,)))
    return HardwareProfile(device_kind="cpu", device_name="test CPU", devices_per_node=per_node, nodes=1,
                           memory_bytes=8 * 2**30, gemm=gemm, memory_bw=1e10, eager_op_s=2e-6, collectives=links,
                           sources={"gemm": "made up"}, tune_flags=" ".join(MODEL_FLAGS))


def test_round_trip_keeps_every_number(tmp_path):
    prof = _profile()
    path = tmp_path / "hw.json"
    write_profile(prof, path)
    assert json.loads(path.read_text())[VERSION_KEY] == 5
    assert load_profile(path) == prof
    hw = load_hardware(str(path))
    assert hw.name == str(path) and hw.tuned and hw.gpus_per_node == 2
    assert [g.flops for g in hw.gemms] == [g.flops_per_s for g in prof.gemm]
    # an fp32 profile halves bandwidths: the model counts 2-byte elements, the runs move 4
    assert hw.hbm_bw == prof.memory_bw / 2
    assert all(link.beta == 1e9 / 2 and link.alpha == 1e-4 for link in hw.links)
    # a GEMM of a measured shape costs its FLOPs at the measured rate, plus the eager per-op overhead
    name, shape = model_gemm_shapes(SPEC, 4, (1,))[2]
    rate = next(g.flops_per_s for g in prof.gemm if (g.batch, g.m, g.n, g.k) == shape)
    op = gemm_op(name, *shape)
    assert op_time(op, hw) == pytest.approx(op.flops / rate + 2e-6, rel=1e-12)


def test_a_preset_and_a_path_both_name_hardware(tmp_path):
    path = tmp_path / "hw.json"
    write_profile(_profile(), path)
    assert resolve_hardware("dgx-a100-80gb") is PROFILES["dgx-a100-80gb"] and not PROFILES["dgx-a100-80gb"].tuned
    assert resolve_hardware(str(path)) == load_hardware(str(path))
    assert Cluster.of(2, str(path), 8).hardware == load_hardware(str(path))  # what autopar.plan(hardware=...) uses
    with pytest.raises(PlanError, match="known: dgx-a100-80gb.*or the path of a JSON profile"):
        resolve_hardware("dgx-z900")


def test_another_version_is_refused_with_the_command_to_measure_again(tmp_path):
    data = _profile().as_json() | {VERSION_KEY: 1}
    path = tmp_path / "v1.json"
    path.write_text(json.dumps(data))
    with pytest.raises(ProfileVersionError, match=r"is version 1; this autopar reads version 5: measure again with "
                                                  r"`autopar tune --layers 2 --hidden 64"):
        load_profile(path)
    path.write_text(json.dumps({"gemm": []}))
    with pytest.raises(ProfileVersionError, match="not an autopar hardware profile"):
        load_profile(path)


def test_a_missing_field_is_named(tmp_path):
    data = _profile().as_json()
    del data["collectives"][3]["beta_bytes_per_s"]
    path = tmp_path / "broken.json"
    path.write_text(json.dumps(data))
    with pytest.raises(ProfileFieldError, match=r"collectives\[3\]\.beta_bytes_per_s is missing"):
        load_profile(path)
    data = _profile().as_json()
    data["device"]["per_node"] = "two"
    path.write_text(json.dumps(data))
    with pytest.raises(ProfileFieldError, match="device.per_node is 'two', not a int"):
        load_profile(path)


def test_a_group_size_the_profile_lacks_says_how_to_measure_it():
    lay = Layout(t=1, p=1, d=4, b=2, recompute="none")
    # one node of 4 devices, collectives timed over 2 ranks only: the 4-rank all-reduce is missing
    hw = to_hardware(_profile(per_node=4), name="hw.json")
    with pytest.raises(ProfileCoverageError, match=r"no all_reduce over 4 ranks inside one node.*measured "
                                                   r"all_reduce over: 2 ranks intra-node\); measure it on one node: "
                                                   r"`autopar tune --nproc 4 --layers 2"):
        estimate(SPEC, Cluster(4, hw, 8), lay)
    # a node of 2: a group of 4 crosses nodes, which one node could not measure
    hw = to_hardware(_profile(per_node=2), name="hw.json")
    with pytest.raises(ProfileCoverageError, match=r"no all_reduce over 4 ranks across nodes.*`torchrun --nnodes 2 "
                                                   r"--nproc-per-node 2 -m autopar.cli tune --layers 2"):
        estimate(SPEC, Cluster(4, hw, 8), lay)
    # a profile tuned in one process has no collective at all: a layout of 2 ranks is refused, 1 is priced
    hw = to_hardware(_profile(ops=()), name="hw.json")
    with pytest.raises(ProfileCoverageError, match=r"all_reduce over: none"):
        estimate(SPEC, Cluster(2, hw, 8), Layout(t=1, p=1, d=2, b=4, recompute="none"))
    assert estimate(SPEC, Cluster(1, hw, 8), Layout(t=1, p=1, d=1, b=8, recompute="none")).t_iter > 0


def test_alpha_beta_fit_recovers_known_values():
    sizes = [1 << e for e in range(12, 25, 2)]
    alpha, beta = 73e-6, 2.5e9
    fit = fit_alpha_beta(sizes, [alpha + s / beta for s in sizes])
    assert fit == pytest.approx((alpha, beta), rel=1e-9)
    # 2% multiplicative noise, alternating: still within a few percent of both (the fit weighs relative error)
    noisy = [(alpha + s / beta) * (1.02 if i % 2 else 0.98) for i, s in enumerate(sizes)]
    a, b = fit_alpha_beta(sizes, noisy)
    assert a == pytest.approx(alpha, rel=0.05) and b == pytest.approx(beta, rel=0.05)


def _plan_json(capsys, hardware: str) -> dict:
    code = main(["plan", *MODEL_FLAGS, "--gpus", "2", "--batch", "8", "--tp", "1", "--pp", "1", "--micro-batch",
                 "4", "--recompute", "none", "--json", "--hardware", hardware])
    assert code == 0
    return json.loads(capsys.readouterr().out)["ranked"][0]


def test_plan_prices_with_the_profile(tmp_path, capsys):
    """t=1 p=1 d=2: the gradient all-reduce is the profile's fit, alpha + bytes / beta, with the fp32
    profile's beta halved (2-byte counts): its time is alpha + 4 P / beta for the P parameters."""
    fast, slow = tmp_path / "fast.json", tmp_path / "slow.json"
    write_profile(_profile(beta=4e9), fast)
    write_profile(_profile(beta=1e9), slow)
    preset, f, s = (_plan_json(capsys, h) for h in ("dgx-a100-80gb", str(fast), str(slow)))
    P = params_per_stage(SPEC, 1, 1)[0]
    assert f["breakdown_s"]["dp"] == pytest.approx(1e-4 + 4 * P / 4e9, rel=1e-9)
    assert s["breakdown_s"]["dp"] == pytest.approx(1e-4 + 4 * P / 1e9, rel=1e-9)
    assert s["iteration_s"] - f["iteration_s"] == pytest.approx(4 * P * (1 / 1e9 - 1 / 4e9), rel=1e-9)
    assert preset["breakdown_s"]["dp"] < f["breakdown_s"]["dp"] / 10  # NVLink: far faster than the CPU link
    assert f["hardware"] == str(fast) and preset["hardware"] == "dgx-a100-80gb"


def test_hardware_flag_refuses_an_unknown_name(capsys):
    with pytest.raises(SystemExit):
        main(["plan", *MODEL_FLAGS, "--gpus", "2", "--batch", "8", "--hardware", "dgx-z900"])
    assert "neither a preset" in capsys.readouterr().err


def test_the_tune_names_the_plan_command_of_the_model_it_measured():
    from autopar.cli.tune import model_flags

    argv = ["tune", "--nproc", "2", "--quick", "--dtypes", "fp32", *MODEL_FLAGS, "--gated-mlp", "--out", "hw.json"]
    assert model_flags(argv) == " ".join([*MODEL_FLAGS, "--gated-mlp"])  # not --quick, --dtypes, --out
    flags = ["tune", "--hf-config=cfg", "--seq-len", "64", "--micro-batch", "2"]
    assert model_flags(flags) == "--hf-config=cfg --seq-len 64"
    assert model_flags(["tune", "--quick"]) == ""


def test_the_tune_writes_each_one_rank_figure_as_the_median_over_the_ranks():
    from autopar.cli.tune import median_of_ranks

    layer = dict(signature="h64", nodes=20, micro_batch=1, tp=1, sequence_parallel=False)
    gathered = [({"node_s": 2e-5, "layer_nodes": 20}, [layer | dict(seconds=1e-3, recompute_seconds=3.4e-3,
                                                                      split_seconds=2e-4)]),
                ({"node_s": 3e-5, "layer_nodes": 20}, [layer | dict(seconds=2e-3, recompute_seconds=1.6e-3,
                                                                      split_seconds=4e-4),
                                                       layer | dict(micro_batch=2, seconds=5e-3, recompute_seconds=0.0,
                                                                    split_seconds=0.0)]),
                ({"node_s": 2.2e-5, "layer_nodes": 20}, [layer | dict(seconds=1.5e-3, recompute_seconds=1.7e-3,
                                                                        split_seconds=3e-4)])]
    runtime, layers = median_of_ranks(gathered)
    assert runtime == {"node_s": 2.2e-5, "layer_nodes": 20}  # one rank's outlier outvoted
    assert layers == [layer | dict(seconds=1.5e-3, recompute_seconds=1.7e-3, split_seconds=3e-4),
                      layer | dict(micro_batch=2, seconds=5e-3, recompute_seconds=0.0, split_seconds=0.0)]


@pytest.mark.multiprocess
def test_tune_on_two_gloo_ranks_writes_a_profile_the_planner_reads(tmp_path, capsys):
    out = tmp_path / "tuned.json"
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    run = subprocess.run([sys.executable, "-m", "autopar.cli", "tune", "--nproc", "2", "--quick", "--dtypes", "fp32",
                          *MODEL_FLAGS, "--out", str(out)], capture_output=True, text=True, timeout=400, env=env,
                         cwd=tmp_path)
    assert run.returncode == 0, run.stderr[-3000:]
    assert "nearest preset" in run.stdout
    prof = load_profile(out)
    assert (prof.world, prof.devices_per_node, prof.device_kind) == (2, 2, "cpu")
    assert {(c.op, c.ranks, c.placement) for c in prof.collectives} == {
        (op, 2, "intra") for op in ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "p2p", "tp_all_reduce")}
    assert all(c.alpha_s >= 0 and c.beta_bytes_per_s > 0 and len(c.sizes_bytes) >= 3 for c in prof.collectives)
    # the GEMMs timed are the model's, at micro-batch 1 and t = 1 and 2 (the divisors of the 2 ranks on a node)
    assert [(g.batch, g.m, g.n, g.k) for g in prof.gemm] == [s for _, s in model_gemm_shapes(SPEC, 1, (1, 2))]
    assert all(g.flops_per_s > 0 for g in prof.gemm) and prof.memory_bw > 0 and prof.eager_op_s > 0
    assert prof.tune_flags.startswith("--quick --dtypes fp32 --layers 2")
    # the runtime's own overheads, measured on the engine: every figure there, the tiny GPT's layer of 20 nodes
    assert set(prof.runtime) == set(RUNTIME) and prof.runtime["node_s"] > 0 and prof.runtime["layer_nodes"] > 0
    assert prof.runtime["optimizer_per_param_s"] > 0 and prof.runtime["world_step_s"] >= 0
    # the model's own layer, timed on the engine: micro-batch 1 and 2, t = 1, and t = 2 with and without
    # sequence parallelism, named as the planner names the reference GPT of those dimensions. This layer
    # costs a fraction of a millisecond: on a loaded machine the difference of two depths' steps can come
    # out negative, and that configuration is left to the priced layer, so only the set's bounds are fixed
    got = {(x.micro_batch, x.tp, x.sequence_parallel) for x in prof.layers}
    assert got and got <= {(b, t, sp) for b in (1, 2) for t, sp in ((1, False), (2, False), (2, True))}
    assert all(x.seconds > 0 and x.nodes > 0 for x in prof.layers)
    assert all(x.recompute_seconds >= 0 and x.split_seconds >= 0 for x in prof.layers if x.tp == 1)
    # at t = 2 the steps themselves too (the cost model fits the layer to them): each depth, 4 microbatches
    assert all([n for n, _ in x.steps] == [2, 4] and x.microbatches == 4 and min(t for _, t in x.steps) > 0
               for x in prof.layers if x.tp == 2)
    assert all(not x.steps for x in prof.layers if x.tp == 1)
    # and its data-parallel side over the 2 ranks: the 2-layer reference GPT's parameters on each replica
    from autopar.reference.models import build

    (dp,) = prof.data_parallel
    gpt = build("gpt", vocab_size=256, seq_len=64, n_layer=2, n_head=4, d_model=64)
    assert dp.params == sum(p.numel() for p in gpt.parameters()) and dp.sync_seconds > 0
    # and its pipeline over the 2 ranks, each schedule at micro-batch 1: 6 more microbatches take longer
    (pipe,) = prof.pipeline
    assert pipe.micro_batch == 1 and min(pipe.one_f_one_b_seconds, pipe.interleaved_seconds, pipe.zb_h1_seconds,
                                         pipe.zbv_seconds) > 0
    assert {x.signature for x in prof.layers} == {"h64 a4 kv4 f256 s64 gelu fused-attn no-dropout causal"}
    plan = _plan_json(capsys, str(out))
    assert plan["hardware"] == str(out) and math.isfinite(plan["iteration_s"]) and plan["breakdown_s"]["dp"] > 0


RUNTIME = {"step_s": 3e-4, "action_s": 1.5e-4, "node_s": 2.5e-5, "checkpoint_s": 7e-4, "optimizer_per_param_s": 4e-9,
           "send_s": 4e-4, "split_node_s": 3e-5, "split_pipeline_s": 6e-4, "tp_collective_s": 9e-4, "world_step_s": 1.3e-3, "distopt_step_s": 8e-4,
           "layer_nodes": 20,
           "end_nodes": 12}
"""Made-up runtime overheads of the order ``autopar tune`` measures on this repository's CPU."""


def test_runtime_overheads_are_priced_where_the_runtime_pays_them(tmp_path):
    path = tmp_path / "hw.json"
    write_profile(dataclasses.replace(_profile(), runtime=RUNTIME), path)
    assert load_profile(path).runtime == RUNTIME
    with_rt = load_hardware(str(path))
    without = dataclasses.replace(with_rt, runtime=None)
    spec = dataclasses.replace(SPEC, graph_nodes=(3, 25, 10))
    for recompute in ("none", "layer"):
        lay = Layout(t=1, p=2, d=1, b=2, recompute=recompute, fused_kernels=False, precision=RUNTIME_FP32)
        a, b = estimate(spec, Cluster(2, with_rt, 8), lay), estimate(spec, Cluster(2, without, 8), lay)
        layers = a.chunk_layers
        rc = recompute == "layer"
        # each F: one action and its layers' nodes' forward share (a third); each B: an action, the nodes'
        # backward share, and with recomputation the forward again with one checkpointed region per layer
        f_nodes = layers * 25 * RUNTIME["node_s"] / 3
        assert a.t_chunk_f - b.t_chunk_f == pytest.approx(RUNTIME["action_s"] + f_nodes, rel=1e-9)
        assert a.t_chunk_b - b.t_chunk_b == pytest.approx(
            RUNTIME["action_s"] + 2 * f_nodes + rc * (f_nodes + layers * RUNTIME["checkpoint_s"]), rel=1e-9)
        assert a.t_head_f - b.t_head_f == pytest.approx(10 * RUNTIME["node_s"] / 3, rel=1e-9)
        # a step across ranks: a one-rank step's cost and a multi-rank step's own
        assert a.t_step == pytest.approx(RUNTIME["step_s"] + RUNTIME["world_step_s"]) and b.t_step == 0.0
        # a backward split into B and W: W's action and the split's cost per forward node of the chunk
        zb = dataclasses.replace(lay, schedule="zb-h1")
        za, zb_ = estimate(spec, Cluster(2, with_rt, 8), zb), estimate(spec, Cluster(2, without, 8), zb)
        assert (za.t_chunk_b - zb_.t_chunk_b) - (a.t_chunk_b - b.t_chunk_b) == pytest.approx(
            RUNTIME["action_s"] + RUNTIME["split_node_s"] * layers * 25, rel=1e-9)
        assert a.t_p2p - b.t_p2p == pytest.approx(RUNTIME["send_s"], rel=1e-9)  # each pipeline send
        # the optimizer: PyTorch's AdamW per parameter, measured, instead of the memory-bound 52 bytes
        owned = max(params_per_stage(spec, 1, 2))
        assert a.t_optimizer == pytest.approx(owned * RUNTIME["optimizer_per_param_s"], rel=1e-9)
    bad = dataclasses.replace(_profile(), runtime=RUNTIME | {"action_s": -1.0}).as_json()
    path.write_text(json.dumps(bad))
    with pytest.raises(ProfileFieldError, match="runtime.action_s must not be negative"):
        load_profile(path)


def test_tensor_parallel_all_reduce_is_priced_by_the_runtimes_own_when_measured():
    from autopar.planning.cost.network import tp_allreduce_time

    plain = to_hardware(_profile(beta=1e9))
    both = to_hardware(dataclasses.replace(_profile(beta=1e9), collectives=_profile(beta=1e9).collectives + (
        LinkFigure("tp_all_reduce", 2, "intra", 5e-4, 1e9, (4096, 1 << 20), (5e-4, 1e-3)),)))
    assert tp_allreduce_time(1 << 16, 2, plain) == pytest.approx(1e-4 + (1 << 16) / 5e8)
    assert tp_allreduce_time(1 << 16, 2, both) == pytest.approx(5e-4 + (1 << 16) / 5e8)
    # measured inside a step, the latency is the step's, the bandwidth the lone call's
    in_step = dataclasses.replace(both, runtime=load_hardware_runtime())
    assert tp_allreduce_time(1 << 16, 2, in_step) == pytest.approx(RUNTIME["tp_collective_s"] + (1 << 16) / 5e8)
    # and so is sequence parallelism's all-gather's (its own fit's bandwidth)
    from autopar.planning.cost.network import tp_half_time

    assert tp_half_time(1 << 16, 2, in_step) == pytest.approx(RUNTIME["tp_collective_s"] + (1 << 16) / 5e8)
    assert tp_half_time(1 << 16, 2, both) == pytest.approx(1e-4 + (1 << 16) / 5e8)


def load_hardware_runtime():
    """``RUNTIME`` as the planner's ``RuntimeOverheads``."""
    from autopar.planning.cost.hardware import RuntimeOverheads

    return RuntimeOverheads(**RUNTIME)
