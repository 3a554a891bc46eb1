"""``autopar simulate``: one pipeline step drawn as a timeline (terminal and SVG).

Three sources: unit costs (``--pp --microbatches``, F = 1 and B = 2), a model's layout (fixed by
the flags or the planner's best: its estimated per-chunk costs), or a measured trace
(``--measured``: the run's per-action costs, its steps beside their simulation). The lowered
schedule autopar's runtime runs is drawn, or with ``--eager`` the planner's model.
"""

from __future__ import annotations

import argparse
import re
from dataclasses import replace

from rich.console import Console

from autopar.cli.layout_args import chunks_per_stage, cluster, fixed_layout, schedule_choices, search_space
from autopar.cli.model_args import model_spec
from autopar.cli.render import costs_table, measured_table
from autopar.core.config import SPLIT_BACKWARD_SCHEDULES, microbatch_errors
from autopar.planning.cost.models import ModelSpec
from autopar.planning.cost.pipeline_timeline import runtime_schedule
from autopar.planning.cost.step_timelines import estimate_with_timeline, runtime_step
from autopar.planning.quantities import rate, seconds
from autopar.planning.search.planner import search
from autopar.schedules import Sends, SimResult, generate, simulate

__all__ = ["run_simulate"]


def run_simulate(args: argparse.Namespace, console: Console) -> int:
    """``autopar simulate``: print the timeline, write the SVG."""
    from autopar.planning.drawing.timeline import timeline_text, write_svg  # noqa: PLC0415  (rich pictures, only here)

    if args.measured:
        return _simulate_measured(args, console)
    spec = model_spec(args)
    width = args.width or max(40, console.width - 10)
    if spec is None:
        eager, lowered, title, unit, notes = _unit_cost_timelines(args)
    else:
        eager, lowered, title, unit, notes = _model_timelines(args, spec, console)
    sim = eager if args.eager else lowered
    console.print(title, style="bold", highlight=False)
    for note in notes:
        console.print(note, highlight=False)
    console.print(timeline_text(sim, width=width, unit=unit))
    if args.svg:
        write_svg(sim, args.svg, title=title, unit=unit, notes=tuple(notes), width=args.svg_width or None)
        console.print(f"wrote {args.svg}")
    return 0


def _simulate_measured(args: argparse.Namespace, console: Console) -> int:
    """``autopar simulate --measured TRACE``: the trace's steps against their simulation, one SVG
    (measured above predicted) and one Perfetto trace with both."""
    from autopar.planning.drawing.measured_vs_predicted import write_comparison_svg  # noqa: PLC0415  (only here)
    from autopar.planning.measured.comparison import compare  # noqa: PLC0415
    from autopar.planning.measured.trace_reader import read_trace  # noqa: PLC0415
    from autopar.runtime.engine.timeline import write_chrome_trace  # noqa: PLC0415  (loads torch)

    console.print(f"reading {args.measured} ...", highlight=False)
    run = read_trace(args.measured)
    sched = run.schedule
    console.print(f"{sched.name} p={sched.p} v={sched.v} m={sched.m}, {run.shape.world} ranks, {len(run.steps)} steps: "
                  f"simulating each (the first is a warm-up) ...", highlight=False)
    comp = compare(run)
    console.print(measured_table(comp), crop=False)
    console.print(costs_table(comp), crop=False)
    console.print(comp.summary(), style="bold", highlight=False)
    if args.svg:
        write_comparison_svg(comp, args.svg, title=f"measured vs predicted: {args.measured}",
                             width=args.svg_width or 1400)
        console.print(f"wrote {args.svg}", highlight=False)
    out = args.trace_out or re.sub(r"(\.json)?$", "-vs-predicted.json", args.measured, count=1)
    measured, predicted = comp.measured_events(), comp.predicted_events()
    world = run.shape.world
    events = [e for evs in measured.values() for e in evs]
    events += [replace(e, rank=world + r) for r, evs in predicted.items() for e in evs]
    names = {r: f"rank {r}" for r in measured} | {world + r: f"rank {r} (predicted)" for r in predicted}
    write_chrome_trace(events, out, process_names=names)
    console.print(f"wrote {out} (open in ui.perfetto.dev: measured step {comp.shown_step} and the prediction)",
                  highlight=False)
    return 0


