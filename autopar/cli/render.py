"""What the commands print: the console, and the tables of ``autopar plan`` (the ranked layouts,
the formulas, where the time goes, one layer's kernels) and of ``autopar simulate --measured``
(the measured steps, the per-action costs), each a ``compact_table`` that never cuts a number."""

from __future__ import annotations

import sympy as sp
from rich.console import Console
from rich.table import Table

from autopar.planning.cost.formulas import explain
from autopar.planning.cost.op_times import op_time
from autopar.planning.cost.step_estimate import Estimate
from autopar.planning.cost.transformer import layer_ops
from autopar.planning.drawing.tables import PIPED_WIDTH, compact_table
from autopar.planning.measured.comparison import Comparison
from autopar.planning.search.planner import Plan

__all__ = ["make_console", "plan_units", "plan_row", "plan_table", "shows_context_parallelism", "context_table",
           "breakdown_table", "ops_table", "explain_rows", "explain_table", "measured_table", "costs_table"]

GiB = 2**30

_SCHEDULE_LABELS = {"1f1b": "1F1B", "interleaved": "interl.", "gpipe": "GPipe", "zb-h1": "ZB-H1", "zbv": "ZB-V"}

PLAN_COLUMNS = ("#", "t", "p", "d", "v", "b", "m", "sched", "recomp", "SP", "DO", "iter s", "TFLOP/s",
                "peak", "GiB", "bubble", "comm s")
"""The plan table's headers, short so that the table fits 120 columns (the caption says each)."""


def make_console(width: int | None = None) -> Console:
    """The console the commands print to: ``width`` columns if given, else the terminal's, or
    ``PIPED_WIDTH`` when the output is not a terminal (rich would assume 80 and cut the tables).
    Tables are printed uncropped: in a terminal narrower than a table its lines run on (the
    terminal wraps them) rather than lose their last columns."""
    console = Console(width=width)
    if width is None and not console.is_terminal:
        console = Console(width=PIPED_WIDTH)
    return console


def plan_units(shown: list[Estimate]) -> dict[str, tuple[str, float]]:
    """The plan table's time, throughput and memory columns in units its rows read in: seconds, TFLOP/s
    and GiB for a cluster's plan; ms, GFLOP/s and MiB where every row shown is below one of those
    (two CPU ranks of a tuned profile). Header -> (the header shown, the value's multiplier)."""
    small = lambda values, limit: bool(values) and max(values) < limit  # noqa: E731
    out = {"iter s": ("iter s", 1.0), "comm s": ("comm s", 1.0), "TFLOP/s": ("TFLOP/s", 1.0), "GiB": ("GiB", 1 / GiB)}
    if small([e.t_iter for e in shown], 1.0):
        out |= {"iter s": ("iter ms", 1e3), "comm s": ("comm ms", 1e3)}
    if small([e.tflops_per_gpu for e in shown], 1.0):
        out["TFLOP/s"] = ("GFLOP/s", 1e3)
    if small([e.memory.total for e in shown], GiB):
        out["GiB"] = ("MiB", 1 / 2**20)
    return out


def plan_row(e: Estimate, experts: bool = False, context: bool = False,
             units: dict[str, tuple[str, float]] | None = None) -> list[str]:
    """One ranked layout's cells after its rank (``PLAN_COLUMNS[1:]``; with ``context`` the cp column
    after t; with ``experts`` the ep column after d: ``4 a2a``, ``2 ag``, or ``1``), in ``units``
    (``plan_units``; default seconds, TFLOP/s, GiB)."""
    k = {h: scale for h, (_, scale) in (units or plan_units([])).items()}
    lay = e.layout
    sched = _SCHEDULE_LABELS[lay.schedule] if lay.p > 1 else "-"
    ep = [f"{lay.ep} {'a2a' if lay.expert_dispatch == 'alltoall' else 'ag'}" if lay.ep > 1 else "1"] if experts else []
    cp = [str(lay.cp)] if context else []
    return [str(lay.t), *cp, str(lay.p), str(lay.d), *ep, str(lay.v), str(lay.b), str(e.m),
            sched + ("*" if e.simulated else "") + ("" if e.runnable else "!"), str(lay.recompute),
            "on" if lay.sp else "-", "on" if lay.distopt else "-",
            f"{e.t_iter * k['iter s']:.3f}", f"{e.tflops_per_gpu * k['TFLOP/s']:.1f}", f"{e.frac_peak:.1%}",
            f"{e.memory.total * k['GiB']:.1f}", f"{e.bubble:.1%}", f"{e.comm_time * k['comm s']:.3f}"]


