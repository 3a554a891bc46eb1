"""``program.summary(hardware=...)``: a compiled program priced as the planner prices its layout (tier a:
no process group)."""

from __future__ import annotations

import pytest
import torch

import autopar
from autopar.compiler.model_spec import spec_from_model
from autopar.compiler.predicted_cost import program_estimate, program_layout
from autopar.core.errors import AutoparError
from autopar.planning.cost.layout import Cluster, Layout
from autopar.planning.cost.precision import RUNTIME_BF16, RUNTIME_FP32
from autopar.planning.cost.step_estimate import estimate
from autopar.planning.quantities import seconds
from autopar.reference.models import build


def _gpt():
    torch.manual_seed(0)
    return build("gpt", vocab_size=256, seq_len=32, n_layer=4, n_head=4, d_model=64)


X = torch.randint(0, 256, (2, 32))


def test_the_program_is_priced_at_the_layout_it_was_compiled_for():
    prog = autopar.parallelize(_gpt(), tp=2, pp=2, dp=2, world_size=8, virtual_stages=2, schedule="interleaved",
                               microbatches=4, example_inputs=(X,), example_targets=X, recompute="none",
                               sequence_parallel=True)
    lay = program_layout(prog, distributed_optimizer=True)
    assert lay == Layout(t=2, p=2, d=2, b=2, v=2, schedule="interleaved", recompute="none", dp_overlap=True,
                         sequence_parallel=True, distributed_optimizer=True, fused_kernels=False,
                         expert_dispatch=lay.expert_dispatch, precision=RUNTIME_FP32)  # no ep: either
    est, errors = program_estimate(prog, "dgx-a100-80gb", distributed_optimizer=True)
    want = estimate(spec_from_model(_gpt(), (X,), X), Cluster.of(8, "dgx-a100-80gb", 2 * 4 * 2), lay, simulate=True)
    assert est.t_iter == pytest.approx(want.t_iter) and est.memory.total == pytest.approx(want.memory.total)
    assert errors == []
    text = prog.summary(hardware="dgx-a100-80gb", distributed_optimizer=True)
    assert "predicted on 8 x A100-SXM4-80GB (dgx-a100-80gb):" in text
    assert f"  {lay.short}, global batch 16 = 2 x 4 microbatches x 2 replicas" in text and "distopt" in lay.short
    assert f"  step {seconds(est.t_iter)}," in text
    assert "predicted on" not in prog.summary()  # priced only when asked


def test_bf16_and_compiled_chunks_are_priced_as_they_run_and_an_unpriced_recomputation_is_refused():
    prog = autopar.parallelize(_gpt(), pp=2, world_size=2, microbatches=2, example_inputs=(X,), example_targets=X,
                               precision="bf16", compile=True)
    lay = program_layout(prog)
    assert lay.precision == RUNTIME_BF16 and lay.fused_kernels and (lay.t, lay.p, lay.d) == (1, 2, 1)
    chunked = autopar.parallelize(_gpt(), pp=2, world_size=2, microbatches=2, example_inputs=(X,), example_targets=X,
                                  recompute="chunk")
    with pytest.raises(AutoparError, match="recomputes 'chunk'.*compile with recompute='layer' or 'none'"):
        chunked.summary(hardware="dgx-a100-80gb")
