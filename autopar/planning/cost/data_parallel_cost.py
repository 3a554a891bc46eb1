"""The data-parallel side of a step estimate: the gradient reduction over the replicas (an all-reduce, or
with the distributed optimizer a reduce-scatter and an all-gather of the parameters), the part of it the
backward does not hide, and the optimizer step.

A preset prices Megatron-LM's and DDP's overlap (each bucket launched once its gradients are final); a
tuned profile prices autopar's runtime (a chunk's buckets after its last backward, its own passes over
the gradients) and scales the reduction to the model's data-parallel side ``autopar tune`` measured
(``data_parallel_scale``). With expert parallelism the routed experts' gradients go over their own d/ep
replicas; under context parallelism the group is the d cp ranks holding the same parameters.
``step_estimate.estimate`` adds these to the pipeline's time.
"""

from __future__ import annotations

from autopar.core.collectives import ALL_GATHER, ALL_REDUCE, REDUCE_SCATTER
from autopar.planning.cost.hardware import Hardware
from autopar.planning.cost.layout import Layout
from autopar.planning.cost.models import ModelSpec
from autopar.planning.cost.network import allgather_time, allreduce_time, dp_link, reduce_scatter_time
from autopar.planning.cost.op_costs import FP16
from autopar.planning.cost.op_times import measures_layer_of

__all__ = ["OPTIMIZER_STEP_TRAFFIC_PER_PARAM", "DDP_BUCKET_BYTES", "GRAD_SYNC_PASSES_ALLREDUCE", "optimizer_time",
           "data_parallel_scale", "dp_allreduce", "dp_sharded"]

OPTIMIZER_STEP_TRAFFIC_PER_PARAM = 52
"""HBM bytes the optimizer step moves per local parameter: its time, not its memory (the
optimizer's *state* is ``core.config.optimizer_bytes_per_param``, 12 bytes in mixed
precision). Megatron's mixed-precision Adam step, kernel by kernel:

- fp16 gradient -> fp32 copy: read 2 + write 4 = 6
- unscale and inf/nan check of the fp32 gradient: read 4 + write 4 = 8
- gradient norm (for clipping): read 4 = 4
- fused Adam: read the fp32 gradient, master weight, m and v (16), write the master
  weight, m and v (12) = 28
- fp32 master weight -> fp16 weight: read 4 + write 2 = 6

6 + 8 + 4 + 28 + 6 = 52. The step is memory-bound: its time is
``P * 52 / (achieved HBM bandwidth)``."""

DDP_BUCKET_BYTES = 25e6
"""PyTorch DDP's bucket: with overlap, at least the last bucket's all-reduce is exposed."""


def optimizer_time(hw: Hardware, owned: float) -> float:
    """The optimizer step over ``owned`` local parameters: PyTorch's AdamW as measured per parameter
    (a tuned profile's ``RuntimeOverheads.optimizer_per_param_s``), else memory-bound at
    ``OPTIMIZER_STEP_TRAFFIC_PER_PARAM`` bytes each (Megatron's mixed-precision Adam)."""
    if hw.runtime is not None:
        return owned * hw.runtime.optimizer_per_param_s
    return owned * OPTIMIZER_STEP_TRAFFIC_PER_PARAM / (hw.hbm_bw * hw.eff.hbm)



def _edp_link(hw: Hardware, lay: Layout, kind: str = ALL_REDUCE) -> tuple[float, float]:
    """(bytes/s, latency) of the ring over the d/ep replicas holding the same experts: t ep ranks
    apart, so a node holds G / (t ep) of them (``dp_link`` with t ep), for a ``kind`` collective."""
    return dp_link(hw, lay.t * lay.ep, lay.edp, kind)



GRAD_SYNC_PASSES_ALLREDUCE = 6
"""Passes over a bucket's gradients the runtime makes on its own thread around an all-reduce
(``runtime/optim/gradient_sync.py``), each a read and a write: the flattening into the bucket (``torch.cat``),
the averaging (``/= d``) and the copy back into each ``.grad``."""


def _grad_sync_passes(hw: Hardware, nbytes: float, lay: Layout) -> float:
    """Seconds of the runtime's own passes over ``nbytes`` of gradients around their data-parallel
    reduction (a tuned profile: its memory bandwidth; 0 on a preset, whose runs reduce in place). An
    all-reduce: ``GRAD_SYNC_PASSES_ALLREDUCE`` reads and writes; a reduce-scatter into the distributed
    optimizer's buffers: the flattening (a read and a write) and the averaging of the rank's 1/d."""
    if hw.runtime is None or lay.dcp == 1:
        return 0.0
    passes = 2 + 2 / lay.dcp if lay.distopt else GRAD_SYNC_PASSES_ALLREDUCE
    return passes * nbytes / (hw.hbm_bw * hw.eff.hbm)


def _counted(nbytes: int, hw: Hardware) -> float:
    """Bytes of an element of ``nbytes`` as the cost model counts them on ``hw``: the real bytes on a preset;
    on a profile priced in fp32 (``Hardware.byte_scale``) half of them, and never less than the cost
    model's 2-byte unit (a tensor on an fp32 profile is fp32, whatever the layout's precision)."""
    return max(nbytes * hw.byte_scale, FP16)


