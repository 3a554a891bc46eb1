"""The memory and time formulas of sequence parallelism and the distributed optimizer, without processes.

Korthikanti et al. 2022 (activations per layer, 16-bit, t tensor-parallel ranks):
``s b h (10 + 24/t + 5 a s/(h t))``, with sequence parallelism ``s b h (34 + 5 a s/h) / t``;
a recomputed layer keeps its input, ``2 s b h`` (``/t`` with sequence parallelism). The
distributed optimizer keeps 12/d bytes of optimizer state per parameter, its traffic (a
reduce-scatter and an all-gather) equals the all-reduce's and its step takes 1/d of the time.
"""

import dataclasses

import pytest
import torch

import autopar
from autopar.compiler.report import memory_per_rank
from autopar.planning.cost.activations import activation_bytes_per_layer, layer_kept_per_token
from autopar.planning.cost.hardware import get_hardware
from autopar.planning.cost.layout import Cluster, Layout, layout_errors
from autopar.planning.cost.memory import memory_per_gpu
from autopar.planning.cost.models import ModelSpec, get_model, params_per_stage
from autopar.planning.cost.op_times import layer_times
from autopar.planning.cost.precision import MIXED, RUNTIME_FP32
from autopar.planning.cost.step_estimate import estimate
from autopar.planning.search.planner import SearchSpace, candidate_layouts
from autopar.reference.models import build

SPEC = ModelSpec(layers=4, hidden=1024, heads=16, seq_len=512, vocab=1000)


@pytest.mark.parametrize("t", [1, 2, 4, 8])
def test_paper_activations_with_and_without_sequence_parallelism(t):
    s, b, h, a = 512, 2, 1024, 16
    assert activation_bytes_per_layer(SPEC, b, t) == s * b * h * (10 + 24 / t + 5 * a * s / (h * t))
    assert activation_bytes_per_layer(SPEC, b, t, sequence_parallel=True) == pytest.approx(
        s * b * h * (34 + 5 * a * s / h) / t, rel=1e-12)


def test_layer_bytes_follow_the_precision_and_the_attention_kernel():
    # fp32, no dropout, a fused attention: LN inputs 2h, QKV and fc1 inputs 2h, Q K V 3h, attention output h,
    # GeLU and fc2 inputs 2 x 4h (16h elements of 4 bytes), the norms' mean and 1/std (2 x 8 bytes) and the
    # fp32 log-sum-exp per head (4 a bytes): what autograd keeps per token on the CPU
    spec = dataclasses.replace(SPEC, dropout=False, fused_attention=True)
    replicated, split = layer_kept_per_token(spec, RUNTIME_FP32)
    assert replicated == 4 * 4 * 1024 + 16 and split == 4 * 12 * 1024 + 4 * 16
    # the paper's format: 10h replicated, 24h + 5 a s split (bytes per token)
    replicated, split = layer_kept_per_token(SPEC, MIXED)
    assert (replicated, split) == (10 * 1024, 24 * 1024 + 5 * 16 * 512)


def test_recomputed_layers_keep_their_input_split_by_sequence_parallelism():
    lay = Layout(t=4, p=1, d=1, b=2, recompute="layer")
    plain, sp = memory_per_gpu(SPEC, lay, m=1), memory_per_gpu(SPEC, dataclasses.replace(lay, sequence_parallel=True), m=1)
    ckpt = 2 * 512 * 2 * 1024  # 2 s b h, one layer's input in 16 bits
    layers = 4 * ckpt
    assert plain.kept - sp.kept == pytest.approx(layers - layers / 4 + (plain.kept - sp.kept - 0.75 * layers))
    assert plain.kept - sp.kept >= 0.75 * layers  # the four inputs shrink to a quarter (the head's inputs too)


