"""Hardware profiles for the performance model: facts about a node, plus the
few efficiencies that turn peak numbers into achieved ones.

A preset is split in two on purpose:

- ``Hardware`` holds *facts* from data sheets (peak FLOP/s, HBM size and
  bandwidth, SM count, link rates) and two *measured* link efficiencies taken
  from public nccl-tests results, not fitted to anything here.
- ``Efficiency`` holds the *free constants* of the model: how close a large
  GEMM and a memory-bound kernel come to the peaks, fitted on the six
  calibration rows of the paper (see docs/performance-model.md, which lists
  each constant, its value and why). Everything else is first principles.

A *measured* profile (``autopar tune``, read by ``hardware_profile.py``) fills the same
``Hardware`` with the machine's own figures: GEMM rates per shape (``gemms``), the memory-bound
bandwidth, the eager per-op overhead, and each collective's fitted latency and bandwidth per
group size and placement (``links``). The cost model prices with those where a profile has them
(``op_times.op_time``, ``network.measured_link``); presets have none and price as before.

Units: FLOP/s, bytes, bytes/s, seconds.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from autopar.planning.errors import PlanError

__all__ = ["Efficiency", "Hardware", "MeasuredDataParallel", "MeasuredGemm", "MeasuredLayer", "MeasuredLink",
           "MeasuredPipeline", "PIPELINE_LAYERS", "PIPELINE_MICROBATCHES", "RuntimeOverheads", "PLACEMENTS", "LINK_OPS",
           "PROFILES", "get_hardware"]

GB = 1e9
GiB = 2**30


@dataclass(frozen=True)
class Efficiency:
    """The model's free constants (see docs/performance-model.md)."""

    gemm: float = 0.68
    """Fraction of peak FLOP/s reached by a large, well-shaped fp16 GEMM inside a
    training step (clocks under power load, kernel choice). Fitted on the paper's
    six rows by ``autopar.planning.cost.calibration.fit_efficiency()``."""
    hbm: float = 0.76
    """Fraction of HBM bandwidth reached by the memory-bound kernels of a 2021
    Megatron step (softmax, dropout, LayerNorm, GeLU, casts, Adam). Fitted with ``gemm``."""
    gemm_k_overhead: float = 64.0
    """K0: a GEMM tile's prologue/epilogue costs as much as K0 extra steps of
    its K loop, so efficiency scales by K / (K + K0) (hurts head_dim=96..128
    attention matmuls). Fixed from the shape of the CUTLASS mainloop (a few
    stages of 32-deep k-tiles), not fitted."""
    kernel_overhead: float = 4e-6
    """Seconds of launch/tail gap per kernel (typical CUDA launch gap). Fixed."""


LINK_OPS: tuple[str, ...] = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "p2p", "tp_all_reduce")
"""The communication a tuned profile measures, by the names its JSON uses. ``tp_all_reduce`` is the
runtime's own tensor-parallel all-reduce (``core.comm.group.all_reduce``: on gloo, pairwise exchanges
by recursive doubling), which the tensor-parallel layers run in place of ``dist.all_reduce``."""


@dataclass(frozen=True)
class RuntimeOverheads:
    """What autopar's runtime costs beside its kernels, measured by ``autopar tune``
    (``cli/tune_runtime.py``); None on a preset, whose kernels' launch gap
    (``Efficiency.kernel_overhead``) stands for all of it."""

    step_s: float
    """Seconds of one ``train_step`` beside its actions (the schedule's set-up, the loss's sum)."""
    action_s: float
    """Seconds of one compute action (a chunk's F, B or W) beside its chunk's nodes."""
    node_s: float
    """Seconds of one forward graph node of a layer in a training step, its forward and backward
    together (the generated code's call, autograd's recording and its backward node)."""
    checkpoint_s: float
    """Seconds a checkpointed region adds beside its forward run again (saving and restoring the
    random state, the replay's bookkeeping)."""
    optimizer_per_param_s: float
    """Seconds of PyTorch's AdamW step per fp32 parameter (the optimizer autopar's runtime steps)."""
    send_s: float
    """Seconds a pipeline send costs a step beside its bytes (posting it, the peer's receive action,
    their waits), measured on a 2-stage engine; 0 when tuned on one rank."""
    split_node_s: float
    """Seconds a backward split into B and W (ZB-H1, ZB-V) costs per forward graph node of its chunk beside
    W's action (the autograd graph's walk, the retained graph, the store's slots), measured on a 2-stage
    engine; 0 when tuned on one rank."""
    split_pipeline_s: float
    """Seconds a backward split into B and W costs a pipeline stage per microbatch beside its layers' own
    split (what the tiny GPT's 2 ranks pay over its one rank's: W's place in the stages' exchange), the
    part ``split_node_s`` holds beside ``MeasuredLayer.split_seconds``; 0 when tuned on one rank."""
    tp_collective_s: float
    """Seconds of a tensor-parallel collective's latency inside a step, measured on the all-reduces of a
    t = 2 engine (the exchange, the peer's late arrival, the wake-up): it replaces the lone call's fitted
    alpha of each all-reduce, all-gather and reduce-scatter over 2 tensor-parallel ranks; 0 when not
    measured (tuned on one rank)."""
    distopt_step_s: float
    """Seconds the distributed optimizer's step costs beside the inner optimizer's work on its shard and the
    bytes of its all-gather (the failure watch around it, launching and waiting for the gathers, the
    write-back into the flat buffers), measured on the tiny GPT data parallel over 2 ranks against plain
    AdamW; 0 when tuned on one rank."""
    world_step_s: float
    """Seconds a step of a multi-rank engine costs beside a one-rank step's and its gradient reduction:
    the failure board's read, the loss's reduction over the replicas or broadcast from the last stage,
    the non-finite check's all-reduce, the failure watch's heartbeats; measured on a 2-rank data-parallel
    engine of the tiny GPT (its gradient reduction timed apart and left out); 0 when tuned on one rank."""
    layer_nodes: int
    """Forward graph nodes of the layer ``node_s`` was measured on (the tiny reference GPT's): the
    count a spec read without its graph is priced with."""
    end_nodes: int
    """That model's nodes outside its layers (embedding, head, loss)."""