def data_parallel_scale(spec: ModelSpec, hw: Hardware, lay: Layout) -> float:
    """What the priced gradient reduction (and the distributed optimizer's step with it) is multiplied by
    to match the model's data-parallel side ``autopar tune`` measured (``Hardware.data_parallel``: the
    same layer signature and node count where known): measured over priced for the measured model (2
    replicas, one chunk, its parameters); 1 without a measurement, at d = 1, or under expert or context
    parallelism (not what was measured)."""
    if lay.dcp == 1 or lay.ep > 1 or lay.cp > 1 or not hw.data_parallel or hw.runtime is None:
        return 1.0
    found = [x for x in hw.data_parallel if measures_layer_of(x.signature, x.nodes, spec)]
    if not found:
        return 1.0
    x = found[0]
    ref = Layout(t=1, p=1, d=2, b=lay.b, v=1, recompute="none", dp_overlap=True, distributed_optimizer=lay.distopt,
                 fused_kernels=lay.fused_kernels, precision=lay.precision)
    if lay.distopt:
        priced = (dp_sharded(hw, ref, x.params, 0.0)[1] + optimizer_time(hw, x.params / 2)
                  + hw.runtime.distopt_step_s)
        return x.distopt_seconds / priced
    return x.sync_seconds / dp_allreduce(hw, ref, x.params, 0.0)[1]


def dp_allreduce(hw: Hardware, lay: Layout, P_max: int, t_B: float, P_exp: int = 0) -> tuple[float, float]:
    """(the fullest stage's gradient all-reduce over d (d cp under context parallelism: the ranks
    holding the same parameters), the part of it not hidden behind the backward: ``_dp_hidden``; with
    the runtime's own passes over the gradients on a tuned profile, ``_grad_sync_passes``).

    With expert parallelism (ep > 1) its ``P_exp`` routed-expert parameters are all-reduced over
    their own d/ep replicas (``_edp_link``), after the dense ones' all-reduce over d (the same
    NICs); with ep = 1 they are dense parameters like the others."""
    d = lay.dcp
    bw, lat = dp_link(hw, lay.t, d)
    dense = P_max - P_exp if lay.ep > 1 else P_max
    grad = _counted(lay.precision.grad, hw)
    t_dp = allreduce_time(grad * dense, d, bw, lat)
    if lay.ep > 1:
        t_dp += allreduce_time(grad * P_exp, lay.edp, *_edp_link(hw, lay))
    passes = _grad_sync_passes(hw, grad * P_max, lay)  # on the step's own thread: never hidden
    if lay.dp_overlap and d > 1:
        last = allreduce_time(min(DDP_BUCKET_BYTES, grad * P_max), d, bw, lat)
        return t_dp, _dp_exposed(hw, lay, t_dp, t_B, last) + passes
    return t_dp, t_dp + passes


def _dp_exposed(hw: Hardware, lay: Layout, t_dp: float, t_B: float, last: float) -> float:
    """What a data-parallel reduction of ``t_dp`` seconds, overlapped with the backward, leaves exposed.

    DDP and Megatron-LM (the presets' runs) launch each bucket once its gradients are final, during the
    last microbatch's backward: the v chunks' last backwards (``t_B`` each) hide all but the last
    bucket's (``last``). autopar's runtime (a tuned profile, which measured it) launches a chunk's buckets
    after that chunk's last backward: only the backwards of the stage's other chunks that follow it hide
    them, (v - 1) t_B, and at least the last chunk's share, t_dp / v, is left exposed."""
    if hw.runtime is not None:
        return max(t_dp - (lay.v - 1) * t_B, t_dp / lay.v)
    return max(t_dp - lay.v * t_B, last)


def dp_sharded(hw: Hardware, lay: Layout, P_max: int, t_B: float, P_exp: int = 0) -> tuple[float, float]:
    """The distributed optimizer's data-parallel traffic: (whole, exposed) seconds.

    The gradients are reduce-scattered (each replica receives the sum of its 1/d range) and,
    after the step, the updated parameters all-gathered: the all-reduce's two halves, the same
    bytes on the wire. The reduce-scatter overlaps the backward as the all-reduce does (bucket by
    bucket, as soon as a chunk's gradients are final); the all-gather follows the step and
    is exposed. With ep > 1 the ``P_exp`` routed-expert parameters go over their d/ep replicas; under
    context parallelism the group is the d cp ranks holding the same parameters."""
    d = lay.dcp
    grad, weight = _counted(lay.precision.grad, hw), _counted(lay.precision.weight, hw)
    rs_link, ag_link = dp_link(hw, lay.t, d, REDUCE_SCATTER), dp_link(hw, lay.t, d, ALL_GATHER)
    dense = P_max - P_exp if lay.ep > 1 else P_max
    t_rs = reduce_scatter_time(grad * dense, d, *rs_link)
    t_ag = allgather_time(weight * dense, d, *ag_link)
    if lay.ep > 1:
        t_rs += reduce_scatter_time(grad * P_exp, lay.edp, *_edp_link(hw, lay, REDUCE_SCATTER))
        t_ag += allgather_time(weight * P_exp, lay.edp, *_edp_link(hw, lay, ALL_GATHER))
    passes = _grad_sync_passes(hw, grad * P_max, lay)  # on the step's own thread: never hidden
    if lay.dp_overlap:
        last = reduce_scatter_time(min(DDP_BUCKET_BYTES, grad * P_max), d, *rs_link)
        return t_rs + t_ag, _dp_exposed(hw, lay, t_rs, t_B, last) + t_ag + passes
    return t_rs + t_ag, t_rs + t_ag + passes