def test_distributed_optimizer_state_is_twelve_bytes_over_d():
    for d in (2, 8):
        lay = Layout(t=2, p=1, d=d, b=1)
        P = params_per_stage(SPEC, 2, 1)[0]
        plain = memory_per_gpu(SPEC, lay, m=1)
        zero = memory_per_gpu(SPEC, dataclasses.replace(lay, distributed_optimizer=True), m=1)
        assert plain.optimizer == 12 * P and zero.optimizer == pytest.approx(12 * P / d)
        # the gradients stay (16-bit), plus the reduced fp32 gradient of this replica's 1/d range
        assert zero.grads == pytest.approx(2 * P + 4 * P / d) and zero.weights == plain.weights == 2 * P
        # fp32 weights (autopar's CPU runtime): Adam's moments alone, 8; sharded, the moments alone too,
        # 8/d (the parameters' own storage is the master: the runtime's masters_shared)
        fp32 = dataclasses.replace(lay, precision=RUNTIME_FP32)
        assert memory_per_gpu(SPEC, fp32, m=1).optimizer == 8 * P
        assert memory_per_gpu(SPEC, dataclasses.replace(fp32, distributed_optimizer=True), m=1).optimizer == \
            pytest.approx(8 * P / d)
    # no effect without data parallelism
    one = Layout(t=2, p=1, d=1, b=1)
    assert memory_per_gpu(SPEC, dataclasses.replace(one, distributed_optimizer=True), m=1) == memory_per_gpu(SPEC, one, m=1)


def test_distributed_optimizer_time_same_wire_bytes_step_over_d():
    spec, cl = get_model("gpt-1.7b"), Cluster.of(32, "dgx-a100-80gb", 512)
    lay = Layout(t=1, p=1, d=32, b=4)
    plain, zero = estimate(spec, cl, lay), estimate(spec, cl, dataclasses.replace(lay, distributed_optimizer=True))
    # reduce-scatter + all-gather of the same bytes = one ring all-reduce (wire and latency terms)
    assert zero.t_dp == pytest.approx(plain.t_dp, rel=1e-12)
    assert zero.t_optimizer == pytest.approx(plain.t_optimizer / 32, rel=1e-12)


def test_sequence_parallelism_keeps_the_wire_and_divides_the_elementwise_time():
    hw = get_hardware("dgx-a100-80gb")
    spec = get_model("gpt-18b")
    plain, sp = layer_times(spec, hw, 1, 8), layer_times(spec, hw, 1, 8, True)
    for phase in ("layer_f", "layer_b"):
        assert sp[phase].comm == pytest.approx(plain[phase].comm, rel=1e-12)
        assert sp[phase].gemm == plain[phase].gemm and sp[phase].memory < plain[phase].memory


def test_planner_tries_each_feature_only_where_it_matters():
    spec, cl = get_model("gpt-1.7b"), Cluster.of(16, "dgx-a100-80gb", 64)
    lays = list(candidate_layouts(spec, cl, SearchSpace(recompute=("layer",))))
    assert any(x.sp for x in lays) and any(x.distopt for x in lays)
    assert all(x.t > 1 for x in lays if x.sequence_parallel)
    assert all(x.d > 1 for x in lays if x.distributed_optimizer)
    plain = list(candidate_layouts(spec, cl, SearchSpace(recompute=("layer",), sequence_parallel=(False,),
                                                         distributed_optimizer=(False,))))
    assert len(lays) == sum((2 if x.t > 1 else 1) * (2 if x.d > 1 else 1) for x in plain)


def test_sequence_parallelism_needs_the_sequence_divisible_by_t():
    spec = ModelSpec(layers=4, hidden=1024, heads=16, seq_len=1020, vocab=1000)
    errs = layout_errors(spec, Cluster.of(8, "dgx-a100-80gb", 8), Layout(t=8, p=1, d=1, b=1, sequence_parallel=True))
    assert any("1020 tokens of a sequence over t=8" in e for e in errs)


def test_summary_memory_with_and_without_each_feature():
    torch.manual_seed(0)
    model = build("gpt", vocab_size=320, seq_len=32, n_layer=2, n_head=4, d_model=64)
    x = torch.zeros(2, 32, dtype=torch.long)
    program = autopar.parallelize(model, example_inputs=(x,), example_targets=x, tp=2, dp=2, world_size=4)
    (stage,) = memory_per_rank(program)
    assert stage["optimizer_distopt"] == 12 * stage["params"] / 2
    assert 0 < stage["activations_sp"] < stage["activations"]
    assert not stage["sequence_parallel"] and not stage["distributed_optimizer"]
    text = program.summary()
    assert "distopt" in text and "with SP" in text
