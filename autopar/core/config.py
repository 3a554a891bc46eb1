"""``ParallelConfig``: the layout and training options of a program, validated up front.

Every check here runs before anything is traced or any process starts, and
its message shows the numbers and the fix ("tp=2 x pp=2 needs a multiple of
4 ranks, the world has 2 ... Fix: start 4, 8, 12, ... ranks, or ...").
"""

from __future__ import annotations

from dataclasses import dataclass

from enum import Enum

from autopar.core.errors import ConfigError
from autopar.core.mesh import MeshShape

__all__ = ["ParallelConfig", "Recompute", "RECOMPUTE", "PRECISIONS", "LOSS_REDUCTIONS", "SCHEDULE_NAMES", "SPLIT_BACKWARD_SCHEDULES", "COMPILE_BACKENDS",
           "FEWER_MICROBATCHES_THAN_STAGES", "microbatch_errors", "size_errors", "sequence_parallel_errors",
           "mesh_errors", "optimizer_bytes_per_param", "EXPERT_DISPATCHERS", "expert_errors", "OVERLAP_KINDS", "overlap_errors", "overlap_kinds"]


class Recompute(str, Enum):
    """Activation recomputation, one vocabulary for the compiler, the runtime and the cost model."""

    NONE = "none"
    """Keep every activation between a microbatch's forward and its backward."""
    LAYER = "layer"
    """Keep each layer's input; recompute the layer in the backward (Megatron's full recomputation)."""
    CHUNK = "chunk"
    """Keep each pipeline chunk's input; recompute the whole chunk in the backward."""

    def __str__(self) -> str:
        return self.value


RECOMPUTE: tuple[str, ...] = tuple(r.value for r in Recompute)
PRECISIONS: tuple[str, ...] = ("fp32", "bf16")
LOSS_REDUCTIONS: tuple[str, ...] = ("tokens", "microbatch")
"""How a step's microbatch losses make its loss (``ParallelConfig.loss_reduction``)."""
SCHEDULE_NAMES: tuple[str, ...] = ("gpipe", "1f1b", "interleaved", "zb-h1", "zbv")
"""Pipeline schedules the generators know (``autopar.schedules.generate``)."""
SPLIT_BACKWARD_SCHEDULES: tuple[str, ...] = ("zb-h1", "zbv")
"""The zero-bubble schedules: each backward is split into B (input gradient) and W (weight gradient)."""
FEWER_MICROBATCHES_THAN_STAGES: tuple[str, ...] = ("gpipe", "1f1b")
"""Schedules that run with fewer microbatches than stages (m < p): the pipeline never fills, each
stage warms up with every microbatch it can."""
_CHUNKS_PER_STAGE: dict[str, int] = {"1f1b": 1, "zb-h1": 1, "zbv": 2}
"""Schedules that run a fixed number of chunks per stage."""


def size_errors(**sizes: int) -> list[str]:
    """Each of ``sizes`` that is not a positive integer, with the fix."""
    return [f"{key} must be a positive integer, got {key}={value!r}; use {key} >= 1"
            for key, value in sizes.items() if not isinstance(value, int) or value < 1]


def mesh_errors(tp: int, pp: int, dp: int | None, world_size: int | None, cp: int = 1) -> list[str]:
    """What keeps tp x cp x pp x dp from filling ``world_size`` ranks, with the numbers and the fix
    ([] when the world is unknown or filled). ``dp`` None is inferred as world / (tp x cp x pp), which
    needs the world to be a multiple of tp x cp x pp."""
    errs = size_errors(**{k: v for k, v in (("tp", tp), ("cp", cp), ("pp", pp), ("dp", dp), ("world_size", world_size))
                          if v is not None})
    if errs or world_size is None:
        return errs
    block, w = tp * cp * pp, world_size
    names = f"tp={tp} x cp={cp} x pp={pp}" if cp > 1 else f"tp={tp} x pp={pp}"
    axes = "tp x cp x pp" if cp > 1 else "tp x pp"
    if dp is None and w % block == 0:
        return []
    if dp is not None and block * dp == w:
        return []
    if dp is not None and w % block == 0:
        return [f"{names} x dp={dp} needs {block * dp} ranks, the world has {w}. Fix: dp={w // block} "
                f"(or leave dp unset: it is inferred as world / ({axes})), or start {block * dp} ranks"]
    multiples = ", ".join(str(block * k) for k in range(1, 4))
    return [f"{names} needs a multiple of {block} ranks, the world has {w} ({axes} x dp ranks: one "
            f"group of {block} per data-parallel replica). Fix: start {multiples}, ... ranks, or use a layout "
            f"that divides {w} ranks: {_layouts_for(w, tp, pp, cp)}"]


