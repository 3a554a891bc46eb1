"""A compiled program priced by the cost model: ``program.summary(hardware=...)``.

The program's layout (its degrees, chunks per stage, schedule, microbatches, recomputation, sequence
parallelism, compiled or eager chunks, precision) and its model's dimensions (read from its traced
graph, as ``autopar.plan`` reads them) are priced on a preset or on a profile ``autopar tune`` wrote,
as the planner prices a layout: the step, where it goes, the fullest stage's memory per rank, and which
of the profile's measurements of this model priced it (``measured_note``, as ``autopar plan`` says it).
The distributed optimizer is the ranks' choice at run time (``engine.distributed_optimizer``), so it is
a question to the pricing, not a fact of the program.
"""

from __future__ import annotations

from typing import Any

from autopar.compiler.example_batch import example_micro_batch, example_seq_len
from autopar.compiler.model_spec import SpecError, spec_from_graph
from autopar.core.config import Recompute
from autopar.core.errors import AutoparError
from autopar.planning.cost.hardware import Hardware
from autopar.planning.cost.hardware_profile import resolve_hardware
from autopar.planning.cost.layout import PRICED_RECOMPUTE, Cluster, Layout, layout_errors
from autopar.planning.cost.precision import runtime_precision
from autopar.planning.cost.step_estimate import Estimate, estimate
from autopar.planning.quantities import nbytes, rate, seconds
from autopar.planning.search.measured_note import measured_note
from autopar.planning.search.planner import memory_line

Program = Any
"""A ``autopar.compiler.program.Program`` (which imports the summary, and so this module)."""

__all__ = ["program_layout", "program_estimate", "predicted_lines"]


def program_layout(program: Program, distributed_optimizer: bool = False) -> Layout:
    """The cost model's ``Layout`` of ``program``: what it was compiled for, the gradients reduced as
    the runtime reduces them (overlapped, bucket by bucket), the distributed optimizer as asked."""
    cfg = program.config
    recompute = Recompute(cfg.recompute)
    if recompute not in PRICED_RECOMPUTE:
        raise AutoparError(f"the program recomputes {str(recompute)!r}, which the cost model does not price (it "
                           f"prices {', '.join(str(r) for r in PRICED_RECOMPUTE)}): compile with recompute='layer' "
                           f"or 'none' to see its predicted cost")
    return Layout(t=cfg.tp, p=cfg.pp, d=cfg.data_parallel, b=example_micro_batch(program), v=cfg.virtual_stages,
                  schedule=cfg.schedule, recompute=recompute, scatter_gather=cfg.scatter_gather, dp_overlap=True,
                  sequence_parallel=bool(cfg.sequence_parallel) and cfg.tp > 1,
                  distributed_optimizer=distributed_optimizer, ep=cfg.ep,
                  expert_dispatch=cfg.expert_dispatch or "allgather", cp=cfg.cp,
                  fused_kernels=bool(cfg.compile), precision=runtime_precision(cfg.precision))


def program_estimate(program: Program, hardware: str | Hardware,
                     distributed_optimizer: bool = False) -> tuple[Estimate, list[str]]:
    """(the estimate of ``program``'s step on ``hardware``, the rules its layout breaks there: memory
    that does not fit, a degree a node cannot hold), the schedule simulated as the runtime runs it."""
    hw = resolve_hardware(hardware)
    try:
        spec = spec_from_graph(program.traced.gm, set(program.traced.param_of), example_seq_len(program),
                               type(program.model).__name__)
    except SpecError as e:
        raise AutoparError(f"the program's model cannot be priced: {e}") from None
    lay = program_layout(program, distributed_optimizer)
    global_batch = lay.b * program.config.microbatches * lay.d
    cluster = Cluster(lay.world, hw, global_batch)
    errors = layout_errors(spec, cluster, lay, divisible_layers=False, runnable=False)
    return estimate(spec, cluster, lay, simulate=lay.p > 1), errors


def predicted_lines(program: Program, hardware: str | Hardware, distributed_optimizer: bool = False) -> list[str]:
    """The summary's "predicted" section: the step, where it goes, memory per rank, what priced it."""
    est, errors = program_estimate(program, hardware, distributed_optimizer)
    hw, lay = est.cluster.hardware, est.layout
    b = est.breakdown
    runtime = b.get("runtime", 0.0) + b.get("runtime_step", 0.0)
    lines = [f"predicted on {est.cluster.gpus} x {hw.gpu} ({hw.name}):",
             f"  {lay.short}, global batch {est.cluster.global_batch} = {lay.b} x {est.m} microbatches x {lay.d} "
             "replicas",
             f"  step {seconds(est.t_iter)}, {rate(est.tflops_per_gpu * 1e12, 'FLOP')} per rank",
             f"  pipeline {seconds(est.t_pipeline)} (bubble {est.bubble:.1%}), gradient reduction exposed "
             f"{seconds(est.t_dp_exposed)}, optimizer {seconds(est.t_optimizer)}",
             *([f"  of which the runtime's own overheads {seconds(runtime)} (graph nodes, actions, recomputed "
                "regions, the step)"] if runtime else []),
             f"  memory per rank (fullest stage): {memory_line(est)}",
             f"  usable per rank: {nbytes(hw.usable_bytes)}" + ("" if est.fits else ": does not fit")]
    note = measured_note(est.spec, hw, est, layout="this program")
    if note:
        lines.append(f"  {note}")
    lines += [f"  not as priced: {e}" for e in errors]
    return lines