def shows_context_parallelism(plan: Plan, top: int) -> bool:
    """Whether the plan table has a cp column: for a long sequence (one the search tries cp > 1 for,
    ``SearchSpace.long_sequence``), or when a row shown splits the sequence."""
    shown = plan.ranked[:top] + ([plan.reference] if plan.reference is not None else [])
    return plan.spec.seq_len >= plan.space.long_sequence or any(e.layout.cp > 1 for e in shown)


def plan_table(plan: Plan, top: int) -> Table:
    """The ``top`` ranked layouts, and the paper's layout when there is one."""
    hw = plan.cluster.hardware
    moe, context = plan.spec.is_moe, shows_context_parallelism(plan, top)
    units = plan_units(plan.ranked[:top] + ([plan.reference] if plan.reference is not None else []))
    rows = [[str(k), *plan_row(e, moe, context, units)] for k, e in enumerate(plan.ranked[:top], 1)]
    styles: list[str | None] = [None] * len(rows)
    if plan.reference is not None:
        rows.append(["paper", *plan_row(plan.reference, moe, context, units)])
        styles.append("yellow")
    headers = tuple(units.get(h, (h, 1.0))[0] for h in PLAN_COLUMNS)
    time_unit = units["iter s"][0].split()[-1]  # "s" or "ms"
    columns = headers[:2] + (("cp",) if context else ()) + headers[2:4] + (("ep",) if moe else ()) + headers[4:]
    experts = ("; ep: expert-parallel degree and dispatcher (ag = all-gather/reduce-scatter, a2a = all-to-all), "
               "whose exchanges comm includes" if moe else "")
    experts += ("; cp: context-parallel degree (the sequence split over cp ranks, ring attention), whose exposed "
                "ring transfers comm includes" if context else "")
    return compact_table(
        f"{plan.spec.label} on {plan.cluster.gpus} x {hw.gpu} ({hw.name}), global batch "
        f"{plan.cluster.global_batch}: {plan.evaluated} layouts in {plan.seconds:.2f} s", columns, rows,
        caption=f"ranked by predicted iteration time ({time_unit}); sched: schedule (interl. = interleaved 1F1B, "
                "* = simulated, "
                "! = priced but not runnable: the schedule's rules, listed below); recomp: recomputation; SP: "
                f"sequence parallelism; DO: distributed optimizer; {units['TFLOP/s'][0]} per GPU count the FLOPs "
                f"executed (recomputation included, as the paper counts); peak: of the GPU's peak; "
                f"{units['GiB'][0]} per GPU; comm: exposed tensor-parallel, pipeline and data-parallel "
                f"communication ({time_unit})" + experts,
        left=("sched", "recomp", "SP", "DO") + (("ep",) if moe else ()), styles=styles)


def context_table(best: dict[int, Estimate | None]) -> Table:
    """The fastest layout at each context-parallel degree (``planner.best_by_context_degree``): its
    iteration time, memory per GPU (activations apart), the ring's exposed seconds, and whether it fits."""
    rows = []
    for cp, e in best.items():
        if e is None:
            rows.append([str(cp), "no valid layout", "-", "-", "-", "-", "-"])
            continue
        rows.append([str(cp), e.layout.short, f"{e.t_iter:.3f}", f"{e.memory.total / GiB:.1f}",
                     f"{e.memory.activations / GiB:.1f}", f"{e.breakdown.get('cp_comm', 0.0):.3f}",
                     "yes" if e.fits else "no"])
    return compact_table("the fastest layout at each cp", ("cp", "layout", "iter s", "GiB", "act GiB", "ring s",
                                                             "fits"), rows, left=("layout", "fits"),
                         caption="GiB: memory per GPU; act: of which activations; ring: the ring attention's "
                                 "exposed transfers per iteration (s); a layout that does not fit is the fastest "
                                 "of those at that cp")


