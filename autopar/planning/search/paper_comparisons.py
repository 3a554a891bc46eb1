"""The paper's measured layout comparisons (Narayanan et al., SC21, sections 5.2, 5.4, 5.5), as
data, and the planner's ranking of each: the check that the cost model orders layouts as
the hardware did, not only that it prices the paper's own layouts well.

Each ``Comparison`` is one figure: a model, a GPU count, the batch sizes, and the layouts
the paper measured (``Candidate``: t, p and the micro-batch b; v and the schedule are the
planner's choice for that (t, p, b), as the paper ran interleaving "where p > 1 unless
stated"). ``rank`` evaluates every candidate through ``planner.search`` (the code path of
``autopar plan --tp --pp --micro-batch``) and orders them by predicted iteration time.

What was measured is reconstructed from our reading of the paper, not copied from it;
``Comparison.unsure`` says what we are unsure of, and docs/performance-model.md, section 11,
lists it.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from autopar.planning.cost.hardware import Hardware
from autopar.planning.cost.hardware_profile import resolve_hardware
from autopar.planning.cost.layout import Cluster
from autopar.planning.cost.models import ModelSpec
from autopar.planning.cost.step_estimate import Estimate
from autopar.planning.errors import PlanError
from autopar.planning.search.planner import SearchSpace, search

__all__ = ["Candidate", "Comparison", "Ranked", "COMPARISONS", "rank", "GPT_162B", "GPT_5_9B", "GPT_91B",
           "GPT_175B"]

GPT_162B = ModelSpec(layers=32, hidden=20480, heads=128, name="gpt-162b")
"""Fig. 13's model: 12 l h^2 (1 + 13/(12h) + (V+s)/(12 l h)) = 162.2e9 at l 32, h 20480 (a 128)."""
GPT_5_9B = ModelSpec(layers=32, hidden=3840, heads=32, name="gpt-5.9b")
"""Figs. 14 and 15's model: 5.87e9 parameters by the same formula."""
GPT_91B = ModelSpec(layers=72, hidden=10240, heads=80, name="gpt-91b")
"""Fig. 16's model: 91.1e9 parameters (the paper gives the size, not the shape: ours has
76B's width, 72 layers, 9 per stage at p = 8)."""
GPT_175B = ModelSpec(layers=96, hidden=12288, heads=96, name="gpt-175b")
"""GPT-3 175B (sections 5.2 and 5.7)."""


@dataclass(frozen=True)
class Candidate:
    """One measured layout: tensor and pipeline degrees and micro-batch; d = n / (t p)."""

    t: int
    p: int
    b: int = 1
    interleaved: bool | None = None
    """True/False fixes the schedule; None lets the planner pick v and the schedule."""
    scatter_gather: bool = True

    @property
    def label(self) -> str:
        sched = "" if self.interleaved is None else (" int" if self.interleaved else " 1F1B")
        sg = "" if self.scatter_gather else " no-sg"
        return f"t={self.t} p={self.p} b={self.b}{sched}{sg}"


@dataclass(frozen=True)
class Comparison:
    """One of the paper's measured comparisons."""

    key: str
    figure: str
    spec: ModelSpec
    gpus: int
    batches: tuple[int, ...]
    candidates: tuple[Candidate, ...]
    measured_best: tuple[int, ...]
    """Index (into ``candidates``) of the measured fastest at each batch size."""
    measured_order: tuple[tuple[int, ...], ...] | None
    """Candidates from fastest to slowest per batch, where we trust the order (else None)."""
    unsure: str
    """What of this reconstruction we are not sure of."""


@dataclass(frozen=True)
class Ranked:
    """The planner's ranking of a comparison at one batch size."""

    comparison: Comparison
    batch: int
    estimates: tuple[Estimate, ...]
    """One per candidate, in the comparison's order."""

    @property
    def order(self) -> tuple[int, ...]:
        """Candidate indices, fastest first."""
        return tuple(sorted(range(len(self.estimates)), key=lambda i: self.estimates[i].t_iter))

    @property
    def best(self) -> int:
        return self.order[0]