def _unit_cost_timelines(args: argparse.Namespace) -> tuple[SimResult, SimResult, str, str, list[str]]:
    """(eager, lowered, title, unit, notes) of a schedule with F = 1 and B = 2."""
    if args.pp is None or args.microbatches is None:
        raise SystemExit("autopar simulate: give a model and cluster, or --pp and --microbatches (unit costs)")
    v = chunks_per_stage(args.schedule, args.vp)
    name = schedule_choices(args.schedule, v)[0]
    errs = microbatch_errors(name, args.pp, v, args.microbatches, names=("--pp", "--vp", "--microbatches"))
    if errs:
        raise SystemExit("autopar simulate: " + "; ".join(errs))
    # a split backward (zero-bubble) costs as much as a whole one: B = W = 1, half of it each
    eager = simulate(generate(name, args.pp, v, args.microbatches), 1.0, 2.0, sends=Sends.EAGER, cost_w=1.0)
    lowered = simulate(runtime_schedule(name, args.pp, v, args.microbatches), 1.0, 2.0, sends=Sends.POSTED,
                       cost_w=1.0)
    costs = "F = 1, B = 1, W = 1 (the backward's 2 split)" if name in SPLIT_BACKWARD_SCHEDULES else "F = 1, B = 2"
    title = f"{name} p={args.pp} v={v} m={args.microbatches}, unit costs ({costs})"
    other = lowered if args.eager else eager
    notes = [f"{'lowered schedule (autopar runtime)' if args.eager else 'eager sends (the planner model)'}: "
             f"step {other.step_time:.4g} units, bubble {other.bubble:.1%}"]
    return eager, lowered, title, "units", notes


def _model_timelines(args: argparse.Namespace, spec: ModelSpec,
                     console: Console) -> tuple[SimResult, SimResult, str, str, list[str]]:
    """(eager, lowered, title, unit, notes) of the given layout of ``spec``, or of the planner's best."""
    if args.gpus is None or args.batch is None:
        raise SystemExit("autopar simulate: a model needs --gpus and --batch")
    cl = cluster(args)
    space = search_space(args, spec, cl.hardware)
    if all(x is not None for x in (args.tp, args.pp, args.micro_batch)):
        lay = fixed_layout(args, space)
    else:
        lay = search(spec, cl, space, top=1).best.layout
    if lay.p == 1:
        console.print(f"[yellow]{lay.short} has no pipeline (p = 1): the timeline is one rank.[/yellow]")
    est, eager = estimate_with_timeline(spec, cl, lay)
    split = lay.schedule in SPLIT_BACKWARD_SCHEDULES
    runtime = runtime_step(est)
    lowered = runtime.timeline
    title = f"{spec.label}, {lay.short}, {cl.gpus} GPUs, batch {cl.global_batch}"
    notes = [f"lowered schedule (autopar's runtime): pipeline {seconds(lowered.step_time, 4)}, bubble "
             f"{lowered.bubble:.1%}, iteration {seconds(runtime.t_iter, 4)}, "
             f"{rate(runtime.tflops_per_gpu * 1e12, 'FLOP', 4)}/GPU",
             f"eager sends (the planner's model, Megatron-LM-like): pipeline {seconds(eager.step_time, 4)}, bubble "
             f"{eager.bubble:.1%}, iteration {seconds(est.t_iter, 4)}, "
             f"{rate(est.tflops_per_gpu * 1e12, 'FLOP', 4)}/GPU",
             f"per chunk and microbatch: forward {est.t_chunk_f * 1e3:.3g} ms, backward (+recompute) "
             f"{est.t_chunk_b * 1e3:.3g} ms" + (f" (W: {est.t_chunk_w * 1e3:.3g} ms)" if split else "")
             + f", one send {est.t_p2p * 1e3:.3g} ms; drawn: "
             + ("eager sends" if args.eager else "the lowered schedule")]
    return eager, lowered, title, "s", notes
