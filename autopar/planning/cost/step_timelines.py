"""One layout's pipeline step drawn two ways: the planner's timeline and the runtime's.

``estimate_with_timeline`` is the estimate of a layout with its pipeline run through the
schedule simulator (eager sends, the model the planner ranks with), and that timeline, also
where the planner would keep the closed form (a pipeline over ``SIMULATION_LIMIT`` actions, or
no pipeline at all). ``runtime_step`` runs the same per-chunk costs through the lowered
schedule autopar's runtime executes (posted sends) and prices the iteration with that pipeline
in place of the planner's: what ``autopar simulate`` shows beside the estimate.
"""

from __future__ import annotations

from dataclasses import dataclass

from autopar.core.config import SPLIT_BACKWARD_SCHEDULES
from autopar.planning.cost.layout import Cluster, Layout
from autopar.planning.cost.models import ModelSpec
from autopar.planning.cost.pipeline_timeline import eager_timeline, lowered_timeline
from autopar.planning.cost.step_estimate import Estimate, estimate
from autopar.schedules import SimResult

__all__ = ["estimate_with_timeline", "RuntimeStep", "runtime_step"]


def estimate_with_timeline(spec: ModelSpec, cluster: Cluster, layout: Layout) -> tuple[Estimate, SimResult]:
    """(Estimate with the simulated pipeline, its SimResult) for one layout.

    For p = 1 there is no pipeline to simulate; the result is a one-stage run. A
    pipeline over ``SIMULATION_LIMIT`` actions is simulated here all the same
    (the Estimate keeps its closed-form pipeline time).
    """
    est = estimate(spec, cluster, layout, simulate=True)
    if est.sim is not None:
        return est, est.sim
    lay = est.layout
    if lay.p > 1:  # over SIMULATION_LIMIT for the planner, but asked for explicitly
        split = lay.schedule in SPLIT_BACKWARD_SCHEDULES
        sim = eager_timeline(lay.schedule, lay.p, lay.v, est.m, est.t_chunk_f, est.t_chunk_b, est.t_p2p,
                             (est.t_emb_f, est.t_emb_b), (est.t_head_f, est.t_head_b),
                             t_w=est.t_chunk_w if split else None, last_extra_w=est.t_head_w)
        return est, sim
    sim = eager_timeline("1f1b", 1, 1, est.m, est.t_chunk_f, est.t_chunk_b, 0.0,
                         (est.t_emb_f, est.t_emb_b), (est.t_head_f, est.t_head_b))
    return est, sim


@dataclass(frozen=True)
class RuntimeStep:
    """An estimate's step with the pipeline the runtime runs (the lowered schedule, posted sends)."""

    timeline: SimResult
    """The lowered schedule simulated with the estimate's per-chunk costs."""
    t_iter: float
    """The iteration's seconds with this pipeline in place of the estimate's."""
    tflops_per_gpu: float
    """TFLOP/s per GPU at ``t_iter`` (the FLOPs the estimate counts)."""


def runtime_step(est: Estimate) -> RuntimeStep:
    """``est``'s per-chunk costs through the lowered schedule, and the iteration it makes."""
    lay = est.layout
    split = lay.schedule in SPLIT_BACKWARD_SCHEDULES
    lowered = lowered_timeline(lay.schedule, lay.p, lay.v, est.m, est.t_chunk_f, est.t_chunk_b, est.t_p2p,
                               (est.t_emb_f, est.t_emb_b), (est.t_head_f, est.t_head_b),
                               t_w=est.t_chunk_w if split else None, last_extra_w=est.t_head_w)
    t_iter = est.t_iter - est.t_pipeline + lowered.step_time
    return RuntimeStep(lowered, t_iter, est.flops / (t_iter * est.cluster.gpus) / 1e12)
