"""Recomputation and mixed precision on 4 gloo ranks (tp=2 x pp=2), against the plain run.

- Recompute 'layer' and 'chunk' give the same losses and gradients as no
  recompute (the replayed forward runs the same ops in the same order: equal
  to rounding), and the activation bytes kept between forward and backward,
  measured by the engine's saved-tensor hooks, drop.
- bf16 autocast matches single-device bf16 autocast within bf16 rounding:
  the split matmuls round differently, so losses within 2e-2 relative and
  gradients within 5e-2 relative norm (bf16 has 8 mantissa bits, ~4e-3).
"""

import pytest
import torch
from families import BATCH, FAMILIES, batches, make
from helpers import parallelize_on, reference_run, spawn_ranks

from autopar.reference.parity import FP32_TOLERANCE, assert_parity

pytestmark = pytest.mark.multiprocess
LR, M, LAYERS = 1e-3, 4, 4


def _feature_data(fam):
    return batches(FAMILIES[fam][1], rows=BATCH * M)


def _feature_program(fam, recompute, precision):
    model, _ = make(fam, layers=LAYERS)
    return parallelize_on(model, _feature_data(fam), BATCH, tp=2, pp=2, microbatches=M, world_size=4,
                          recompute=recompute, precision=precision)


def _train_feature_run(fam, recompute, precision, trace_path=None):
    program = _feature_program(fam, recompute, precision)  # inherited from the test process
    data = _feature_data(fam)
    engine = program.materialize()
    opt = torch.optim.AdamW(engine.parameters(), lr=LR)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 1.0 / (step + 1))
    losses, grads, peaks = [], [], []
    for inputs, targets in data:
        losses.append(engine.train_step(*inputs, *targets))
        grads.append(engine.full_grads())
        peaks.append(engine.stats["peak_activation_bytes"])
        opt.step()
        sched.step()
        opt.zero_grad()
    if trace_path is not None:
        engine.write_trace(trace_path)
    return losses, grads, max(peaks)


RUNS = [("nanogpt", r, "fp32") for r in ("none", "layer", "chunk")] + [("llama", "layer", "fp32"),
                                                                     ("llama", "none", "fp32"),
                                                                     ("nanogpt", "none", "bf16")]


def _train_every_feature_run(trace_path):
    return {run: _train_feature_run(*run, trace_path=trace_path if i == 0 else None) for i, run in enumerate(RUNS)}


@pytest.fixture(scope="module")
def trace_file(tmp_path_factory):
    return str(tmp_path_factory.mktemp("trace") / "step.json")


@pytest.fixture(scope="module")
def feature_runs(trace_file):
    for run in RUNS:  # compile once here: the ranks inherit the programs
        _feature_program(*run)
    return spawn_ranks(_train_every_feature_run, 4, trace_file)


def test_measured_timeline_is_a_chrome_trace_of_every_action(feature_runs, trace_file):
    import json

    events = json.load(open(trace_file))["traceEvents"]
    spans = [e for e in events if e["ph"] == "X"]
    assert {e["pid"] for e in spans} == {0, 1, 2, 3}
    for rank in range(4):
        mine = [e for e in spans if e["pid"] == rank]
        computed = sorted(e["name"] for e in mine if e["cat"] in ("F", "B"))
        stage = rank // 2  # tp=2 x pp=2: ranks 0, 1 on stage 0
        assert computed == sorted([f"F{stage}.{i}" for i in range(M)] + [f"B{stage}.{i}" for i in range(M)])
        starts = [e["ts"] for e in mine]
        assert starts == sorted(starts) and all(e["dur"] >= 0 for e in mine)


def test_recompute_same_losses_and_less_activation_memory(feature_runs):
    for fam, modes in (("nanogpt", ("layer", "chunk")), ("llama", ("layer",))):
        for rank, res in enumerate(feature_runs):
            base_losses, base_grads, base_peak = res[(fam, "none", "fp32")]
            for mode in modes:
                losses, grads, peak = res[(fam, mode, "fp32")]
                for step in range(3):
                    assert_parity(base_losses[: step + 1], base_grads[step], losses[: step + 1], grads[step],
                                  label=f"{fam} recompute={mode} rank {rank} step {step}", **FP32_TOLERANCE)
                assert peak < 0.6 * base_peak, (fam, mode, rank, peak, base_peak)


def test_bf16_autocast_matches_single_device_bf16(feature_runs):
    model, vocab = make("nanogpt", layers=LAYERS)
    ref_losses, ref_grads = reference_run(model, batches(vocab, rows=BATCH * M), lr=LR, precision="bf16")
    for rank, res in enumerate(feature_runs):
        losses, grads, _ = res[("nanogpt", "none", "bf16")]
        assert_parity(ref_losses[:1], ref_grads[0], losses[:1], grads[0], rtol=2e-2, atol=1e-3,
                      rel_norm=5e-2, label=f"bf16 rank {rank}")
        assert all(g.dtype == torch.float32 for g in grads[0].values())  # fp32 gradients