def _layouts_for(world: int, tp: int, pp: int, cp: int = 1) -> str:
    """A few tp x pp that divide ``world`` (at the given cp), the largest and closest to (tp, pp) first."""
    if world % cp:
        cp = 1
    rest = world // cp
    fits = [(t, p) for t in range(1, rest + 1) for p in range(1, rest + 1) if rest % (t * p) == 0]
    fits.sort(key=lambda f: (-f[0] * f[1], abs(f[0] - tp) + abs(f[1] - pp)))
    at = f" x cp={cp}" if cp > 1 else ""
    return ", ".join(f"tp={t}{at} x pp={p} (dp={rest // (t * p)})" for t, p in fits[:4])


def microbatch_errors(schedule: str, p: int, v: int, m: int, names: tuple[str, str, str] = ("p", "v", "m")) -> list[str]:
    """Every rule of ``schedule`` that (p, v, m) breaks, each with its numbers and the fix.

    The one statement of the microbatch rules: GPipe and 1F1B take any m (1F1B
    with m < p warms up min(p - r - 1, m) forwards on stage r, as Megatron-LM
    does: every stage then holds at most m activations and the bubble is
    (p-1)/m); the others need m >= p (their step pattern assumes a full
    pipeline); interleaved 1F1B needs m % p == 0
    (Megatron's rule); 1F1B and ZB-H1 run one chunk per stage, ZB-V two (its
    V); GPipe takes any m.
    ``names``: what the caller calls p, v and m (``("pp", "virtual_stages",
    "microbatches")`` for ``parallelize``), so the message speaks its words.
    """
    P, V, M = names
    errs = size_errors(**{P: p, V: v, M: m})
    if errs:
        return errs
    if schedule not in SCHEDULE_NAMES:
        return [f"unknown schedule {schedule!r}; known: {', '.join(SCHEDULE_NAMES)}"]
    if schedule in _CHUNKS_PER_STAGE and v != _CHUNKS_PER_STAGE[schedule]:
        errs.append(_chunks_per_stage_error(schedule, v, V))
    if schedule not in FEWER_MICROBATCHES_THAN_STAGES and p > 1 and m < p:
        errs.append(f"{schedule} needs at least one microbatch per stage: {M}={m} < {P}={p}. Use {M} >= {p} "
                    f"(more microbatches also shrink the bubble (p-1)/m), or '1f1b' or 'gpipe', which accept any {M}")
    if schedule == "interleaved" and m % p:
        below, above = (m // p) * p, (m // p + 1) * p
        fix = f"{M}={above}" if below == 0 else f"{M}={below} or {M}={above}"
        errs.append(f"interleaved 1F1B needs {M} to be a multiple of {P} (Megatron's rule): "
                    f"{M}={m}, {P}={p}, {M} % {P} = {m % p}. Use {fix}")
    return errs


def _chunks_per_stage_error(schedule: str, v: int, name: str) -> str:
    """The message for a schedule run with the wrong number of chunks per stage."""
    need = _CHUNKS_PER_STAGE[schedule]
    if need == 1:
        return (f"{schedule} runs one chunk per stage, got {name}={v}; use {name}=1, or 'interleaved' "
                f"(or 'zbv' for {name}=2) for {name} > 1")
    return f"{schedule} runs {need} chunks per stage (a V), got {name}={v}; use {name}={need}"


COMPILE_BACKENDS: tuple[str, ...] = ("inductor", "aot_eager", "eager")
"""``ParallelConfig.compile`` backends: Inductor's kernels; AOTAutograd's joint graph run by eager
kernels (the same bits as eager, compiled in a fraction of the time: for tests and debugging);
Dynamo's graphs alone."""


def compile_errors(compile) -> list[str]:
    """What is wrong with ``compile``, with the fix ([] when nothing)."""
    if compile not in (None, False, True) and compile not in COMPILE_BACKENDS:
        return [f"compile must be True (Inductor), False / None (eager) or one of {list(COMPILE_BACKENDS)}, "
                f"got {compile!r}"]
    return []


def sequence_parallel_errors(sequence_parallel, tp: int) -> list[str]:
    """What is wrong with ``sequence_parallel`` for ``tp`` ranks, with the fix ([] when nothing)."""
    if sequence_parallel not in (True, False, None):
        return [f"sequence_parallel must be True, False or None (on where it fits), got {sequence_parallel!r}"]
    if sequence_parallel and tp == 1:
        return ["sequence_parallel=True splits the tokens across the tensor-parallel ranks, and tp=1 has one: "
                "there is nothing to split. Fix: tp >= 2 (a tp that divides the heads and the sequence length), "
                "or sequence_parallel=None / False"]
    return []


OVERLAP_KINDS: tuple[str, ...] = ("tp", "p2p")
"""What ``ParallelConfig.overlap`` can put under compute: 'tp', sequence parallelism's all-gathers and
reduce-scatters decomposed with the GEMMs that read or write them (``passes/async_tp.py``); 'p2p', the
pipeline's receives posted as early as the exchanges allow (``schedules/early_receives.py``)."""


def overlap_kinds(overlap, tp: int, pp: int, sequence_parallel) -> frozenset[str]:
    """The kinds ``overlap`` puts under compute: the names given; for True those the layout has ('tp'
    with tp > 1 and sequence parallelism not off, 'p2p' with pp > 1); for None (the default) and False
    none: on CPU ranks neither measured faster at the reference sizes (``bench/overlap.py``), and
    neither has been measured on GPUs yet."""
    has = {"tp": tp > 1 and sequence_parallel is not False, "p2p": pp > 1}
    if overlap is True:
        return frozenset(k for k in OVERLAP_KINDS if has[k])
    if overlap is False or overlap is None:
        return frozenset()
    return frozenset([overlap] if isinstance(overlap, str) else overlap)


def overlap_errors(overlap, tp: int, pp: int, sequence_parallel) -> list[str]:
    """What is wrong with ``overlap`` for this layout, with the fix ([] when nothing). True overlaps
    whatever the layout has; a kind named explicitly must have something to overlap."""
    if overlap is True or overlap is False or overlap is None:
        return []
    names = [overlap] if isinstance(overlap, str) else overlap
    if not isinstance(names, (list, tuple, set, frozenset)) or not all(isinstance(n, str) for n in names):
        return [f"overlap must be True, False or a set of {list(OVERLAP_KINDS)}, got {overlap!r}"]
    unknown = sorted(set(names) - set(OVERLAP_KINDS))
    if unknown:
        return [f"overlap names {unknown}, which autopar does not know; use a set of {list(OVERLAP_KINDS)} "
                f"(or True for all, False for none)"]
    errs = []
    if "tp" in names and (tp == 1 or sequence_parallel is False):
        why = "tp=1 has no tensor-parallel collective" if tp == 1 else "sequence_parallel=False has none"
        errs.append(f"overlap={{'tp'}} decomposes sequence parallelism's all-gathers and reduce-scatters with the "
                    f"GEMMs next to them, and {why}. Fix: tp >= 2 with sequence_parallel=True (or None), or "
                    f"leave 'tp' out of overlap")
    if "p2p" in names and pp == 1:
        errs.append("overlap={'p2p'} posts the pipeline's receives early, and pp=1 has no pipeline. Fix: pp >= 2, "
                    "or leave 'p2p' out of overlap")
    return errs


EXPERT_DISPATCHERS: tuple[str, ...] = ("allgather", "alltoall")
"""How tokens travel to their experts under expert parallelism (``ParallelConfig.expert_dispatch``)."""


def expert_errors(ep: int, dispatcher: str, dp: int, tp: int, pp: int, dp_known: bool,
                  expert_tp: int | None = None) -> list[str]:
    """What keeps expert parallelism ``ep`` (and ``expert_tp``) from fitting the mesh, with the numbers
    and the fix ([] when it fits). With experts split by tp (the default) an expert group is made of
    data-parallel replicas, so ep divides dp; with whole experts (expert_tp=1) it is made of the
    stage's tp x dp ranks, so ep divides tp x dp."""
    errs = size_errors(ep=ep)
    if errs:
        return errs
    if dispatcher not in EXPERT_DISPATCHERS:
        errs.append(f"expert_dispatch must be one of {list(EXPERT_DISPATCHERS)}, got {dispatcher!r}")
    if expert_tp is not None and expert_tp not in (1, tp):
        errs.append(f"expert_tp={expert_tp}: each expert is split by tensor parallelism tp={tp} ways (expert_tp="
                    f"{tp}, the default) or kept whole on its rank (expert_tp=1). Fix: expert_tp in {sorted({1, tp})}")
        return errs
    whole = expert_tp == 1 and tp > 1
    if whole and ep == 1:
        errs.append(f"expert_tp=1 keeps each expert whole instead of splitting it tp={tp} ways, and that needs "
                    f"expert parallelism to place them: the tp ranks then share a replica's tokens and exchange "
                    f"them with the ranks holding their experts. Fix: ep > 1 (a divisor of tp x dp = {tp * dp}), "
                    f"or leave expert_tp unset (experts split by tp like the dense MLPs)")
        return errs
    grid, over = (tp * dp, "tp x dp") if whole else (dp, "dp")
    if ep > 1 and grid % ep:
        if not dp_known and not whole:
            errs.append(f"ep={ep} groups {ep} data-parallel replicas, and no dp or world size is given (dp=1). "
                        f"Fix: pass dp= (a multiple of {ep}) or world_size= ({ep * tp * pp} ranks or a multiple)"
                        + ("" if tp == 1 else f", or expert_tp=1 (whole experts: ep divides tp x dp)"))
        else:
            fits = [e for e in range(1, grid + 1) if grid % e == 0]
            what = ("an expert group is made of ep data-parallel replicas" if not whole
                    else "with whole experts (expert_tp=1) an expert group is made of ep of a stage's tp x dp ranks")
            errs.append(f"ep={ep} must divide {over}={grid}: {what} (tp={tp} x pp={pp} x dp={dp}). Fix: ep in "
                        f"{fits}, or dp a multiple of {ep} ({ep * tp * pp} ranks or a multiple)"
                        + ("" if whole or tp == 1 else ", or expert_tp=1 (whole experts: ep divides tp x dp)"))
    return errs


def optimizer_bytes_per_param(param_bytes: int) -> int:
    """Adam's state per parameter: moments m and v in fp32 (8 bytes), plus an fp32 master
    copy (4 more) when the parameters themselves are 16-bit (``param_bytes`` < 4: mixed
    precision, 12 bytes). autopar's 'bf16' precision autocasts fp32 parameters: 8 bytes."""
    return 8 if param_bytes >= 4 else 12


@dataclass(frozen=True)
class ParallelConfig:
    tp: int = 1
    """Tensor-parallel degree t: each layer's matrices are split t ways."""
    pp: int = 1
    """Pipeline stages p."""
    virtual_stages: int = 1
    """Model chunks per pipeline stage v (interleaved schedule when > 1)."""
    microbatches: int = 1
    """Microbatches m per step and data-parallel replica."""
    schedule: str = "1f1b"
    """'gpipe', '1f1b', 'interleaved', or the zero-bubble 'zb-h1' and 'zbv' (v=2, a V)."""
    dp: int | None = None
    """Data-parallel replicas d; None: world size / (tp * cp * pp) when the world is known, else 1."""
    world_size: int | None = None
    """Ranks that will run the program (checked against tp * cp * pp * dp when known)."""
    scatter_gather: bool = True
    """Send stage boundaries as 1/tp slices and all-gather them on arrival."""
    recompute: Recompute | str = Recompute.NONE
    """Activation recomputation: 'none', 'layer' (keep each layer's input) or 'chunk' (each chunk's input)."""
    precision: str = "fp32"
    """'fp32', or 'bf16': bf16 autocast with fp32 parameters, gradients and gradient reduction."""
    sequence_parallel: bool | None = False
    """Run the ops between a row-parallel all-reduce and the next column-parallel input (norms, dropout,
    residual adds) on 1/tp of the tokens (``passes/sequence_parallel.py``). None: on when tp > 1 and
    every all-reduce's value splits along its tokens (off, and the summary says why, when tp does not
    divide them); True: on, or an error naming the dim that does not split; False (the default): off.
    Off by default because on CPU gloo ranks, the only ones measured so far, it makes the tp=2 step
    slower (``bench/memory_features.py``, ``docs/sequence-parallel.md``); it cuts the activations
    kept by about (t-1)/t of the replicated region whatever the device."""
    compile: str | bool | None = None
    """Compile each chunk's forward and backward with ``torch.compile`` (``runtime/engine/compiled_chunks.py``):
    True or 'inductor' (Inductor's fused kernels), 'aot_eager' (AOTAutograd's graphs on eager kernels:
    eager's bits, quick to compile), 'eager'; None / False (the default): the chunks' graphs run op by op."""
    overlap: bool | frozenset[str] | None = None
    """What runs under compute: a set of ``OVERLAP_KINDS`` (an error when the layout has nothing of a
    kind named), True every kind the layout has, False none, or None (the default) what measured
    faster: 'tp' where sequence parallelism runs. 'tp' decomposes each of sequence parallelism's
    all-gathers with the GEMMs reading it (and each reduce-scatter with the GEMM writing it) into tp
    ring steps, one chunk multiplied while the next is in flight (``docs/sequence-parallel.md``);
    'p2p' posts each pipeline receive as early as the exchanges allow, so the message travels during
    the compute before its consumer (``docs/schedules.md``). Normalised to the frozenset of kinds.
    On the CPU gloo ranks measured (``bench/overlap.py``) 'tp' was faster at the larger sizes and
    within noise at the reference one; 'p2p' within noise (and NCCL, which waits for a batch of
    exchanges whole, would hold its batches on the early receives), so it is off unless asked for."""
    ep: int = 1
    """Expert-parallel degree e: each mixture-of-experts layer's E experts split into e groups of E/e whole
    experts, one per rank of an expert group of e data-parallel replicas (e divides d), and the tokens
    sent to the rank holding their expert (``passes/expert_parallel.py``). 1: experts stay whole on every
    replica (and are split like any MLP by tensor parallelism)."""
    expert_dispatch: str | None = None
    """How tokens reach their experts with ep > 1 (``EXPERT_DISPATCHERS``): 'alltoall' (the rows per expert
    are exchanged first, then each rank sends only the rows its peers' experts take, and gets their
    results back), or 'allgather' (every rank of the expert group gathers all the group's token rows,
    runs its experts on theirs, and the results are reduce-scattered back: static shapes, ep x the rows
    held). None (the default): 'alltoall', or 'allgather' with compiled chunks, whose graphs want static
    shapes. On CPU gloo ranks 'alltoall' measured faster at ep=4 (``bench/experts.py``): 'allgather' runs
    the experts' element-wise ops on ep x the rows."""
    expert_tp: int | None = None
    """How many ways tensor parallelism splits each expert under expert parallelism: tp (None, the
    default: every expert's MLP split like a dense one, expert groups made of e data-parallel replicas at
    one tp rank) or 1 (each expert whole on the rank holding it: the tp ranks of a replica share its
    token rows, each sends its share to the ranks holding their experts, and the results are gathered
    back over tp; expert groups are then e consecutive ranks of the stage's tp x dp, e divides tp x dp,
    so ep can grow with tp alone). Whole experts run each expert's GEMMs on its full width
    (``docs/experts.md``)."""
    loss_reduction: str = "tokens"
    """How the step's loss is made of its microbatches' (``docs/training.md``). 'tokens': when the traced
    loss is a mean-reduced cross-entropy / nll over targets with an ignore_index, microbatch i's loss
    is weighted by n_i / N (its counted targets over those of the whole global batch, every replica's),
    which is the one-device loss and gradient of the global batch whatever the padding; any other loss
    weights the microbatches equally. 'microbatch': always equally (the mean of the microbatch means)."""
    cp: int = 1
    """Context-parallel degree c: every activation's sequence dim split over c ranks, each holding S/c
    tokens of every sequence (the load-balanced layout under causal attention), attention exchanging
    keys and values around a ring of them (``docs/context-parallel.md``). The c ranks hold the same
    weights and the same rows of the batch; gradients are averaged over the d x c ranks, as over
    replicas. 1: off. Not combined with ep > 1 yet."""

    def __post_init__(self):
        if self.recompute not in RECOMPUTE:
            raise ConfigError(f"recompute must be one of {list(RECOMPUTE)}, got {self.recompute!r}")
        object.__setattr__(self, "recompute", Recompute(self.recompute))
        if self.loss_reduction not in LOSS_REDUCTIONS:
            raise ConfigError(f"loss_reduction must be one of {list(LOSS_REDUCTIONS)}, got {self.loss_reduction!r}: "
                             f"'tokens' (the default) averages a token loss over every counted target of the "
                             f"global batch, as one device does; 'microbatch' averages the microbatch means")
        if self.precision not in PRECISIONS:
            raise ConfigError(f"precision must be one of {list(PRECISIONS)}, got {self.precision!r}")
        for name in ("tp", "cp", "pp", "virtual_stages", "microbatches"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{name} must be >= 1, got {name}={getattr(self, name)}")
        if self.schedule not in SCHEDULE_NAMES:
            raise ConfigError(f"unknown schedule {self.schedule!r}; choose one of {list(SCHEDULE_NAMES)}")
        if self.virtual_stages > 1 and self.schedule not in ("interleaved", "gpipe", "zbv"):
            raise ConfigError(f"virtual_stages={self.virtual_stages} needs schedule='interleaved' (or 'gpipe', "
                             f"or 'zbv' for 2), got schedule={self.schedule!r}")
        errs = microbatch_errors(self.schedule, self.pp, self.virtual_stages, self.microbatches,
                                 names=("pp", "virtual_stages", "microbatches"))
        if errs:
            raise ConfigError("; ".join(errs))
        errs = sequence_parallel_errors(self.sequence_parallel, self.tp)
        if errs:
            raise ConfigError("; ".join(errs))
        errs = overlap_errors(self.overlap, self.tp, self.pp, self.sequence_parallel)
        if errs:
            raise ConfigError("; ".join(errs))
        object.__setattr__(self, "overlap", overlap_kinds(self.overlap, self.tp, self.pp, self.sequence_parallel))
        errs = compile_errors(self.compile)
        if errs:
            raise ConfigError("; ".join(errs))
        object.__setattr__(self, "compile", "inductor" if self.compile is True else (self.compile or None))
        errs = mesh_errors(self.tp, self.pp, self.dp, self.world_size, self.cp)
        if errs:
            raise ConfigError("; ".join(errs))
        if self.cp > 1 and self.ep > 1:
            raise ConfigError(f"cp={self.cp} with ep={self.ep}: context parallelism and expert parallelism do not "
                              f"combine yet (expert groups are cut from the data-parallel replicas, and the cp "
                              f"ranks of a replica would each route their own tokens). Fix: cp=1 (ep alone) or "
                              f"ep=1 (cp alone)")
        if self.expert_dispatch is None:
            object.__setattr__(self, "expert_dispatch", "allgather" if self.compile else "alltoall")
        errs = expert_errors(self.ep, self.expert_dispatch, self.data_parallel, self.tp, self.pp,
                             self.dp is not None or self.world_size is not None, self.expert_tp)
        if errs:
            raise ConfigError("; ".join(errs))

    @property
    def dp_source(self) -> str:
        """Where the data-parallel size comes from, for the summary."""
        if self.dp is not None:
            return "given (dp=)"
        cp = f" x cp {self.cp}" if self.cp > 1 else ""
        if self.world_size is not None:
            return f"inferred from the world size, {self.world_size} ranks / (tp {self.tp}{cp} x pp {self.pp})"
        return (f"by default: no dp and no world size at compile time, so materialize() needs exactly "
                f"{self.tp * self.cp * self.pp} ranks (compile with dp= or world_size= for more replicas)")

    @property
    def data_parallel(self) -> int:
        if self.dp is not None:
            return self.dp
        if self.world_size is not None:
            return self.world_size // (self.tp * self.cp * self.pp)
        return 1

    @property
    def mesh(self) -> MeshShape:
        return MeshShape(self.tp, self.pp, self.data_parallel, self.ep,
                         None if self.expert_tp in (None, self.tp) else self.expert_tp, cp=self.cp)
