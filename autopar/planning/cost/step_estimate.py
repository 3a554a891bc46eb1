"""The step estimate: one iteration of a layout, its time, throughput and memory.

``estimate(spec, cluster, layout)`` combines the per-chunk forward, backward
and recompute times (``op_times.py``), the tensor-parallel all-reduces, the
pipeline sends (scatter/gather), the pipeline and its bubble (closed form, or
the schedule simulator through ``pipeline_timeline.py``), the data-parallel gradient
all-reduce (with the distributed optimizer: a reduce-scatter of the gradients and
an all-gather of the parameters; ``data_parallel_cost.py``), the tied-embedding sync and the optimizer
step (1/d of it with the distributed optimizer) into an iteration time, TFLOP/s per GPU (counted as the
paper counts) and memory per GPU (``memory.py``). A mixture-of-experts model's expert layers are priced
as such (``transformer._Experts``: their row exchange over the expert group is ``ep_comm``) and its
routed experts' gradients are all-reduced over the d/ep replicas holding the same experts. The
zero-bubble schedules (ZB-H1, ZB-V) split each chunk's backward into B and W and have their own idle
time (``zero_bubble_costs.py``). Where ``autopar tune`` measured the model's own pipeline, each
schedule's sends or split backward are priced to match it (``measured_pipeline_figure``); where it
measured the model's steps at t > 1, the layer is priced to match them (``fitted_layers``).

Context parallelism (``Layout.cp``): every chunk's work is on s/cp tokens per sequence, the ring
attention's transfers it does not hide are ``cp_comm`` (``op_times.phase_time``), a pipeline send
carries s/cp tokens (from a stage's rank to the same cp rank of the next stage, t cp d ranks
away), and the gradients are reduced (or reduce-scattered and all-gathered) over the d cp ranks
holding the same parameters, ranks t apart (``network.dp_link(hw, t, d cp)``). The FLOPs counted
for throughput are the model's, independent of cp.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from functools import lru_cache

from autopar.core.config import SPLIT_BACKWARD_SCHEDULES, Recompute
from autopar.planning.cost.hardware import (PIPELINE_LAYERS, PIPELINE_MICROBATCHES, Hardware, MeasuredLayer,
                                            MeasuredPipeline)
from autopar.planning.cost.layout import Cluster, Layout, layout_errors, runtime_errors
from autopar.planning.cost.memory import Memory, memory_per_gpu
from autopar.planning.cost.models import (
    ModelSpec,
    expert_params_per_stage,
    max_moe_layers_per_chunk,
    params_per_stage,
)
from autopar.planning.cost.data_parallel_cost import data_parallel_scale, dp_allreduce, dp_sharded, optimizer_time
from autopar.planning.cost.network import (
    allreduce_time,
    embedding_link,
    p2p_time,
    stage_link,
    tp_half_time,
)
from autopar.planning.cost.op_costs import FP16
from autopar.planning.cost.op_times import (PhaseTime, layer_scale, layer_times, measured_recompute, measured_split,
                                           measures_layer_of)
from autopar.planning.cost.pipeline_timeline import eager_timeline
from autopar.planning.cost.transformer import iteration_flops
from autopar.planning.cost.zero_bubble_costs import weight_grad_times, zero_bubble_idle
from autopar.planning.errors import PlanError
from autopar.schedules import SimResult
from autopar.schedules.chunk_placement import placement_of, stage_of_chunk

__all__ = ["Estimate", "estimate", "interleaved_send_extra", "split_pipeline_seconds", "measured_pipeline_figure",
           "fitted_layers", "MEASURED_SCHEDULES", "SIMULATION_LIMIT"]

SIMULATION_LIMIT = 60_000
"""Most F/B actions (2 p v m) ``estimate(simulate=True)`` runs through the schedule
simulator (about a second); bigger pipelines keep the closed form."""


@dataclass(frozen=True)
class Estimate:
    """Predicted iteration of one layout: times in seconds, memory in bytes."""

    spec: ModelSpec
    cluster: Cluster
    layout: Layout
    m: int
    """Microbatches per pipeline per step, B / (d b)."""
    chunk_layers: int
    """Layers in the largest model chunk."""
    t_chunk_f: float
    """Forward of one chunk for one microbatch (incl. its tensor-parallel all-reduces)."""
    t_chunk_b: float
    """Backward of one chunk for one microbatch, incl. recomputation."""
    t_head_f: float
    t_head_b: float
    t_emb_f: float
    t_emb_b: float
    t_p2p: float
    """One stage-to-stage send (scatter/gather included), blocking as in Megatron."""
    t_pipeline: float
    """Forward/backward of all microbatches through the pipeline, bubble included."""
    bubble: float
    """Bubble fraction: idle time / busy time of a stage; (p-1)/(v m) for uniform chunks."""
    t_dp: float
    """Data-parallel gradient all-reduce, whole (with the distributed optimizer: the gradients'
    reduce-scatter and the parameters' all-gather together, the same bytes)."""
    t_dp_exposed: float
    """The part of it not hidden behind the backward (the all-gather after the step is all exposed)."""
    t_emb_sync: float
    """All-reduce of the tied word-embedding gradient between the first and last stage."""
    t_optimizer: float
    """Optimizer step (memory-bound)."""
    breakdown: dict[str, float]
    """Critical-path seconds by cause: gemm, memory, tp_comm, ep_comm, cp_comm, runtime (the runtime's own
    overheads in the actions), imbalance, p2p, bubble, dp, optimizer, runtime_step."""
    memory: Memory
    flops: float
    """FLOPs of one iteration as the paper counts them."""
    sim: SimResult | None = field(default=None, repr=False, compare=False)
    """The simulated step when ``t_pipeline`` and ``bubble`` come from the schedule
    simulator (and memory from the schedule's real in-flight peak), else None."""
    t_chunk_w: float = 0.0
    """The weight-gradient part (W) of ``t_chunk_b``: its weight GEMMs (zero-bubble schedules run
    it as a separate action; the rest, recomputation included, is their B)."""
    t_head_w: float = 0.0
    """The W part of ``t_head_b`` (the LM head's weight gradient)."""
    t_step: float = 0.0
    """The runtime's own cost of a step beside its actions (``RuntimeOverheads.step_s``, and
    ``world_step_s`` across ranks); 0 on a preset."""
    data_parallel_scale: float = 1.0
    """What the priced gradient reduction (and distributed optimizer) was multiplied by to match the model's
    data-parallel side ``autopar tune`` measured (``data_parallel_cost.data_parallel_scale``); 1 when not measured."""
    layer_scale: float = 1.0
    """What the priced layer was multiplied by to match the layer ``autopar tune`` measured for this
    model (``op_times.layer_scale``); 1 when the profile has none for it."""
    runtime_errors: tuple[str, ...] = ()
    """The schedule's rules the layout breaks (``layout.runtime_errors``): priced with the closed
    form, but autopar's runtime (and Megatron-LM) cannot run it as it is. Empty when runnable."""

    @property
    def runnable(self) -> bool:
        return not self.runtime_errors

    @property
    def simulated(self) -> bool:
        return self.sim is not None

    @property
    def t_iter(self) -> float:
        return self.t_pipeline + self.t_dp_exposed + self.t_emb_sync + self.t_optimizer + self.t_step

    @property
    def tflops_per_gpu(self) -> float:
        return self.flops / (self.t_iter * self.cluster.gpus) / 1e12

    @property
    def frac_peak(self) -> float:
        return self.tflops_per_gpu * 1e12 / self.cluster.hardware.peak_flops

    @property
    def fits(self) -> bool:
        return self.memory.total <= self.cluster.hardware.usable_bytes

    @property
    def comm_time(self) -> float:
        """Exposed communication per iteration: TP all-reduces, expert-parallel exchanges, the
        context-parallel ring's exposed part, p2p, DP, embedding sync."""
        b = self.breakdown
        return b["tp_comm"] + b.get("ep_comm", 0.0) + b.get("cp_comm", 0.0) + b["p2p"] + b["dp"]

    def as_dict(self) -> dict:
        lay = self.layout
        return {
            "model": self.spec.label, "gpus": self.cluster.gpus, "hardware": self.cluster.hardware.name,
            "global_batch": self.cluster.global_batch,
            "t": lay.t, "p": lay.p, "d": lay.d, "v": lay.v, "b": lay.b, "m": self.m,
            "schedule": lay.schedule, "recompute": str(lay.recompute), "scatter_gather": lay.scatter_gather,
            "dp_overlap": lay.dp_overlap, "sequence_parallel": lay.sp, "distributed_optimizer": lay.distopt,
            "ep": lay.ep, "expert_dispatch": lay.expert_dispatch if lay.ep > 1 else None, "cp": lay.cp,
            "iteration_s": self.t_iter, "tflops_per_gpu": self.tflops_per_gpu, "frac_peak": self.frac_peak,
            "bubble": self.bubble, "comm_s": self.comm_time, "memory_gib": self.memory.total / 2**30,
            "fits": self.fits, "runnable": self.runnable, "runtime_errors": list(self.runtime_errors),
            "breakdown_s": dict(self.breakdown), "simulated": self.simulated,
            "layer_scale": self.layer_scale, "data_parallel_scale": self.data_parallel_scale,
            "memory_breakdown_gib": {k: getattr(self.memory, k) / 2**30
                                     for k in ("weights", "grads", "optimizer", "buffers", "activations")},
        }


def estimate(spec: ModelSpec, cluster: Cluster, lay: Layout, simulate: bool = False,
             divisible_layers: bool = True, runnable: bool = True) -> Estimate:
    """Predict one iteration of ``lay``.

    Closed form (``simulate=False``), with per-chunk forward t_F and backward
    t_B (recompute included) and a blocking send c per compute action:
        T_pipe = (m v + p - 1) (t_F + t_B + 2c) + m max(head, embedding)
    i.e. ideal m v (t_F + t_B) plus the bubble (p-1)/(v m). The zero-bubble
    schedules replace the (p-1)(t_F + t_B + 2c) by their idle time
    (``zero_bubble_costs.zero_bubble_idle``: exact or an upper bound), and ZB-V
    pays head + embedding (both on stage 0) instead of their max. With
    ``simulate=True`` the real schedule runs through the schedule simulator
    (``autopar.planning.cost.pipeline_timeline``) with the same per-chunk costs instead, unless it has
    more than ``SIMULATION_LIMIT`` actions (then ``Estimate.simulated`` is False).
    Then T_iter = T_pipe + exposed DP all-reduce + tied-embedding sync + optimizer.
    With ``runnable=False`` a layout that breaks only the schedule's rules (interleaved with
    m not a multiple of p, say) is priced too, with the closed form, and marked
    (``Estimate.runtime_errors``).
    """
    errs = layout_errors(spec, cluster, lay, divisible_layers, runnable)
    if errs:
        raise PlanError(f"invalid layout {lay.short} for {spec.label} on {cluster.gpus} GPUs:\n  - "
                        + "\n  - ".join(errs))
    hw = fitted_layers(spec, cluster.hardware, lay.precision)
    unrunnable = tuple(runtime_errors(cluster, lay, spec))
    simulate = simulate and not unrunnable  # the schedule cannot be generated
    m = cluster.global_batch // (lay.d * lay.b)
    chunk = _Chunk.of(spec, hw, lay)
    c = _send_time(spec, hw, lay)
    t_pipe, bubble, sim = _pipeline(lay, m, chunk, c, simulate)
    P_max, P_exp = _fullest_stage_params(spec, lay)
    t_dp, t_dp_exposed = (dp_sharded if lay.distopt else dp_allreduce)(hw, lay, P_max, chunk.t_B, P_exp)
    t_emb = _embedding_sync(spec, hw, lay)
    # the distributed optimizer steps 1/(d cp) of the dense parameters, 1/(d/ep) of the experts'
    owned = (P_max - P_exp) / lay.dcp + P_exp / lay.edp if lay.distopt else P_max
    t_opt = optimizer_time(hw, owned)
    if lay.distopt and lay.dcp > 1 and hw.runtime is not None:  # the distributed optimizer's own step
        t_opt += hw.runtime.distopt_step_s
    k_dp = data_parallel_scale(spec, hw, lay)  # the model's own, measured by autopar tune
    t_dp, t_dp_exposed = t_dp * k_dp, t_dp_exposed * k_dp
    if lay.distopt and lay.dcp > 1:
        t_opt *= k_dp
    t_step = _runtime_step(hw, lay)
    breakdown = _breakdown(chunk, lay, m, c, t_pipe, t_dp_exposed + t_emb, t_opt) | {"runtime_step": t_step}
    peaks = sim.peak_in_flight if sim is not None else None  # a property that walks every stage's list
    inflight = [peaks[r] for r in range(lay.p)] if peaks is not None else None
    return Estimate(
        spec=spec, cluster=cluster, layout=lay, m=m, chunk_layers=chunk.layers,
        t_chunk_f=chunk.t_F, t_chunk_b=chunk.t_B, t_chunk_w=chunk.t_W, t_head_w=chunk.head_w,
        t_head_f=chunk.head_f, t_head_b=chunk.head_b,
        t_emb_f=chunk.emb_f, t_emb_b=chunk.emb_b, t_p2p=c, t_pipeline=t_pipe, bubble=bubble, t_dp=t_dp,
        t_dp_exposed=t_dp_exposed, t_emb_sync=t_emb, t_optimizer=t_opt, t_step=t_step, breakdown=breakdown,
        memory=memory_per_gpu(spec, lay, m, inflight),
        flops=iteration_flops(spec, cluster.global_batch, lay.recompute is Recompute.LAYER),
        sim=sim, runtime_errors=unrunnable,
        layer_scale=layer_scale(spec, hw, lay.b, lay.t, lay.sp, lay.fused_kernels, lay.cp), data_parallel_scale=k_dp,
    )


@dataclass(frozen=True)
class _Chunk:
    """One microbatch through one model chunk (the largest), and the work the embedding
    (first chunk) and the LM head (last chunk) add to it."""

    layers: int
    forward: PhaseTime
    backward: PhaseTime
    """Recomputation included."""
    weight: PhaseTime
    """The weight-gradient GEMMs of ``backward`` (a zero-bubble schedule's W; recomputation is B's)."""
    times: dict[str, PhaseTime]
    """One layer's, the embedding's and the head's phases (``op_times.layer_times``), and the
    head's W part (``head_w``)."""
    ends_share_stage: bool = False
    """The embedding and the head run on one stage (ZB-V's V puts the first and last chunk on stage 0)."""

    @classmethod
    def of(cls, spec: ModelSpec, hw: Hardware, lay: Layout) -> _Chunk:
        """The largest chunk: ceil(l / (p v)) layers, of which (a mixture-of-experts model) the most
        expert layers any chunk holds, each priced as such (recomputation repeats its exchange)."""
        L = math.ceil(spec.layers / (lay.p * lay.v))
        M = min(max_moe_layers_per_chunk(spec, lay.p * lay.v), L)
        tm = layer_times(spec, hw, lay.b, lay.t, lay.sp, lay.fused_kernels, lay.ep, lay.expert_dispatch, lay.cp)
        wt = weight_grad_times(spec, hw, lay.b, lay.t, lay.sp, lay.ep, lay.expert_dispatch, lay.cp)
        rc = 1.0 if lay.recompute is Recompute.LAYER else 0.0  # each layer's forward again in its backward
        last_stage = stage_of_chunk(placement_of(lay.schedule), lay.p, lay.p * lay.v - 1)
        fwd, bwd, w = tm["layer_f"] * (L - M), tm["layer_b"] * (L - M), wt["layer_w"] * (L - M)
        if M:
            fwd, bwd, w = fwd + tm["moe_f"] * M, bwd + tm["moe_b"] * M, w + wt["moe_w"] * M
        args = (spec, hw, lay.b, lay.t, lay.sp, lay.fused_kernels, lay.cp)
        replay = measured_recompute(*args) if rc else None  # a dense layer recomputed, as tune measured it
        if replay is None:
            bwd = bwd + fwd * rc
        else:
            bwd = bwd + replay * (L - M) + (tm["moe_f"] * M if M else PhaseTime())
        if (rt := hw.runtime) is not None:  # the runtime's own: each action's, each replayed region's
            split = lay.schedule in SPLIT_BACKWARD_SCHEDULES
            layer_nodes = spec.graph_nodes[1] if spec.graph_nodes else rt.layer_nodes
            split_layer = measured_split(*args) if split else None  # splitting B from W
            split_cost = (0.0 if not split else rt.split_node_s * L * layer_nodes if split_layer is None
                          else split_layer * (L - M) + rt.split_node_s * M * layer_nodes
                          + split_pipeline_seconds(spec, hw, lay))
            regions = L if replay is None else M  # a measured replay has its region's bookkeeping
            bwd += PhaseTime(runtime=rc * regions * rt.checkpoint_s + rt.action_s * (2 if split else 1) + split_cost)
            fwd += PhaseTime(runtime=rt.action_s)
            if split:
                w += PhaseTime(runtime=rt.action_s)
        return cls(L, fwd, bwd, w, {**tm, "head_w": wt["head_w"]},
                   ends_share_stage=lay.p > 1 and last_stage == 0)

    @property
    def t_W(self) -> float:
        return self.weight.total

    @property
    def head_w(self) -> float:
        return self.times["head_w"].total

    @property
    def t_F(self) -> float:
        return self.forward.total

    @property
    def t_B(self) -> float:
        return self.backward.total

    @property
    def head_f(self) -> float:
        return self.times["head_f"].total

    @property
    def head_b(self) -> float:
        return self.times["head_b"].total

    @property
    def emb_f(self) -> float:
        return self.times["emb_f"].total

    @property
    def emb_b(self) -> float:
        return self.times["emb_b"].total

    def ends(self, p: int) -> float:
        """The embedding's and the head's work per microbatch on the critical path: both
        without a pipeline or when they share a stage, the larger of the two (on different
        stages) otherwise."""
        head, emb = self.head_f + self.head_b, self.emb_f + self.emb_b
        return max(head, emb) if p > 1 and not self.ends_share_stage else head + emb

    def ends_phases(self, p: int) -> PhaseTime:
        """``ends`` by kind: the phases of the head and the embedding, or of the slower one."""
        head_t = self.times["head_f"] + self.times["head_b"]
        emb_t = self.times["emb_f"] + self.times["emb_b"]
        if p == 1 or self.ends_share_stage:
            return head_t + emb_t
        return head_t if head_t.total >= emb_t.total else emb_t  # the slower paces the pipeline


def _send_time(spec: ModelSpec, hw: Hardware, lay: Layout) -> float:
    """One stage-to-stage send of b s h fp16 (b s/cp h under context parallelism: each cp rank sends
    its tokens to its peer of the next stage): 1/t of it per GPU with scatter/gather, then
    an all-gather over NVLink; 0 without a pipeline."""
    if lay.p == 1:
        return 0.0
    t = lay.t
    bw, lat = stage_link(hw, t * lay.cp, lay.d, lay.p)
    msg = FP16 * lay.b * spec.seq_len // lay.cp * spec.hidden
    # the runtime's own, beside the bytes
    runtime = max(hw.runtime.send_s + interleaved_send_extra(spec, hw, lay), 0.0) if hw.runtime is not None else 0.0
    if lay.scatter_gather and t > 1:
        return p2p_time(msg / t, bw, lat) + tp_half_time(msg, t, hw) + runtime
    return p2p_time(msg, bw, lat) + runtime


MEASURED_SCHEDULES: dict[str, tuple[str, int, str]] = {
    "interleaved": ("interleaved_seconds", 2, "send_s"), "zb-h1": ("zb_h1_seconds", 1, "split_pipeline_s"),
    "zbv": ("zbv_seconds", 2, "split_pipeline_s")}
"""Schedule -> (the ``MeasuredPipeline`` field of its measured microbatch, its v there, the runtime figure
the measurement prices for it: a send's, or a split backward's on a pipeline)."""


def interleaved_send_extra(spec: ModelSpec, hw: Hardware, lay: Layout) -> float:
    """What a send costs an interleaved step (v > 1 chunks a stage, round-robin) beyond ``runtime.send_s``, for
    a model whose pipeline ``autopar tune`` measured (``measured_pipeline_figure``); 0 otherwise. On 2 CPU
    ranks sharing 2 cores a gloo send or receive posted while the peer computes blocks for 1-5 ms now and
    then, once or twice a step, and interleaved 1F1B posts 3 times as many of them as 1F1B."""
    if lay.schedule != "interleaved" or lay.v == 1:
        return 0.0
    extra = measured_pipeline_figure(spec, hw, lay)
    return 0.0 if extra is None else extra


def split_pipeline_seconds(spec: ModelSpec, hw: Hardware, lay: Layout) -> float:
    """What a backward split into B and W costs a chunk's backward on a pipeline beside its layers' own split:
    for a model whose pipeline ``autopar tune`` measured in this schedule, ``measured_pipeline_figure``; else
    the tiny GPT's ``runtime.split_pipeline_s`` (ZB-H1 over 2 ranks, a difference of differences of its
    steps, 0.7 to 1.8 ms from one tune to the next); 0 without a pipeline."""
    if lay.p == 1 or hw.runtime is None:
        return 0.0
    figure = measured_pipeline_figure(spec, hw, lay)
    return hw.runtime.split_pipeline_s if figure is None else figure


@lru_cache(maxsize=256)
def fitted_layers(spec: ModelSpec, hw: Hardware, precision) -> Hardware:
    """``hw`` with each of the model's layers measured at t > 1 with its steps (``MeasuredLayer.steps``)
    priced from those steps: the layer's seconds s that minimise the squared misfit of the priced steps,
    C_n + k_n s at each depth n (k_n the layer passes of the step, C_n its priced rest: embedding, head,
    loss, the runtime's per-action and per-step costs). The priced step is linear in s (one stage, no
    bubble), so two prices per depth give k_n and C_n. A single step carries its noise once; the
    difference of two steps (``seconds``) carries both steps' noise on a quarter of their size. ``hw``
    itself when it has no such layer."""
    def fitted(x: MeasuredLayer) -> bool:
        return bool(x.steps) and x.tp > 1 and measures_layer_of(x.signature, x.nodes, spec)
    if not any(map(fitted, hw.layers)):
        return hw
    bare = replace(hw, layers=tuple(replace(x, steps=()) for x in hw.layers))
    return replace(bare, layers=tuple(replace(x, steps=(), seconds=_fitted_seconds(spec, bare, x, precision))
                                      if fitted(x) else replace(x, steps=()) for x in hw.layers))


def _fitted_seconds(spec: ModelSpec, bare: Hardware, x: MeasuredLayer, precision) -> float:
    """``fitted_layers``' least-squares seconds of the layer ``x`` (steps left out of ``bare`` and ``x``)."""
    lay = Layout(t=x.tp, p=1, d=1, b=x.micro_batch, schedule="1f1b", recompute="none",
                 sequence_parallel=x.sequence_parallel, fused_kernels=False, precision=precision)
    plain = replace(x, steps=())

    def train_step(depth: int, seconds: float) -> float:
        at = replace(bare, layers=tuple(replace(y, seconds=seconds) if y == plain else y for y in bare.layers))
        est = estimate(replace(spec, layers=depth), Cluster(x.tp, at, x.micro_batch * x.microbatches), lay)
        return est.t_pipeline + est.t_step
    num = den = 0.0
    for depth, measured in x.steps:
        p0, p1 = train_step(depth, x.seconds), train_step(depth, 2 * x.seconds)
        k = (p1 - p0) / x.seconds
        num, den = num + k * (measured - (p0 - k * x.seconds)), den + k * k
    fit = num / den if den > 0 else 0.0
    return fit if fit > 0 else x.seconds


def measured_pipeline_figure(spec: ModelSpec, hw: Hardware, lay: Layout) -> float | None:
    """For ``lay``'s schedule, the value of its runtime figure (``MEASURED_SCHEDULES``: what its sends cost
    beyond ``send_s``, or a split backward's pipeline part) at which the cost model prices a microbatch of
    the model's measured pipeline (``Hardware.pipeline``: the same layer, the nearest micro-batch; 4 layers
    over 2 stages) beyond a 1F1B microbatch as measured: the priced step is piecewise linear in the
    figure, and a few secant steps from 0 and 1 ms find it. None when the profile did not measure it
    (another model, another schedule) or the figure does not move the priced step."""
    if lay.schedule not in MEASURED_SCHEDULES or hw.runtime is None or not hw.pipeline:
        return None
    found = [x for x in hw.pipeline if measures_layer_of(x.signature, x.nodes, spec)]
    if not found:
        return None
    x = min(found, key=lambda x: (abs(x.micro_batch - lay.b), x.micro_batch))
    return _fitted_figure(spec, hw, x, lay.schedule, lay.precision)


@lru_cache(maxsize=256)
def _fitted_figure(spec: ModelSpec, hw: Hardware, x: MeasuredPipeline, schedule: str, precision) -> float | None:
    """``measured_pipeline_figure`` for the measurement ``x`` (every layout of the schedule prices with it)."""
    name, v, knob = MEASURED_SCHEDULES[schedule]
    measured = replace(spec, layers=PIPELINE_LAYERS)

    def beyond_1f1b(value: float) -> float:
        rt = replace(hw.runtime, split_pipeline_s=0.0)
        bare = replace(hw, pipeline=(), runtime=rt)
        at = replace(bare, runtime=replace(rt, **{knob: getattr(rt, knob) + value}))
        return (_priced_microbatch(measured, at, schedule, v, x.micro_batch, precision)
                - _priced_microbatch(measured, bare, "1f1b", 1, x.micro_batch, precision))
    target = getattr(x, name) - x.one_f_one_b_seconds
    (k0, f0), (k1, f1) = (0.0, beyond_1f1b(0.0)), (1e-3, beyond_1f1b(1e-3))
    for _ in range(4):  # secant steps: exact once both points lie on the piece that holds the answer
        if f1 == f0:
            return None  # the figure does not reach this schedule's step
        k0, f0, k1 = k1, f1, k1 + (target - f1) * (k1 - k0) / (f1 - f0)
        f1 = beyond_1f1b(k1)
        if abs(f1 - target) < 1e-9:
            break
    return k1


@lru_cache(maxsize=256)
def _priced_microbatch(spec: ModelSpec, hw: Hardware, schedule: str, v: int, b: int, precision) -> float:
    """What a microbatch adds to the priced step of ``spec`` over 2 stages (eager chunks, no recomputation,
    simulated), from ``PIPELINE_MICROBATCHES``' two counts, as the tune measures it."""
    lo, hi = PIPELINE_MICROBATCHES

    def step(m: int) -> float:
        lay = Layout(t=1, p=2, d=1, b=b, v=v, schedule=schedule, recompute="none", fused_kernels=False,
                     precision=precision)
        return estimate(spec, Cluster(2, hw, m * b), lay, simulate=True).t_iter
    return (step(hi) - step(lo)) / (hi - lo)


def _pipeline(lay: Layout, m: int, chunk: _Chunk, c: float, simulate: bool) -> tuple[float, float, SimResult | None]:
    """(pipeline seconds, bubble fraction, the simulated step or None)."""
    p, v = lay.p, lay.v
    if simulate and p > 1 and 2 * p * v * m <= SIMULATION_LIMIT:
        sim = _chunk_timeline(lay, m, chunk, c)
        return sim.step_time, sim.bubble, sim
    if lay.schedule in SPLIT_BACKWARD_SCHEDULES:
        idle, _ = zero_bubble_idle(lay.schedule, p, m, chunk.t_F, chunk.t_B, chunk.t_W, c)
        busy = m * v * (chunk.t_F + chunk.t_B)
        return busy + m * v * 2 * c + idle + m * chunk.ends(p), idle / busy, None
    steps = m * v + p - 1
    return steps * (chunk.t_F + chunk.t_B + 2 * c) + m * chunk.ends(p), (p - 1) / (v * m), None


def _chunk_timeline(lay: Layout, m: int, chunk: _Chunk, c: float) -> SimResult:
    """The schedule simulator on ``lay``'s chunk costs (eager sends; W priced for a split backward)."""
    split = lay.schedule in SPLIT_BACKWARD_SCHEDULES
    return eager_timeline(lay.schedule, lay.p, lay.v, m, chunk.t_F, chunk.t_B, c,
                          first_extra=(chunk.emb_f, chunk.emb_b), last_extra=(chunk.head_f, chunk.head_b),
                          t_w=chunk.t_W if split else None, last_extra_w=chunk.head_w)


def _fullest_stage_params(spec: ModelSpec, lay: Layout) -> tuple[int, int]:
    """(parameters of the stage holding the most, of which routed experts' (E/ep per expert layer))."""
    total = params_per_stage(spec, lay.t, lay.p, lay.ep, _head_stage(lay))
    experts = expert_params_per_stage(spec, lay.t, lay.p, lay.ep)
    r = max(range(lay.p), key=lambda k: total[k])
    return total[r], experts[r]


def _head_stage(lay: Layout) -> int:
    """The pipeline stage of the last chunk, which holds the LM head (stage 0 in ZB-V)."""
    return stage_of_chunk(placement_of(lay.schedule), lay.p, lay.p * lay.v - 1)


def _runtime_step(hw: Hardware, lay: Layout) -> float:
    """The runtime's own cost of a step beside its actions (a tuned profile's ``RuntimeOverheads``): a
    one-rank step's, and a multi-rank step's collectives and failure watch when the layout spans ranks;
    0 on a preset."""
    rt = hw.runtime
    if rt is None:
        return 0.0
    return rt.step_s + (rt.world_step_s if lay.world > 1 else 0.0)


def _embedding_sync(spec: ModelSpec, hw: Hardware, lay: Layout) -> float:
    """All-reduce of the tied word embedding's gradient (V h / t) between the first and the
    last stage, across nodes; 0 without a pipeline, for a head of its own (untied), or when the
    head's chunk sits on the embedding's stage (ZB-V)."""
    if lay.p == 1 or not spec.tied_head or _head_stage(lay) == 0:  # ZB-V: one table on stage 0
        return 0.0
    V_l = math.ceil(spec.vocab / lay.t)
    return allreduce_time(FP16 * V_l * spec.hidden, 2, *embedding_link(hw, lay.t, lay.d, lay.p))


def _breakdown(chunk: _Chunk, lay: Layout, m: int, c: float, t_pipe: float, t_dp: float,
               t_opt: float) -> dict[str, float]:
    """Critical-path seconds by cause; the bubble is what the pipeline takes beyond its work.

    The embedding's and the LM head's work sit on the first and last stage; spread evenly it
    would cost each stage (head + embedding) / p per microbatch, so the kernels' terms count
    that share and ``imbalance`` the rest, m (max(head, embedding) - (head + embedding) / p):
    the time the other stages wait for the slowest one (0 without a pipeline)."""
    v, p = lay.v, lay.p
    ideal = m * v * (chunk.t_F + chunk.t_B) + m * chunk.ends(p)
    pipe_work = ideal + m * v * 2 * c
    ends = chunk.ends_phases(1)  # head and embedding together
    work = (chunk.forward + chunk.backward) * (m * v) + ends * (m / p)
    return {
        "gemm": work.gemm, "memory": work.memory, "tp_comm": work.comm, "ep_comm": work.ep, "cp_comm": work.cp,
        "runtime": work.runtime,
        "imbalance": m * (chunk.ends(p) - ends.total / p),
        "p2p": m * v * 2 * c, "bubble": max(t_pipe - pipe_work, 0.0),
        "dp": t_dp, "optimizer": t_opt,
    }

