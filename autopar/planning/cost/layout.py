"""Where and how to run: the ``Cluster`` (GPUs, node profile, global batch), a ``Layout``
of it (t, cp, p, d, v, micro-batch, schedule, recomputation, sequence parallelism, distributed
optimizer, expert parallelism, context parallelism, byte sizes) and the rules a layout must keep.

Ranks are laid out tensor-parallel fastest, then context-parallel, then data-parallel, then
pipeline: the world is t cp p d GPUs."""

from __future__ import annotations

from dataclasses import dataclass, field

from autopar.core.config import (
    EXPERT_DISPATCHERS,
    RECOMPUTE,
    SCHEDULE_NAMES,
    ParallelConfig,
    Recompute,
    microbatch_errors,
)
from autopar.planning.cost.hardware import Hardware
from autopar.planning.cost.hardware_profile import resolve_hardware
from autopar.planning.cost.models import ModelSpec
from autopar.planning.cost.precision import MIXED, Precision
from autopar.planning.errors import PlanError

__all__ = ["Cluster", "Layout", "layout_errors", "runtime_errors", "expert_errors", "context_errors",
           "PRICED_RECOMPUTE"]

PRICED_RECOMPUTE: tuple[Recompute, ...] = (Recompute.LAYER, Recompute.NONE)
"""The recomputation modes the cost model prices. ``chunk`` (the whole chunk re-materialised in
its backward, embedding and LM head included) is not: its memory and time differ from
``layer``'s in ways the model does not follow, so a layout asking for it is refused."""


@dataclass(frozen=True)
class Cluster:
    """The machines: how many GPUs of which kind, and the global batch to train."""

    gpus: int
    """Total GPUs, n."""
    hardware: Hardware
    """Node profile."""
    global_batch: int
    """Sequences per optimizer step, B."""

    @classmethod
    def of(cls, gpus: int, hardware: str | Hardware, global_batch: int) -> Cluster:
        """``hardware`` by preset name (``hardware.PROFILES``), by the path of a tuned profile
        (``hardware_profile.resolve_hardware``), or given."""
        return cls(gpus, resolve_hardware(hardware), global_batch)