@dataclass(frozen=True)
class MeasuredLayer:
    """One layer of a model, its forward and backward timed on autopar's engine by ``autopar tune``
    (``cli/tune_layers.py``): what the layer's priced kernels, graph nodes and tensor-parallel
    collectives add up to on this machine."""

    signature: str
    """The model's layer, as ``models.layer_signature`` names it (dimensions and kind)."""
    nodes: int
    """Forward graph nodes of the layer as traced (0: not known): two models of the same dimensions
    but other code (a GPT's LayerNorm and GELU, a Llama's RMSNorm, rotary and SwiGLU) differ here."""
    micro_batch: int
    tp: int
    sequence_parallel: bool
    seconds: float
    """Its forward and backward in a training step, on one rank of the t, every rank stepping at once
    (eager chunks, fp32, no recomputation)."""
    recompute_seconds: float = 0.0
    """What recomputing it (``recompute='layer'``) adds to its backward: its forward again and the
    checkpointed region's bookkeeping; 0 when not measured."""
    split_seconds: float = 0.0
    """What splitting its backward into B and W (the zero-bubble schedules) adds, beside W's action; 0 when
    not measured (measured at t = 1)."""
    steps: tuple[tuple[int, float], ...] = ()
    """At t > 1, (layers, seconds) for each depth the tune built the model at: its whole ``train_step``
    (``microbatches`` microbatches on one stage, the median step). ``seconds`` is their difference per
    layer; the cost model fits the layer to the steps themselves instead (``step_estimate.fitted_layers``):
    a difference of two steps whose ranks wait on each other's collectives moved by 15-25% between tunes.
    Empty at t = 1."""
    microbatches: int = 0

    def __post_init__(self) -> None:  # read from JSON as lists: kept hashable (the cost model caches on it)
        object.__setattr__(self, "steps", tuple((int(n), float(t)) for n, t in self.steps))


@dataclass(frozen=True)
class MeasuredDataParallel:
    """The data-parallel side of a step of a model, timed on autopar's engine by ``autopar tune``
    (``cli/tune_layers.py``): the model of 2 layers, 2 replicas, 1 microbatch, with PyTorch's AdamW and
    with the engine's distributed optimizer."""

    signature: str
    """The model's layer, as ``models.layer_signature`` names it."""
    nodes: int
    """Forward graph nodes of its layer (0: not known)."""
    params: int
    """Parameters each replica held (the whole 2-layer model)."""
    sync_seconds: float
    """The gradient reduction in a step of the plain engine (``GradientSync``: flattening, the all-reduce,
    averaging, copying back)."""
    optimizer_seconds: float
    """PyTorch's AdamW step over those parameters, and clearing the gradients."""
    distopt_seconds: float
    """What the distributed optimizer costs a step in place of those two: its step (reduce-scatter,
    the inner step on 1/2 of the parameters, all-gather, waits) less nothing of the compute: the
    distributed engine's step and optimizer step less the plain engine's step less its reduction and
    optimizer."""


PIPELINE_LAYERS = 4
"""Layers of the model whose pipeline ``autopar tune`` measures (``MeasuredPipeline``)."""