def _estimate(comp: Comparison, cand: Candidate, batch: int, hw: Hardware) -> Estimate:
    """The planner's best layout at (t, p, b) of ``cand``: every v and schedule it may pick,
    layer recomputation, Megatron-LM 2021's features (no SP, no distributed optimizer, DDP
    overlap only without a pipeline); the fastest that fits, else the fastest at all."""
    scheds = ("1f1b", "interleaved") if cand.interleaved is None else (
        ("interleaved",) if cand.interleaved else ("1f1b",))
    space = SearchSpace(t=(cand.t,), p=(cand.p,), b=(cand.b,), schedules=scheds, recompute=("layer",),
                        sequence_parallel=(False,), distributed_optimizer=(False,), dp_overlap=True,
                        scatter_gather=cand.scatter_gather)
    plan = search(comp.spec, Cluster(comp.gpus, hw, batch), space, top=1, simulate_top=2)
    if plan.ranked:
        return plan.ranked[0]
    if plan.too_big:
        return plan.too_big[0]
    raise PlanError(f"{comp.key}: no valid layout for {cand.label} at batch {batch}: {plan.no_fit_message()}")


def rank(comp: Comparison, batch: int, hardware: str | Hardware = "dgx-a100-80gb") -> Ranked:
    """The planner's estimate of every candidate of ``comp`` at ``batch``."""
    hw = resolve_hardware(hardware)
    return Ranked(comp, batch, tuple(_estimate(comp, c, batch, hw) for c in comp.candidates))


def _tp(spec: ModelSpec, pairs: tuple[tuple[int, int], ...], b: int = 1) -> tuple[Candidate, ...]:
    return tuple(Candidate(t=t, p=p, b=b) for t, p in pairs)


COMPARISONS: tuple[Comparison, ...] = (
    Comparison(
        "tensor-vs-pipeline", "Fig. 13", GPT_162B, 64, (32, 128),
        _tp(GPT_162B, ((2, 32), (4, 16), (8, 8), (16, 4), (32, 2))),
        measured_best=(2, 2), measured_order=None,
        unsure="the model's shape (32 layers, h 20480: our derivation from 162.2B), the micro-batch (1), "
               "whether 512 was measured too; the order beyond the peak at t=8 p=8 "
               "(throughput falls on both sides)"),
    Comparison(
        "pipeline-vs-data", "Fig. 14", GPT_5_9B, 64, (32, 128, 512),
        _tp(GPT_5_9B, ((1, 2), (1, 4), (1, 8), (1, 16), (1, 32))),
        measured_best=(0, 0, 0), measured_order=((0, 1, 2, 3, 4),) * 3,
        unsure="whether interleaving was used (it cannot be at m < p)"),
    Comparison(
        "tensor-vs-data", "Fig. 15", GPT_5_9B, 64, (32, 128, 512),
        _tp(GPT_5_9B, ((2, 1), (4, 1), (8, 1), (16, 1), (32, 1))),
        measured_best=(0, 0, 0), measured_order=((0, 1, 2, 3, 4),) * 3,
        unsure="the micro-batch (1)"),
    Comparison(
        "micro-batch", "Fig. 16", GPT_91B, 64, (128, 512),
        tuple(Candidate(t=8, p=8, b=b) for b in (1, 2, 4, 8)),
        measured_best=(1, 1), measured_order=None,
        unsure="the model's shape (the paper gives 91B only), the GPU count (64: one pipeline, d = 1), "
               "the measured best b (2, as we recall)"),
    Comparison(
        "interleaved", "Fig. 12 (section 5.2)", GPT_175B, 96, (12, 24, 36, 48, 60),
        (Candidate(t=8, p=12, b=1, interleaved=True), Candidate(t=8, p=12, b=1, interleaved=False)),
        measured_best=(0,) * 5, measured_order=((0, 1),) * 5,
        unsure="the batch sizes (12 to 60) and v (the planner's); that the gap closes as the batch grows "
               "is the figure's trend, its size we do not recall"),
    Comparison(
        "scatter-gather", "Fig. 18 (section 5.7)", GPT_175B, 96, (12, 24, 36, 48, 60),
        (Candidate(t=8, p=12, b=1, interleaved=True), Candidate(t=8, p=12, b=1, interleaved=True,
                                                               scatter_gather=False)),
        measured_best=(0,) * 5, measured_order=((0, 1),) * 5,
        unsure="the batch sizes; the gain, up to 11% at the smallest batch, as we recall"),
)
"""Section 5.4's measured comparisons, and 5.5's micro-batch sweep, as we reconstruct them."""


def with_batches(comp: Comparison, batches: tuple[int, ...]) -> Comparison:
    """``comp`` at other batch sizes (measured fields repeated from its first batch)."""
    return replace(comp, batches=batches, measured_best=(comp.measured_best[0],) * len(batches),
                   measured_order=None if comp.measured_order is None else (comp.measured_order[0],) * len(batches))