@dataclass(frozen=True)
class Layout:
    """One way to run: parallel degrees, micro-batch, schedule, recomputation."""

    t: int
    """Tensor-parallel degree: a divisor of the GPUs of a node (NVLink), or a multiple of it
    (the group spans t / G nodes, its all-reduces cross InfiniBand)."""
    p: int
    """Pipeline stages."""
    d: int
    """Data-parallel replicas."""
    b: int
    """Micro-batch size (sequences)."""
    v: int = 1
    """Model chunks per pipeline stage (interleaved schedule when > 1)."""
    schedule: str = ""
    """``1f1b``, ``interleaved``, ``gpipe``, or the zero-bubble ``zb-h1`` (v = 1) and ``zbv`` (v = 2);
    empty means interleaved if v > 1 else 1f1b."""
    recompute: Recompute | str = Recompute.LAYER
    """Activation recomputation, ``core.config.Recompute``: ``layer`` (each layer's input kept,
    the layer recomputed in its backward: Megatron's "full" recomputation, as in every paper
    run) or ``none``. ``chunk`` is refused (``PRICED_RECOMPUTE``)."""
    scatter_gather: bool = True
    """Send 1/t of each boundary activation and all-gather it over NVLink."""
    dp_overlap: bool = False
    """Overlap the data-parallel gradient all-reduce with the last backward."""
    sequence_parallel: bool = False
    """Megatron's sequence parallelism (Korthikanti et al. 2022): LayerNorm, dropout and the
    residual adds run on s/t tokens per rank, g's all-reduce becomes a reduce-scatter and f's
    identity an all-gather. Off by default (the paper's runs); no effect at t = 1."""
    distributed_optimizer: bool = False
    """Megatron's distributed optimizer (ZeRO stage 1): the optimizer state sharded over the d
    replicas, gradients reduce-scattered and parameters all-gathered after the step. Off by
    default (the paper's runs); no effect at d = 1."""
    ep: int = 1
    """Expert parallelism: each group of ``ep`` consecutive data-parallel replicas (one expert group,
    as ``core.mesh`` builds it: ranks t apart) splits every mixture-of-experts layer's E experts,
    E/ep whole experts per rank, and exchanges the routed tokens so that each row is computed by
    the rank holding its expert. Divides d (and E); 1: every replica holds every expert."""
    expert_dispatch: str = "alltoall"
    """How the routed rows travel with ep > 1 (``core.config.EXPERT_DISPATCHERS``): 'allgather' (every
    rank all-gathers the ep S rows of its group and reduce-scatters the results: static shapes,
    ep times the rows) or 'alltoall' (each rank sends each peer exactly the rows of its experts)."""
    cp: int = 1
    """Context parallelism: the sequence of every activation split over ``cp`` ranks (t apart: a
    context-parallel group follows the tensor-parallel one in rank order), s/cp tokens each, and
    attention run as ring attention (``core.comm.ring_attention``). Parameters are replicated
    over cp, their gradients averaged over the d cp ranks of a stage holding the same shard.
    The sequence must cut into cp (bidirectional) or 2 cp (causal) equal chunks."""
    fused_kernels: bool = True
    """The element-wise kernels between the GEMMs fused (Megatron's fused kernels, as in the paper's
    runs; autopar with ``compile=True``), or False: one pass each, as a chunk run eagerly makes them
    (``transformer.op_by_op``: about 1.6x the memory-bound bytes of a layer)."""
    precision: Precision = field(default=MIXED, compare=True)
    """Byte sizes of weights, gradients, activations and optimizer state (``precision.py``)."""

    def __post_init__(self) -> None:
        if not self.schedule:
            object.__setattr__(self, "schedule", "interleaved" if self.v > 1 else "1f1b")
        if self.schedule not in SCHEDULE_NAMES:
            raise PlanError(f"schedule must be one of {SCHEDULE_NAMES}, got {self.schedule!r}")
        if self.recompute not in RECOMPUTE:
            alias = " ('full', Megatron's name, is 'layer')" if self.recompute == "full" else ""
            raise PlanError(f"recompute must be one of {list(RECOMPUTE)}, got {self.recompute!r}{alias}")
        object.__setattr__(self, "recompute", Recompute(self.recompute))
        if self.recompute not in PRICED_RECOMPUTE:
            raise PlanError(f"the cost model prices recompute 'layer' or 'none', not {str(self.recompute)!r}: "
                            "re-materialising a whole chunk (embedding and LM head included) in its backward "
                            "changes its memory and time in ways it does not model")
        if min(self.t, self.p, self.d, self.b, self.v) < 1:
            raise PlanError(f"all degrees must be >= 1: {self}")
        if self.ep < 1 or self.cp < 1:
            raise PlanError(f"ep and cp must be >= 1, got ep={self.ep}, cp={self.cp}")
        if self.expert_dispatch not in EXPERT_DISPATCHERS:
            raise PlanError(f"expert_dispatch must be one of {list(EXPERT_DISPATCHERS)}, got {self.expert_dispatch!r}")
        if self.schedule == "1f1b" and self.v != 1:
            raise PlanError(f"1f1b runs one chunk per stage (v=1), got v={self.v}; use 'interleaved'")

    @property
    def sp(self) -> bool:
        """Sequence parallelism in effect (asked for, and t > 1)."""
        return self.sequence_parallel and self.t > 1

    @property
    def distopt(self) -> bool:
        """The distributed optimizer in effect (asked for, and d cp > 1: it shards over every rank
        holding the same parameters)."""
        return self.distributed_optimizer and self.dcp > 1

    @property
    def dcp(self) -> int:
        """Ranks holding the same parameter shard, d cp: a dense gradient is averaged over them and
        the distributed optimizer shards over them."""
        return self.d * self.cp

    @property
    def world(self) -> int:
        """GPUs the layout uses: t cp p d."""
        return self.t * self.cp * self.p * self.d

    @property
    def edp(self) -> int:
        """Replicas holding the same experts (``Mesh.groups['edp']``): d / ep; an expert's gradient
        is averaged over them, a dense parameter's over all d."""
        return max(self.d // self.ep, 1)

    @classmethod
    def from_config(cls, config: ParallelConfig, micro_batch_size: int,
                    precision: Precision = MIXED) -> Layout:
        """The layout a program compiled with ``config`` runs, micro-batches of ``micro_batch_size``.

        d is ``config.data_parallel``; the gradient all-reduce overlaps the backward
        (autopar's runtime reduces each bucket as soon as its last gradient is made).
        Estimate it on a cluster of t p d GPUs with a global batch of
        ``config.microbatches * d * micro_batch_size`` sequences, so that m is the
        config's. Sequence parallelism and the distributed optimizer are read from the
        config when it has them (``sequence_parallel``, ``distributed_optimizer``; off
        otherwise; ``sequence_parallel=None``, "on where it fits", counts as on when t > 1:
        a compiled program's own answer is ``program.sequence is not None``). Memory is priced in ``precision``: mixed precision (16-bit weights and
        activations, fp32 master weights and Adam state, the paper's) by default, or
        ``precision.runtime_precision(config.precision)`` for what autopar's runtime holds.
        ``recompute='chunk'`` is refused (``PRICED_RECOMPUTE``).
        """
        return cls(t=config.tp, p=config.pp, d=config.data_parallel, b=micro_batch_size, v=config.virtual_stages,
                   schedule=config.schedule, recompute=config.recompute, scatter_gather=config.scatter_gather,
                   dp_overlap=True, sequence_parallel=_sequence_parallel(config),
                   distributed_optimizer=bool(getattr(config, "distributed_optimizer", False)),
                   ep=getattr(config, "ep", 1), expert_dispatch=getattr(config, "expert_dispatch", "alltoall"),
                   cp=getattr(config, "cp", 1) or 1, precision=precision)

    @property
    def short(self) -> str:
        parts = [f"t={self.t}", *([f"cp={self.cp}"] if self.cp > 1 else []), f"p={self.p}", f"d={self.d}",
                 f"b={self.b}"]
        if self.v > 1:
            parts.append(f"v={self.v}")
        if self.p > 1:
            parts.append({"1f1b": "1F1B", "interleaved": "int", "gpipe": "GPipe", "zb-h1": "ZB-H1",
                          "zbv": "ZB-V"}[self.schedule])
        if self.recompute is Recompute.NONE:
            parts.append("no-rc")
        if self.sp:
            parts.append("sp")
        if self.distopt:
            parts.append("distopt")
        if self.ep > 1:
            parts.append(f"ep={self.ep} {'a2a' if self.expert_dispatch == 'alltoall' else 'ag'}")
        return " ".join(parts)


def layout_errors(spec: ModelSpec, cluster: Cluster, lay: Layout, divisible_layers: bool = True,
                  runnable: bool = True) -> list[str]:
    """Every rule ``lay`` breaks, each naming the numbers and the fix (empty if valid); with
    ``runnable=False`` only those the cost model needs, not the schedule's (``runtime_errors``)."""
    errs = []
    hw = cluster.hardware
    if lay.world != cluster.gpus:
        cp = f" * cp({lay.cp})" if lay.cp > 1 else ""
        errs.append(f"t({lay.t}){cp} * p({lay.p}) * d({lay.d}) = {lay.world}, "
                    f"but the cluster has {cluster.gpus} GPUs")
    G = hw.gpus_per_node
    if (lay.t < G and G % lay.t) or (lay.t > G and lay.t % G):
        errs.append(f"t={lay.t} must divide the {G} GPUs of a node or be a multiple of it (a tensor-parallel "
                    f"group fills whole nodes): try t in {sorted({k for k in (1, 2, 4, 8, 16, 32, 64) if G % k == 0 or k % G == 0})}")
    if spec.heads % lay.t or spec.kv % lay.t:
        errs.append(f"heads ({spec.heads}, kv {spec.kv}) must be divisible by t={lay.t}")
    if spec.ffn_size % lay.t:
        errs.append(f"ffn ({spec.ffn_size}) must be divisible by t={lay.t}")
    errs += expert_errors(spec, lay)
    errs += context_errors(spec, lay)
    local = spec.seq_len // lay.cp
    if lay.sp and (spec.seq_len % lay.cp or local % lay.t):
        held = f"the {local} tokens a context-parallel rank holds" if lay.cp > 1 else \
            f"the {spec.seq_len} tokens of a sequence"
        errs.append(f"sequence parallelism splits {held} over t={lay.t} ranks: "
                    f"seq_len{'/cp' if lay.cp > 1 else ''} must be divisible by t (or turn sequence parallelism off)")
    chunks = lay.p * lay.v
    if spec.layers < chunks:
        errs.append(f"{spec.layers} layers cannot fill p*v = {lay.p}*{lay.v} = {chunks} chunks")
    elif divisible_layers and spec.layers % chunks:
        errs.append(f"layers ({spec.layers}) must be divisible by p*v = {chunks}")
    if lay.v > 1 and lay.p == 1:
        errs.append(f"v={lay.v} needs a pipeline (p > 1)")
    B = cluster.global_batch
    if B % (lay.d * lay.b):
        errs.append(f"global batch {B} is not divisible by d*b = {lay.d}*{lay.b} = {lay.d * lay.b}")
    elif runnable:
        errs += runtime_errors(cluster, lay, spec)
    return errs


def context_errors(spec: ModelSpec, lay: Layout) -> list[str]:
    """The rules of context parallelism ``lay`` breaks for ``spec``, with the numbers and the fix: the
    sequence cuts into 2 cp equal chunks (causal attention, the load-balanced layout) or cp
    (bidirectional, contiguous); expert parallelism beside it is not priced."""
    if lay.cp == 1:
        return []
    errs = []
    chunks = 2 * lay.cp if spec.causal else lay.cp
    if spec.seq_len % chunks:
        how = "2*cp" if spec.causal else "cp"
        fits = [k for k in range(2, spec.seq_len + 1) if spec.seq_len % ((2 if spec.causal else 1) * k) == 0][:8]
        errs.append(f"context parallelism cp={lay.cp} cuts each sequence into {how} = {chunks} equal chunks "
                    f"({'load-balanced, causal' if spec.causal else 'contiguous, bidirectional'} attention), "
                    f"but seq_len is {spec.seq_len} ({spec.seq_len} % {chunks} = {spec.seq_len % chunks}). "
                    f"Fix: cp in {fits}, or pad the sequences to a multiple of {chunks}")
    if lay.ep > 1:
        errs.append(f"expert parallelism (ep={lay.ep}) beside context parallelism (cp={lay.cp}) is not priced: "
                    f"where the expert groups lie among the cp ranks is not decided. Fix: ep=1 or cp=1")
    return errs


def expert_errors(spec: ModelSpec, lay: Layout) -> list[str]:
    """The rules of expert parallelism ``lay`` breaks for ``spec``, with the numbers and the fix:
    ep needs experts, divides d (an expert group is ep data-parallel replicas) and E (whole
    experts per rank); an expert's width and a shared expert's divide t."""
    errs = []
    if lay.ep > 1 and not spec.is_moe:
        errs.append(f"ep={lay.ep} splits experts, but {spec.label} has none (experts=0): use ep=1, or describe "
                    f"its mixture-of-experts layers (ModelSpec.experts, top_k)")
        return errs
    if lay.d % lay.ep:
        fits = [k for k in range(1, lay.d + 1) if lay.d % k == 0 and spec.experts % k == 0]
        errs.append(f"ep={lay.ep} does not divide d={lay.d}: an expert group is made of ep data-parallel replicas. "
                    f"Fix: ep in {fits}, or d a multiple of {lay.ep}")
    if spec.is_moe and spec.experts % lay.ep:
        fits = [k for k in range(1, spec.experts + 1) if spec.experts % k == 0]
        errs.append(f"ep={lay.ep} does not divide the {spec.experts} experts: each rank of an expert group holds "
                    f"E/ep whole experts. Fix: ep in {fits}")
    if spec.is_moe and spec.expert_ffn_size % lay.t:
        errs.append(f"expert_ffn ({spec.expert_ffn_size}) must be divisible by t={lay.t}: each expert is split "
                    f"t ways on its width")
    if spec.is_moe and spec.shared_expert_ffn % lay.t:
        errs.append(f"shared_expert_ffn ({spec.shared_expert_ffn}) must be divisible by t={lay.t}")
    return errs


def runtime_errors(cluster: Cluster, lay: Layout, spec: ModelSpec | None = None) -> list[str]:
    """The rules of the schedule (``core.config.microbatch_errors``) that ``lay`` breaks, and with
    ``spec`` those of ring attention (no attention dropout under cp > 1): a layout breaking only
    these can be priced (closed form) but not run by autopar's runtime."""
    errs: list[str] = []
    if spec is not None and lay.cp > 1 and spec.dropout:
        errs.append(f"ring attention (cp={lay.cp}) has no attention dropout, and {spec.label} has dropout: "
                    f"train it without dropout (ModelSpec.dropout=False, --no-dropout) or use cp=1")
    B = cluster.global_batch
    if B % (lay.d * lay.b):
        return errs
    m = B // (lay.d * lay.b)
    return errs + [f"with m = B/(d b) = {B}/({lay.d}*{lay.b}) = {m} microbatches, {e}"
                   for e in microbatch_errors(lay.schedule, lay.p, lay.v, m)]


def _sequence_parallel(config) -> bool:
    """A config's sequence parallelism as the cost model prices it: None (on where it fits) is on
    whenever there is more than one tensor-parallel rank."""
    sp = getattr(config, "sequence_parallel", False)
    return config.tp > 1 if sp is None else bool(sp)
