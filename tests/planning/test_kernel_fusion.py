"""The cost model's two kernel forms: fused element-wise kernels (Megatron's; compiled chunks) and op by op.

A compiled chunk (``compile=True``) fuses the element-wise ops between the GEMMs
as Megatron's hand-written kernels do; an eager chunk runs each op as its own
pass, reading its input and writing its output through memory. The planner
prices the form the program will run (``SearchSpace.fused_kernels``, ``autopar
plan --kernels``) and says which it assumed.
"""

from dataclasses import replace

import pytest

from autopar.planning.cost.hardware import get_hardware
from autopar.planning.cost.layout import Cluster, Layout
from autopar.planning.cost.models import get_model
from autopar.planning.cost.step_estimate import estimate
from autopar.planning.cost.transformer import layer_ops
from autopar.planning.search.planner import SearchSpace, search


def _memory(ops):
    return [o for o in ops if o.kind == "memory"]


@pytest.mark.parametrize("model,t", [("gpt-39b", 8), ("gpt-1.7b", 1)])
def test_op_by_op_splits_each_fused_kernel_into_its_passes(model, t):
    spec = get_model(model)
    fused, eager = layer_ops(spec, 2, t), layer_ops(spec, 2, t, fused=False)
    for phase in ("forward", "backward"):
        f, e = getattr(fused, phase), getattr(eager, phase)
        assert [o for o in f if o.kind != "memory"] == [o for o in e if o.kind != "memory"]  # GEMMs, collectives
        fm, em = _memory(f), _memory(e)
        # softmax 3 passes, two bias+dropout+add 3 each, bias+GeLU 2 (backward: 3, 2, 2 and 2)
        assert len(em) - len(fm) == (2 + 2 * 2 + 1 if phase == "forward" else 2 + 2 * 1 + 1)
        assert sum(o.bytes for o in em) > 1.3 * sum(o.bytes for o in fm)
    names = [o.name for o in eager.forward]
    assert names.index("scale") < names.index("mask_fill") < names.index("softmax")
    assert names.index("bias_add1") < names.index("dropout1") < names.index("residual_add1")


def test_an_eager_layout_is_slower_and_the_plan_says_which_it_assumed():
    spec, hw = get_model("gpt-18b"), get_hardware("dgx-a100-80gb")
    cluster = Cluster(256, hw, 1024)
    lay = Layout(t=8, p=2, d=16, b=2, v=2, schedule="interleaved")
    fused, eager = estimate(spec, cluster, lay), estimate(spec, cluster, replace(lay, fused_kernels=False))
    assert eager.t_iter > fused.t_iter
    space = SearchSpace(t=(8,), p=(2,), b=(2,), schedules=("interleaved",), recompute=("layer",),
                        sequence_parallel=(False,), distributed_optimizer=(False,))
    for fused_kernels, said in ((True, "kernels: fused between the GEMMs"), (False, "kernels: op by op")):
        plan = search(spec, cluster, replace(space, fused_kernels=fused_kernels), top=3)
        assert all(e.layout.fused_kernels is fused_kernels for e in plan.ranked)
        assert plan.notes()[0].startswith(said)