def breakdown_table(e: Estimate) -> Table:
    """Where an iteration's time goes, part by part."""
    rows = [[k, f"{v:.3f}", f"{v / e.t_iter:.1%}"] for k, v in e.breakdown.items()]
    rows.append(["iteration", f"{e.t_iter:.3f}", "100%"])
    return compact_table(f"where the time goes: {e.layout.short}", ("part", "seconds", "share"), rows,
                         left=("part",), styles=[None] * (len(rows) - 1) + ["bold"])


def ops_table(e: Estimate) -> Table:
    """One layer's forward kernels on one GPU (a mixture-of-experts model's expert layer): shapes,
    FLOPs, bytes and time."""
    hw, lay, moe = e.cluster.hardware, e.layout, e.spec.is_moe
    ops = layer_ops(e.spec, lay.b, lay.t, moe=moe, ep=lay.ep, dispatch=lay.expert_dispatch, cp=lay.cp)
    rows = [[op.name, op.kind, str(op.gemm) if op.gemm else "", f"{op.flops / 1e9:.2f}", f"{op.bytes / 1e6:.1f}",
             f"{op_time(op, hw, lay.t, lay.ep, lay.cp) * 1e6:.0f}"] for op in ops.forward]
    what = f"one expert layer (ep={lay.ep})" if moe else "one layer"
    ring = f", cp={lay.cp}: ring transfers end to end, before the overlap" if lay.cp > 1 else ""
    return compact_table(f"{what}, forward, on one GPU (b={lay.b}, t={lay.t}{ring})",
                         ("op", "kind", "GEMM (batch, M, N, K)", "GFLOP", "MB", "time (us)"), rows,
                         left=("op", "kind", "GEMM (batch, M, N, K)"))


def explain_rows(e: Estimate) -> list[tuple[str, str, str, str]]:
    """(name, what it is, formula, value) of each of the paper's formulas for ``e``."""
    rows = []
    for x in explain(e):
        val = f"{x.value:.4g}" + (f" {x.unit}" if x.unit else "")
        rows.append((x.key, x.description, sp.sstr(x.expr), val))
    return rows


def explain_table(e: Estimate) -> Table:
    """Name and value (never cut), then the formula and under it what it is (wrapped at spaces)."""
    rows = [[name, value, f"{formula}\n{what}"] for name, what, formula, value in explain_rows(e)]
    return compact_table(f"the paper's formulas for {e.layout.short}", ("name", "value", "formula, and what it is"),
                         rows, left=("name",), wrap=("formula, and what it is",))


def measured_table(comp: Comparison) -> Table:
    """Per step: measured, predicted with its own median costs, replayed action by action."""
    rows = [[str(s.step), f"{s.measured * 1e3:.2f}", f"{s.predicted * 1e3:.2f}", f"{s.ratio:.3f}",
             f"{s.replayed * 1e3:.2f}", f"{s.replay_ratio:.3f}"] for s in comp.per_step]
    return compact_table("steps (ms): measured, simulated with the step's own costs, replayed action by action",
                         ("step", "measured", "predicted", "ratio", "replayed", "ratio"), rows)


def costs_table(comp: Comparison) -> Table:
    """Per chunk: its stage and the measured per-action costs the prediction ran with (medians, ms):
    F, B (the input gradient alone where W is apart), W, and the transfers of its results."""
    costs, sched = comp.costs, comp.run.schedule
    split = costs.splits_backward
    cols = ("chunk", "stage", "F", "B", *(("W",) if split else ()), "send F", "send B")
    ms = lambda key, table: f"{table[key] * 1e3:.3f}" if key in table else "-"  # noqa: E731
    rows = [[str(c), str(sched.stage_of(c)), ms(("F", c), costs.compute), ms(("B", c), costs.compute),
             *((ms(("W", c), costs.compute),) if split else ()), ms(("F", c), costs.transfer),
             ms(("B", c), costs.transfer)] for c in range(sched.num_chunks)]
    return compact_table("per-action costs (ms, medians over the compared steps); send: a message's transfer",
                         cols, rows)