PIPELINE_MICROBATCHES = (2, 8)
"""The microbatch counts of the measured pipeline steps: their difference, over 6, is what a microbatch adds."""


@dataclass(frozen=True)
class MeasuredPipeline:
    """A model's pipeline, timed on autopar's engine by ``autopar tune`` (``cli/tune_layers.py``): the model
    of ``PIPELINE_LAYERS`` layers over 2 stages, 1F1B (2 layers a stage), interleaved 1F1B (v = 2, 1 layer a
    chunk), ZB-H1 and ZB-V, each at ``PIPELINE_MICROBATCHES`` microbatches. A microbatch adds the same
    layers' work to each; what it adds besides differs by the schedule's actions, sends and split backward,
    which the cost model prices from the tiny GPT's figures (``RuntimeOverheads``) and this measures on the
    model itself (``step_estimate.measured_pipeline_figure``)."""

    signature: str
    """The model's layer, as ``models.layer_signature`` names it."""
    nodes: int
    """Forward graph nodes of its layer (0: not known)."""
    micro_batch: int
    one_f_one_b_seconds: float
    """What a microbatch adds to the 1F1B step: (T(8) - T(2)) / 6, the slower stage's step."""
    interleaved_seconds: float
    """What a microbatch adds to the interleaved step (v = 2), likewise."""
    zb_h1_seconds: float
    """What a microbatch adds to the ZB-H1 step, likewise."""
    zbv_seconds: float
    """What a microbatch adds to the ZB-V step (v = 2), likewise."""


PLACEMENTS: tuple[str, ...] = ("intra", "inter")
"""Where a group's ranks sit: all in one node (``intra``), or spread over nodes (``inter``)."""


@dataclass(frozen=True)
class MeasuredGemm:
    """One GEMM shape timed on the machine: C (batch, M, N) = A (batch, M, K) B (batch, K, N)."""

    batch: int
    m: int
    n: int
    k: int
    flops: float
    """Achieved FLOP/s, 2 batch M N K / median seconds."""


@dataclass(frozen=True)
class MeasuredLink:
    """One collective fitted on the machine: time(nbytes) = alpha + nbytes / beta.

    ``nbytes`` is what the network model's functions take for that op: an all-reduce's tensor, an
    all-gather's whole output, a reduce-scatter's whole input, the bytes each rank holds before an
    all-to-all, one point-to-point message."""

    op: str
    """One of ``LINK_OPS``."""
    ranks: int
    """Group size (2 for ``p2p``)."""
    placement: str
    """One of ``PLACEMENTS``."""
    alpha: float
    """Seconds of a call that carries no bytes (latency, per-call overhead)."""
    beta: float
    """Bytes/s the call's time grows by (its effective bandwidth for ``nbytes``)."""

    def time(self, nbytes: float) -> float:
        return self.alpha + nbytes / self.beta


