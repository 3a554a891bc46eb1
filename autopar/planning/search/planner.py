"""Search over 3D-parallel layouts for a model on a cluster, ranked by the
performance model (``autopar.planning.cost.step_estimate``).

The space is (t, cp, p, d, v, micro-batch b, schedule, recomputation, sequence
parallelism (when t > 1), distributed optimizer (when d cp > 1), and for a
mixture-of-experts model expert parallelism ep with its dispatcher):

- t divides the GPUs of a node (tensor parallelism on NVLink) or is a power-of-two
  multiple of it (the group spans nodes), and divides the head count, key/value
  head count and MLP width;
- cp (context parallelism) divides n / t and cuts the sequence into equal chunks: s divisible by
  2 cp (causal attention, the load-balanced layout) or cp (bidirectional); tried for sequences of
  at least ``SearchSpace.long_sequence`` tokens unless named (``SearchSpace.cp``);
- p divides n / (t cp) and p * v chunks fit the layers (divide them, by default,
  as Megatron requires);
- d = n / (t cp p); b divides B / d, so m = B / (d b) microbatches;
- 1F1B and GPipe run any m (with m < p stages idle: the bubble (p-1)/m); interleaved
  needs v > 1 and m a multiple of p; the zero-bubble ZB-H1 (v = 1) and ZB-V (v = 2,
  a V) need m >= p. A rejection names the schedule whose rule it is
  (``zb-h1: m < p``), so a 1F1B layout with m < p in the ranking and zero-bubble
  ones rejected for the same m are not a contradiction;
- ep divides d and the E experts (each rank of an expert group of ep data-parallel replicas
  holds E/ep whole experts); with ep > 1 both dispatchers ('allgather', 'alltoall') are tried;
- the layout's memory on its fullest stage fits in the GPU.

Every candidate is scored with the closed-form pipeline time (the bubble
(p-1)/(v m)); the best ``simulate_top`` are then re-scored by running their real
schedule through the schedule simulator (``autopar.planning.cost.pipeline_timeline``) and re-ranked.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field, replace

from autopar.core.config import Recompute
from autopar.planning.cost.calibration import PAPER_RUNS, PaperRun
from autopar.planning.cost.layout import PRICED_RECOMPUTE, Cluster, Layout, layout_errors
from autopar.planning.cost.memory import memory_per_gpu
from autopar.planning.cost.models import ModelSpec, params_per_stage
from autopar.planning.cost.step_estimate import Estimate, estimate
from autopar.planning.errors import PlanError
from autopar.planning.quantities import binary_unit, count, nbytes, rate, seconds
from autopar.planning.search.sensitivity import flip_lines, memory_margin_line
from autopar.planning.search.versus import term_lines

__all__ = ["SearchSpace", "Plan", "search", "candidate_layouts", "why_differs", "paper_run_for",
           "memory_line", "tensor_parallel_degrees", "context_parallel_degrees", "best_by_context_degree"]


def _divisors(n: int) -> list[int]:
    return [k for k in range(1, n + 1) if n % k == 0]


@dataclass(frozen=True)
class SearchSpace:
    """What the planner may choose; a field set to a tuple restricts it."""

    t: tuple[int, ...] | None = None
    """Tensor-parallel degrees to try (None: every valid one)."""
    p: tuple[int, ...] | None = None
    """Pipeline degrees to try (None: every valid one)."""
    v: tuple[int, ...] | None = None
    """Chunks per stage to try (None: every valid one)."""
    b: tuple[int, ...] | None = None
    """Micro-batch sizes to try (None: every divisor of B/d up to ``max_micro_batch``)."""
    schedules: tuple[str, ...] = ("1f1b", "interleaved", "zb-h1", "zbv")
    """Pipeline schedules to consider ('gpipe' too if asked: same time as 1F1B, more memory)."""
    recompute: tuple[Recompute | str, ...] = PRICED_RECOMPUTE
    """Activation recomputation choices (``core.config.Recompute``): 'layer' and 'none'."""
    dp_overlap: bool = False
    """Whether layouts without a pipeline (p = 1) overlap the gradient all-reduce
    with the backward (PyTorch DDP does; Megatron's 2021 local DDP did not)."""
    pipeline_dp_overlap: bool = False
    """The same for pipelined layouts (p > 1). Megatron-LM 2021 could not: its
    pipeline schedules had no ``no_sync`` for PyTorch DDP, so pipelined runs used
    its local DDP and all-reduced after the flush. autopar's runtime can."""
    scatter_gather: bool = True
    """Scatter/gather pipeline sends (always at least as fast)."""
    divisible_layers: bool = True
    """Require layers % (p v) == 0 (Megatron's rule); False allows layers >= p v."""
    max_micro_batch: int = 64
    """Largest micro-batch tried."""
    sequence_parallel: tuple[bool, ...] = (False, True)
    """Sequence parallelism choices, tried when t > 1 (it changes nothing at t = 1)."""
    distributed_optimizer: tuple[bool, ...] = (False, True)
    """Distributed optimizer choices, tried when d > 1 (it changes nothing at d = 1)."""
    cp: tuple[int, ...] | None = None
    """Context-parallel degrees to try (None: for a sequence of at least ``long_sequence`` tokens every
    divisor of n / t that cuts it into equal chunks, ``context_parallel_degrees``; cp = 1 below)."""
    long_sequence: int = 8192
    """The shortest sequence for which the search tries cp > 1 of its own accord. Below it a rank's
    s/cp tokens are what a smaller micro-batch or a larger d gives without the ring, and the ranking
    would fill with such near twins; name ``cp`` to price any length."""
    ep: tuple[int, ...] | None = None
    """Expert-parallel degrees to try for a mixture-of-experts model (None: every divisor of d that
    divides E); a dense model runs ep = 1."""
    expert_dispatch: tuple[str, ...] = ("allgather", "alltoall")
    """Dispatchers tried with ep > 1."""
    fused_kernels: bool = True
    """What every layout's chunks are assumed to run: fused element-wise kernels (Megatron's, autopar
    compiled with ``compile=True``) or, False, op by op (autopar's eager chunks). Not searched: it is
    how the program will run, and the plan says which it assumed."""
    include_unrunnable: bool = False
    """Also price layouts that break only the schedule's rules (``layout.runtime_errors``, e.g.
    interleaved with m % p != 0), closed form, marked ``Estimate.runnable`` False; for a layout
    the user fixes, so the answer is a prediction and the fix rather than nothing."""

    @classmethod
    def megatron_2021(cls, **overrides) -> "SearchSpace":
        """The choices the paper's Megatron-LM (2021) had: full (layer) recomputation, 1F1B or
        interleaved 1F1B, no sequence parallelism, no distributed optimizer; for reproducing its
        layouts. ``overrides`` set any other field."""
        fields = dict(recompute=("layer",), schedules=("1f1b", "interleaved"), sequence_parallel=(False,),
                      distributed_optimizer=(False,))
        return cls(**{**fields, **overrides})

    def overlap_for(self, p: int) -> bool:
        """Whether a layout with ``p`` stages overlaps its gradient all-reduce."""
        return self.dp_overlap if p == 1 else self.pipeline_dp_overlap


@dataclass
class Plan:
    """The outcome of a search."""

    spec: ModelSpec
    cluster: Cluster
    space: SearchSpace
    ranked: list[Estimate]
    """Layouts that fit, fastest first (the head of the list simulated)."""
    too_big: list[Estimate]
    """Layouts that do not fit in memory, fastest first (for the explanation)."""
    rejected: dict[str, int] = field(default_factory=dict)
    """Why candidates were dropped: rule -> count."""
    evaluated: int = 0
    """Layouts scored."""
    seconds: float = 0.0
    """Wall time of the search."""
    reference: Estimate | None = None
    """The paper's (or the user's) layout, evaluated the same way, if any."""

    @property
    def best(self) -> Estimate:
        if not self.ranked:
            raise PlanError(self.no_fit_message())
        return self.ranked[0]

    def no_fit_message(self) -> str:
        lines = [f"no layout of {self.spec.label} fits on {self.cluster.gpus} x "
                 f"{self.cluster.hardware.gpu} with batch {self.cluster.global_batch}"]
        for e in self.too_big[:3]:
            lines.append(f"  {e.layout.short}: needs {e.memory.total / 2**30:.1f} GiB "
                         f"> {self.cluster.hardware.usable_bytes / 2**30:.1f} GiB usable")
        for rule, n in self.rejected.items():
            lines.append(f"  {n} candidates rejected: {rule}")
        return "\n".join(lines)

    def runner_up(self) -> Estimate | None:
        """The fastest ranked layout whose (t, p) differ from the best's: the real alternative
        (layouts that only change b or v are tuning, not a different decomposition)."""
        if not self.ranked:
            return None
        key = (self.best.layout.t, self.best.layout.p, self.best.layout.ep, self.best.layout.cp)
        return next((e for e in self.ranked[1:] if (e.layout.t, e.layout.p, e.layout.ep, e.layout.cp) != key), None)

    def compared_with(self) -> tuple[Estimate | None, str]:
        """What the best is explained against: the reference layout if there is one, else the runner-up."""
        if self.reference is not None:
            return self.reference, "the reference"
        return self.runner_up(), "the runner-up"

    def why(self) -> list[str]:
        """How the best layout compares with the reference (or, without one, with the
        fastest layout of another (t, p)), in words and numbers; which faster layouts were
        dropped because they do not fit; how far the model's uncertain inputs would have to
        move for the other layout to be as fast; and a warning when the best barely fits."""
        other, label = self.compared_with()
        if other is None:
            return []
        best = self.best
        lines = why_differs(best, other, label) + self.too_big_lines()
        if best.layout != other.layout:
            lines += flip_lines(best, other)
        if best.memory.total > best.cluster.hardware.usable_bytes - 0.02 * best.cluster.hardware.hbm_bytes:
            lines.append(memory_margin_line(best))
        return lines

    def notes(self) -> list[str]:
        """What a reader of the ranking could take for a contradiction, explained: a ranked layout
        with fewer microbatches than stages (1F1B and GPipe run it; the rejections for m < p
        are other schedules')."""
        if not self.ranked:
            return []
        best = self.best
        kernels = ("kernels: fused between the GEMMs (Megatron's fused kernels; autopar compiled, compile=True)"
                   if best.layout.fused_kernels else
                   "kernels: op by op between the GEMMs (autopar's eager chunks: each element-wise op one pass)")
        if best.m >= best.layout.p or not best.runnable:  # an unrunnable row lists its broken rules
            return [kernels]
        others = sorted(rule.split(":")[0] for rule in self.rejected if rule.endswith("m < p"))
        also = (f"; the rejections for m < p are {', '.join(others)}'s rule (m >= p), not {best.layout.schedule}'s"
                if others else "")
        return [kernels, f"the best runs m={best.m} microbatches on p={best.layout.p} stages: {best.layout.schedule} "
                f"accepts m < p (stages idle, bubble {best.bubble:.1%}){also}"]

    def too_big_lines(self, limit: int = 1) -> list[str]:
        """Near misses: layouts faster than the best that need at most 25% more memory than
        there is (the nearest to fitting first), with their memory."""
        if not self.ranked:
            return []
        best, usable = self.best, self.cluster.hardware.usable_bytes
        out = []
        faster = sorted((e for e in self.too_big if e.t_iter < best.t_iter and e.memory.total <= 1.25 * usable),
                        key=lambda e: e.memory.total)
        for e in faster[:limit]:
            out.append(f"  faster but does not fit: {e.layout.short} would be {best.t_iter / e.t_iter - 1:+.1%} "
                       f"faster than the best, but needs {memory_line(e)} "
                       f"> {usable / 2**30:.1f} GiB usable")
        return out


def candidate_layouts(spec: ModelSpec, cluster: Cluster, space: SearchSpace = SearchSpace(),
                      rejected: dict[str, int] | None = None):
    """Yield every layout of ``space`` that passes the divisibility rules; count the others."""
    n, B, G = cluster.gpus, cluster.global_batch, cluster.hardware.gpus_per_node
    rej = rejected if rejected is not None else {}

    def reject(errs: list[str], lay: Layout | None = None) -> None:
        key = _rule_of(errs, lay.schedule if lay is not None and lay.p > 1 else None)
        rej[key] = rej.get(key, 0) + 1

    ts = space.t or tensor_parallel_degrees(n, G)
    for t, cp in ((t, cp) for t in ts for cp in (space.cp or context_parallel_degrees(spec, n // t, space))):
        if n % (t * cp):
            reject([f"t={t} does not divide n"] if n % t else ["t*cp does not divide n"])
            continue
        ps = space.p or tuple(p for p in _divisors(n // (t * cp)) if p <= spec.layers)
        for p in ps:
            if (n // (t * cp)) % p:
                reject(["t*cp*p does not divide n"])
                continue
            d = n // (t * cp * p)
            if B % d:
                reject([f"global batch {B} is not divisible by d*b"])
                continue
            bs = space.b or tuple(b for b in _divisors(B // d) if b <= space.max_micro_batch)
            vs = _chunks_per_stage(spec, p, space)
            for b, v in ((b, v) for b in bs for v in vs):
                for sched, rc in ((s, rc) for s in _schedules_for(p, v, space) for rc in space.recompute):
                    for (sp, zero), (ep, disp) in ((f, e) for f in _memory_features(t, d * cp, space)
                                                   for e in _expert_choices(spec, d, space, cp)):
                        lay = Layout(t=t, p=p, d=d, b=b, v=v, schedule=sched, recompute=rc,
                                     scatter_gather=space.scatter_gather, dp_overlap=space.overlap_for(p),
                                     sequence_parallel=sp, distributed_optimizer=zero, ep=ep,
                                     expert_dispatch=disp, cp=cp, fused_kernels=space.fused_kernels)
                        errs = layout_errors(spec, cluster, lay, space.divisible_layers,
                                             runnable=not space.include_unrunnable)
                        if errs:
                            reject(errs, lay)
                        else:
                            yield lay


def tensor_parallel_degrees(n: int, G: int) -> tuple[int, ...]:
    """The t a search tries on n GPUs, G per node: the divisors of G (the group on NVLink) and
    the multiples of G that divide n (the group spans whole nodes, its all-reduces cross
    InfiniBand: priced, and rarely the fastest, but a layout people run)."""
    inside = [t for t in _divisors(G) if n % t == 0]
    across = [t for t in range(2 * G, n + 1, G) if n % t == 0 and (t // G) & (t // G - 1) == 0]
    return tuple(inside + across)


def context_parallel_degrees(spec: ModelSpec, ranks: int,
                             space: SearchSpace = SearchSpace()) -> tuple[int, ...]:
    """The cp a search tries with ``ranks`` = n / t GPUs per tensor-parallel rank: the divisors of
    ``ranks`` that cut the sequence into equal chunks (2 cp of them for causal attention, cp
    bidirectional); cp = 1 always, and alone for a sequence shorter than ``space.long_sequence``."""
    if spec.seq_len < space.long_sequence:
        return (1,)
    chunks = 2 if spec.causal else 1
    return tuple(cp for cp in _divisors(ranks) if cp == 1 or spec.seq_len % (chunks * cp) == 0)


def _memory_features(t: int, d: int, space: SearchSpace) -> list[tuple[bool, bool]]:
    """(sequence parallelism, distributed optimizer) pairs to try: each of the space's choices
    where it can matter (t > 1, d > 1; d: the ranks holding the same parameters, d cp), off
    elsewhere."""
    sps = space.sequence_parallel if t > 1 else (False,)
    zeros = space.distributed_optimizer if d > 1 else (False,)
    return [(sp, zero) for sp in dict.fromkeys(sps) for zero in dict.fromkeys(zeros)]


def _expert_choices(spec: ModelSpec, d: int, space: SearchSpace, cp: int = 1) -> list[tuple[int, str]]:
    """(ep, dispatcher) pairs to try: ep = 1 for a dense model; for a mixture-of-experts one the
    space's ep (or every divisor of d that divides E), each ep > 1 with each of the space's
    dispatchers. An ep the space names that does not fit is tried, and rejected by its rule. A cp > 1
    the space does not name (the search's own) goes with ep = 1 only: expert parallelism beside
    context parallelism is not priced (``layout.context_errors``)."""
    if not spec.is_moe:
        choices = [(1, "alltoall")] if space.ep is None else [(ep, "alltoall") for ep in space.ep]
    else:
        eps = space.ep or tuple(k for k in _divisors(d) if spec.experts % k == 0)
        choices = [(ep, disp) for ep in eps for disp in (("alltoall",) if ep == 1 else space.expert_dispatch)]
    if cp > 1 and space.cp is None:
        return [c for c in choices if c[0] == 1]
    return choices


def _chunks_per_stage(spec: ModelSpec, p: int, space: SearchSpace) -> tuple[int, ...]:
    """The v to try with p stages: 1 without a pipeline, the space's, or every v whose p v
    chunks divide the layers (fill them, with ``divisible_layers=False``)."""
    if p == 1:
        return (1,)
    if space.v:
        return space.v
    if space.divisible_layers:
        return tuple(_divisors(spec.layers // p)) if spec.layers % p == 0 else (1,)
    return tuple(range(1, spec.layers // p + 1))


def _schedules_for(p: int, v: int, space: SearchSpace) -> list[str]:
    """The space's schedules that can run v chunks per stage (interleaved exactly when v > 1,
    ZB-H1 when v = 1, ZB-V when v = 2, GPipe always); 1F1B alone without a pipeline."""
    if p == 1:
        return ["1f1b"]
    fixed = {"1f1b": 1, "zb-h1": 1, "zbv": 2}
    return [s for s in space.schedules
            if s == "gpipe" or (v == fixed[s] if s in fixed else (s == "interleaved") == (v > 1))]


_RULES = (
    ("must divide the", "t must divide the GPUs of a node or be a multiple of it"),
    ("heads", "heads % t != 0"),
    ("ffn", "ffn % t != 0"),
    ("cannot fill", "layers < p*v"),
    ("must be divisible by p*v", "layers % (p*v) != 0"),
    ("not divisible by d*b", "batch % (d*b) != 0"),
    ("multiple of p", "interleaved: m % p != 0"),
    ("at least one microbatch", "{schedule}: m < p"),
    ("needs a pipeline", "v > 1 without a pipeline"),
    ("sequence parallelism splits", "sequence parallelism: seq_len % t != 0"),
    ("has none (experts=0)", "ep > 1 without experts"),
    ("an expert group is made of", "d % ep != 0"),
    ("whole experts. Fix", "experts % ep != 0"),
    ("expert_ffn", "expert_ffn % t != 0"),
    ("equal chunks", "seq_len % (2*cp) != 0 (causal; cp bidirectional)"),
    ("beside context parallelism", "ep > 1 with cp > 1 (not priced)"),
    ("ring attention", "cp > 1 with attention dropout (ring attention has none)"),
)


def _rule_of(errors: list[str], schedule: str | None = None) -> str:
    """The first rule of ``_RULES`` that one of ``errors`` breaks (else the first message); a
    schedule's own rule names it (``zbv: m < p``: 1F1B accepts the same m)."""
    for needle, rule in _RULES:
        if any(needle in message for message in errors):
            return rule.format(schedule=schedule or "the schedule")
    return errors[0]


def search(spec: ModelSpec, cluster: Cluster, space: SearchSpace = SearchSpace(), top: int = 10,
           simulate_top: int = 8, reference: Layout | None = None) -> Plan:
    """Rank every valid layout by predicted iteration time.

    All candidates get the closed-form estimate; the ``simulate_top`` fastest
    that fit are re-estimated with the event simulator running their real
    schedule, then re-ranked. ``reference`` (default: the paper's layout when
    the model, GPU count and batch are one of the paper's runs) is evaluated
    the same way, for ``Plan.why``.
    """
    t0 = time.perf_counter()
    rejected: dict[str, int] = {}
    fits: list[Estimate] = []
    too_big: list[Estimate] = []
    n_eval = 0
    for lay in candidate_layouts(spec, cluster, space, rejected):
        est = estimate(spec, cluster, lay, divisible_layers=space.divisible_layers,
                       runnable=not space.include_unrunnable)
        n_eval += 1
        (fits if est.fits else too_big).append(est)
    if too_big:
        rejected["does not fit in memory"] = len(too_big)
    fits.sort(key=lambda e: (not e.runnable, e.t_iter))  # what the runtime can run first
    too_big.sort(key=lambda e: e.t_iter)
    head = [_simulated(spec, cluster, e.layout, space) for e in fits[:simulate_top]]
    head = [e for e in head if e.fits]  # the real schedule can hold more than the closed form
    ranked = sorted(head, key=lambda e: (not e.runnable, e.t_iter)) + fits[simulate_top:top]
    ranked = ranked[:max(top, 1)]

    if reference is None:
        run = paper_run_for(spec, cluster)
        if run is not None:
            reference = replace(run.layout(), dp_overlap=space.overlap_for(run.p))
    ref_est = _simulated(spec, cluster, reference, space) if reference is not None else None
    return Plan(spec, cluster, space, ranked, too_big, rejected, n_eval, time.perf_counter() - t0, ref_est)


def best_by_context_degree(spec: ModelSpec, cluster: Cluster, space: SearchSpace) -> dict[int, Estimate | None]:
    """For each cp of ``space.cp``: the fastest layout of the space at that cp that fits (the rest of
    the space searched as ``search`` does), else the fastest that does not (``Estimate.fits`` False),
    else None (no valid layout): what context parallelism buys, degree by degree."""
    out: dict[int, Estimate | None] = {}
    for cp in space.cp or ():
        plan = search(spec, cluster, replace(space, cp=(cp,)), top=1, simulate_top=1)
        out[cp] = plan.ranked[0] if plan.ranked else (plan.too_big[0] if plan.too_big else None)
    return out


def _simulated(spec: ModelSpec, cluster: Cluster, lay: Layout, space: SearchSpace) -> Estimate:
    return estimate(spec, cluster, lay, simulate=True, divisible_layers=space.divisible_layers,
                    runnable=not space.include_unrunnable)


def paper_run_for(spec: ModelSpec, cluster: Cluster) -> PaperRun | None:
    """The paper's calibration row for this model, GPU count and batch, if there is one."""
    for run in PAPER_RUNS:
        rs = run.spec
        if ((rs.layers, rs.hidden, rs.heads, rs.seq_len, rs.vocab) ==
                (spec.layers, spec.hidden, spec.heads, spec.seq_len, spec.vocab)
                and spec.is_paper_gpt and run.gpus == cluster.gpus and run.batch == cluster.global_batch):
            return run
    return None


_PARTS = {
    "gemm": "GEMMs",
    "memory": "memory-bound kernels",
    "tp_comm": "tensor-parallel all-reduces",
    "ep_comm": "expert-parallel token exchange",
    "cp_comm": "context-parallel ring attention (exposed transfers)",
    "imbalance": "stage imbalance (embedding, LM head and loss on the end stages)",
    "p2p": "pipeline sends",
    "bubble": "pipeline bubble",
    "dp": "data-parallel all-reduce",
    "optimizer": "optimizer step",
    "runtime": "the runtime's overheads in the actions (graph nodes, actions, recomputed regions)",
    "runtime_step": "the runtime's overhead per step",
}


def _reason(part: str, a: Estimate, b: Estimate) -> str:
    """Why component ``part`` differs between a (best) and b (reference)."""
    la, lb = a.layout, b.layout
    if part in ("gemm", "memory"):
        why = []
        if la.recompute != lb.recompute:
            why.append("no recomputation saves one forward per layer (a quarter of the FLOPs)"
                       if la.recompute is Recompute.NONE else "recomputation adds one forward per layer")
        if la.t != lb.t:
            why.append(f"t={la.t} vs {lb.t}: GEMMs split t ways, LayerNorm/dropout/residual are not"
                       if part == "memory" else f"t={la.t} vs {lb.t} changes the GEMM shapes (N = h/t)")
        if part == "memory" and la.sp != lb.sp:
            why.append(f"sequence parallelism {'on' if la.sp else 'off'} vs {'on' if lb.sp else 'off'}: "
                       f"LayerNorm, dropout and residual adds on s/t tokens")
        if la.b != lb.b:
            why.append(f"micro-batch {la.b} vs {lb.b} changes the GEMM shapes (M = b s) and wave fill")
        if la.p != lb.p:
            why.append(f"p={la.p} vs {lb.p}: the LM head sits on one of {la.p} vs {lb.p} stages")
        return "; ".join(why)
    if part == "imbalance":
        return (f"one microbatch's head or embedding work beyond its 1/p share, on one of {la.p} vs {lb.p} stages, "
                f"m = {a.m} vs {b.m}")
    if part == "ep_comm":
        def what(e: Estimate) -> str:
            lay = e.layout
            return f"ep={lay.ep} {lay.expert_dispatch}" if lay.ep > 1 else "ep=1 (no exchange)"
        return (f"the routed rows (k b s of h per expert layer) travel to their experts and back: {what(a)} vs "
                f"{what(b)} (all-gather/reduce-scatter: ep S rows; all-to-all: (ep-1)/ep of S)")
    if part == "cp_comm":
        return (f"the key/value blocks travel the ring, cp-1 hops forward and again with the fp32 dK/dV "
                f"accumulators backward, hidden behind the attention's blocks where those take longer: "
                f"cp={la.cp} vs {lb.cp}")
    if part == "tp_comm":
        return (f"2 all-reduces of b s h per layer in forward and backward (and recompute), "
                f"t={la.t} b={la.b} vs t={lb.t} b={lb.b}")
    if part == "bubble" and {la.schedule, lb.schedule} & {"zb-h1", "zbv"}:
        return (f"{la.schedule} idles {a.bubble:.1%} of its work vs {lb.schedule} {b.bubble:.1%} "
                f"(zero-bubble: W fills the bubble)")
    if part == "bubble":
        return (f"(p-1)/(v m) = {la.p - 1}/({la.v}*{a.m}) = {(la.p - 1) / (la.v * a.m):.1%} vs "
                f"{lb.p - 1}/({lb.v}*{b.m}) = {(lb.p - 1) / (lb.v * b.m):.1%}")
    if part == "p2p":
        return f"{2 * a.m * la.v} vs {2 * b.m * lb.v} blocking sends per stage of b s h/t"
    if part == "dp":
        pa = max(params_per_stage(a.spec, la.t, la.p, la.ep))
        pb = max(params_per_stage(b.spec, lb.t, lb.p, lb.ep))
        G = a.cluster.hardware.gpus_per_node
        ka, kb = min(la.d, max(1, G // la.t)), min(lb.d, max(1, G // lb.t))
        over = "" if la.dp_overlap == lb.dp_overlap else (
            f"; overlapped with the backward: {la.dp_overlap} vs {lb.dp_overlap}"
            + (" (Megatron-LM 2021 overlaps only without a pipeline)" if (la.p > 1) != (lb.p > 1) else ""))
        zero = "" if la.distopt == lb.distopt else (
            f"; distributed optimizer {'on' if la.distopt else 'off'} vs {'on' if lb.distopt else 'off'} "
            f"(reduce-scatter overlapping the backward + all-gather after the step, the all-reduce's bytes)")
        return (f"{count(pa)} vs {count(pb)} gradients per GPU over d={la.d} vs {lb.d}, "
                f"a DP group has {ka} vs {kb} GPUs (NICs) per node{over}{zero}")
    if part == "optimizer":
        shard = "" if la.distopt == lb.distopt else (
            f"; the distributed optimizer steps 1/d of them (on in {'the best' if la.distopt else 'the other'})")
        return "optimizer step is memory-bound in the local parameter count" + shard
    return ""


def why_differs(best: Estimate, ref: Estimate, label: str = "the reference") -> list[str]:
    """Lines explaining how ``best`` compares with ``ref`` (called ``label``), largest causes first."""
    if best.layout == ref.layout:
        return [f"the best layout is {label} layout ({ref.layout.short})"]
    gain = ref.t_iter / best.t_iter - 1
    lines = [f"best {best.layout.short} is predicted {gain:+.1%} faster than {label} "
             f"{ref.layout.short}: {seconds(best.t_iter)} vs {seconds(ref.t_iter)} per iteration, "
             f"{rate(best.tflops_per_gpu * 1e12, 'FLOP')} vs {rate(ref.tflops_per_gpu * 1e12, 'FLOP')} per GPU"]
    if best.layout.recompute != ref.layout.recompute:
        lines.append("  (TFLOP/s count the FLOPs each layout executes: without recomputation "
                     "there are a quarter fewer, so compare iteration times)")
    deltas = {k: ref.breakdown[k] - best.breakdown[k] for k in best.breakdown}
    for k, dl in sorted(deltas.items(), key=lambda kv: -abs(kv[1])):
        if abs(dl) < 0.003 * ref.t_iter:
            continue
        reason = _reason(k, best, ref)
        lines.append(f"  {_PARTS[k]}: {seconds(best.breakdown[k])} vs {seconds(ref.breakdown[k])} "
                     f"({-dl / ref.t_iter:+.1%} of {label}'s iteration)" + (f"; {reason}" if reason else ""))
    usable = best.cluster.hardware.usable_bytes
    lines.append(f"  memory per GPU: {nbytes(best.memory.total)} vs {nbytes(ref.memory.total)} "
                 f"({nbytes(usable)} usable)")
    lines += feature_lines(best, ref, label)
    return lines + ["  the terms side by side (per iteration):"] + term_lines(best, ref, "best", "other")


def feature_lines(best: Estimate, ref: Estimate, label: str) -> list[str]:
    """How sequence parallelism and the distributed optimizer change ``best``'s memory, when
    ``best`` and ``ref`` differ in them: the formula and its saving in bytes."""
    lines, lay = [], best.layout
    if lay.sp != ref.layout.sp and lay.t > 1:
        other = memory_per_gpu(best.spec, replace(lay, sequence_parallel=not lay.sequence_parallel), best.m)
        lines.append(f"  sequence parallelism {'on' if lay.sp else 'off'} (vs {label}): activations "
                     f"s b h (34 + 5 a s/h)/t instead of s b h (10 + 24/t + 5 a s/(h t)): "
                     f"{nbytes(best.memory.activations)} vs {nbytes(other.activations)}")
    if lay.distopt != ref.layout.distopt and lay.d > 1:
        other = memory_per_gpu(best.spec, replace(lay, distributed_optimizer=not lay.distributed_optimizer), best.m)
        lines.append(f"  distributed optimizer {'on' if lay.distopt else 'off'} (vs {label}): optimizer state "
                     f"12/d instead of 12 bytes per parameter (d={lay.d}): {nbytes(best.memory.optimizer)} vs "
                     f"{nbytes(other.optimizer)}")
    return lines


def memory_line(e: Estimate) -> str:
    """``73.0 GiB (weights 6.6 + grads 6.6 + optimizer 39.8 + DDP buckets 6.6 + ...)``."""
    m = e.memory
    parts = [("weights", m.weights), ("grads", m.grads), ("optimizer", m.optimizer),
             ("DDP buckets", m.buffers)]
    act = ("fp32 grad copy of the step" if m.step_copy > 0 and m.activations == m.step_copy else "activations",
           m.activations)
    scale, unit = binary_unit(m.total)  # GiB, or the unit of a total below one
    body = " + ".join(f"{k} {v / scale:.1f}" for k, v in parts + [act] if v > 0)
    return f"{m.total / scale:.1f} {unit} ({body})"