@dataclass(frozen=True)
class Hardware:
    """One kind of node: GPUs, their memory and their links."""

    name: str
    """Profile key, e.g. ``dgx-a100-80gb``."""
    gpu: str
    """GPU model, for display."""
    gpus_per_node: int
    """GPUs sharing one NVLink/NVSwitch domain."""
    peak_flops: float
    """Dense fp16/bf16 tensor-core FLOP/s of one GPU (the paper's 'peak')."""
    hbm_bytes: float
    """Memory of one GPU, bytes."""
    hbm_bw: float
    """HBM bandwidth of one GPU, bytes/s."""
    sm_count: int
    """Streaming multiprocessors (GEMM tiles run one wave of this many at a time)."""
    nvlink_bw: float
    """NVLink bandwidth per GPU per direction, bytes/s (half the bidirectional figure)."""
    ib_bw: float
    """Inter-node bandwidth per GPU per direction, bytes/s (one NIC per GPU)."""
    nvlink_latency: float = 5e-6
    """Per-step latency of an NVLink collective or send, seconds."""
    ib_latency: float = 10e-6
    """Per-step latency of an InfiniBand collective or send, seconds."""
    nvlink_efficiency: float = 0.78
    """Measured: NCCL all-reduce bus bandwidth over NVLink / nominal rate
    (nccl-tests on DGX A100: about 230-235 GB/s of 300)."""
    ib_efficiency: float = 0.92
    """Measured: NCCL bus bandwidth per NIC / line rate (about 23 of 25 GB/s on HDR)."""
    memory_headroom: float = 0.90
    """Fraction of HBM the planner lets a layout use (CUDA context, NCCL
    buffers, allocator fragmentation take the rest)."""
    eff: Efficiency = field(default_factory=Efficiency)
    """The model's free constants for this hardware."""
    tuned: bool = False
    """Measured by ``autopar tune`` (``hardware_profile.to_hardware``): its collectives are priced by
    ``links`` alone, and a group they lack is refused rather than priced from data-sheet figures."""
    gemms: tuple[MeasuredGemm, ...] = ()
    """Measured GEMM rates (a tuned profile): a GEMM is priced at the rate of the nearest measured
    shape times ``eff.gemm`` (1 for a tuned profile) instead of peak x ``op_times.gemm_efficiency``.
    Empty for a preset."""
    links: tuple[MeasuredLink, ...] = ()
    """Measured collectives (a tuned profile): each collective of a layout is priced by the fit of
    its op, group size and placement (``network.measured_link``). Empty for a preset."""
    links_measured_at: tuple[float, float] = (0.0, 0.0)
    """(``nvlink_bw``, ``ib_bw``) when ``links`` were measured: a copy with another ``nvlink_bw`` or
    ``ib_bw`` (the planner's sensitivity knobs) scales the measured bandwidths by the same factor."""
    runtime: RuntimeOverheads | None = None
    """The runtime's own costs beside the kernels (a tuned profile that measured them), else None."""
    byte_scale: float = 1.0
    """What the cost model counts a tensor's real bytes as: 1 on a preset; a profile priced in fp32 halves
    its memory and link bandwidths so that the cost model's 2-byte element counts take the time of
    4-byte tensors, and counts a tensor of known bytes (fp32 gradients) at 2 / 4 of them."""
    layers: tuple[MeasuredLayer, ...] = ()
    """Layers of the model ``autopar tune`` was given, measured on the engine (a tuned profile on a CPU):
    ``op_times.layer_times`` scales the priced layer of a matching model to them. Empty otherwise."""
    data_parallel: tuple[MeasuredDataParallel, ...] = ()
    """The data-parallel side of the model ``autopar tune`` was given, measured on the engine: scales the
    priced gradient reduction and distributed optimizer of a matching model (``step_estimate``)."""
    pipeline: tuple[MeasuredPipeline, ...] = ()
    """The pipeline of the model ``autopar tune`` was given, measured on the engine in each schedule: prices a
    matching model's interleaved sends and a split backward's pipeline part (``step_estimate``)."""
    tune_command: str = ""
    """The ``autopar tune`` flags that measured this profile (the model, the micro-batch, the output
    file), for the error that asks for a group size it lacks. Empty for a preset."""

    @property
    def usable_bytes(self) -> float:
        return self.hbm_bytes * self.memory_headroom

    def with_efficiency(self, **kw: float) -> "Hardware":
        """A copy with some free constants changed (for calibration and tests)."""
        return replace(self, eff=replace(self.eff, **kw))


_DGX_H100 = Hardware(name="dgx-h100", gpu="H100-SXM5-80GB", gpus_per_node=8, peak_flops=989e12, hbm_bytes=80 * GiB,
                     hbm_bw=3350 * GB, sm_count=132, nvlink_bw=450 * GB, ib_bw=400e9 / 8)

PROFILES: dict[str, Hardware] = {
    # The paper's Selene nodes: 8x A100-SXM4-80GB, NVSwitch (600 GB/s per GPU,
    # bidirectional), 8x 200 Gb/s HDR InfiniBand per node (one NIC per GPU).
    "dgx-a100-80gb": Hardware(
        name="dgx-a100-80gb",
        gpu="A100-SXM4-80GB",
        gpus_per_node=8,
        peak_flops=312e12,
        hbm_bytes=80 * GiB,
        hbm_bw=2039 * GB,
        sm_count=108,
        nvlink_bw=300 * GB,
        ib_bw=200e9 / 8,
    ),
    # DGX H100: 8x H100-SXM5-80GB, NVLink 4 (900 GB/s bidirectional),
    # 8x 400 Gb/s NDR. Efficiencies reuse the A100 calibration (unvalidated).
    "dgx-h100": _DGX_H100,
    # DGX H200: H100 compute with 141 GB HBM3e at 4.8 TB/s.
    "dgx-h200": replace(_DGX_H100, name="dgx-h200", gpu="H200-SXM-141GB", hbm_bytes=141 * GB, hbm_bw=4800 * GB),
}


def get_hardware(name: str) -> Hardware:
    """The preset called ``name``; the error lists the presets. (``hardware_profile.resolve_hardware``
    also takes the path of a profile ``autopar tune`` wrote.)"""
    try:
        return PROFILES[name]
    except KeyError:
        known = ", ".join(sorted(PROFILES))
        raise PlanError(f"unknown hardware profile {name!r}; known: {known}, or the path of a JSON profile "
                        f"`autopar tune` wrote (no file {name!r})") from None
