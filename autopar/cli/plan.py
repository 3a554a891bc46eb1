"""``autopar plan``: rank the layouts of a model on a cluster, as tables or as JSON.

The ranked layouts, the rules that rejected the others, the notes, why the best beats the
paper's layout (or the fastest of another (t, p)), the ``--vs-*`` layout's terms beside the
best's, with ``--cp`` naming several degrees the fastest layout at each, and with ``--explain`` the
paper's formulas, the time's breakdown and one layer's kernels.
"""

from __future__ import annotations

import argparse
import json

from rich.console import Console

from autopar.cli.layout_args import cluster, search_space, versus_estimate
from autopar.cli.model_args import model_spec
from autopar.cli.render import breakdown_table, context_table, explain_rows, explain_table, ops_table, plan_table
from autopar.planning.cost.step_estimate import Estimate
from autopar.planning.search.measured_note import measured_note
from autopar.planning.search.planner import Plan, best_by_context_degree, search
from autopar.planning.search.sensitivity import flip_points
from autopar.planning.search.versus import term_lines, term_rows

__all__ = ["run_plan"]


def _flip_json(plan: Plan) -> list[dict]:
    other, _ = plan.compared_with()
    if other is None or other.layout == plan.best.layout:
        return []
    return [{"input": fp.knob.name, "what": fp.knob.what, "factor": fp.factor, "physical": fp.physical}
            for fp in flip_points(plan.best, other)]


def _versus_json(best: Estimate, other: Estimate) -> dict:
    return {"layout": other.as_dict(),
            "terms": [{"term": r.term, "best_s": r.a, "other_s": r.b, "difference_s": r.difference}
                      for r in term_rows(best, other)]}


def _by_cp_json(best: dict[int, Estimate | None]) -> list[dict]:
    return [{"cp": cp, "layout": e.as_dict() if e is not None else None} for cp, e in best.items()]


def _plan_json(args: argparse.Namespace, plan: Plan, other: Estimate | None,
               by_cp: dict[int, Estimate | None]) -> dict:
    spec, cl = plan.spec, plan.cluster
    out = {
        "model": {"name": spec.label, "layers": spec.layers, "hidden": spec.hidden, "heads": spec.heads,
                  "seq_len": spec.seq_len, "vocab": spec.vocab, "ffn": spec.ffn_size, "kv_heads": spec.kv,
                  "gated_mlp": spec.gated_mlp, "fused_attention": spec.fused_attention, "dropout": spec.dropout,
                  "tied_head": spec.tied_head, "learned_positions": spec.learned_positions},
        "cluster": {"gpus": cl.gpus, "hardware": cl.hardware.name, "global_batch": args.batch},
        "evaluated": plan.evaluated, "seconds": plan.seconds, "rejected": plan.rejected,
        "ranked": [e.as_dict() for e in plan.ranked[:args.top]],
        "reference": plan.reference.as_dict() if plan.reference else None,
        "why": plan.why(),
        "notes": plan.notes(),
        "flip_points": _flip_json(plan),
    }
    if spec.is_moe:  # a mixture-of-experts model's: which layers, how many experts of which width
        out["model"] |= {"experts": spec.experts, "top_k": spec.top_k, "expert_ffn": spec.expert_ffn_size,
                         "shared_expert_ffn": spec.shared_expert_ffn, "moe_layers": spec.moe_layers}
    if other is not None and plan.ranked:
        out["versus"] = _versus_json(plan.best, other)
    if by_cp:
        out["by_cp"] = _by_cp_json(by_cp)
    if not plan.ranked:
        out["error"] = plan.no_fit_message()
    if args.explain and plan.ranked:
        out["explain"] = [dict(zip(("name", "what", "formula", "value"), r)) for r in explain_rows(plan.best)]
    return out


def run_plan(args: argparse.Namespace, console: Console) -> int:
    """``autopar plan``: 0 when a layout fits, 1 when none does."""
    spec = model_spec(args)
    if spec is None:
        raise SystemExit("autopar plan: give --model, or --layers --hidden --heads")
    cl = cluster(args)
    space = search_space(args, spec, cl.hardware)
    plan = search(spec, cl, space, top=args.top)
    other = versus_estimate(args, spec, cl, space)
    by_cp = best_by_context_degree(spec, cl, space) if len(space.cp or ()) > 1 else {}
    if args.json:
        print(json.dumps(_plan_json(args, plan, other, by_cp), indent=2))
        return 0 if plan.ranked else 1
    if not plan.ranked:
        console.print(f"[red]{plan.no_fit_message()}[/red]")
        return 1
    console.print(f"model {spec.label}: {spec.features}", highlight=False)
    console.print(plan_table(plan, args.top), crop=False)
    if plan.rejected:
        console.print("rejected: " + ", ".join(f"{n} x {rule}" for rule, n in plan.rejected.items()),
                      highlight=False)
    for line in plan.notes():
        console.print(line, highlight=False)
    note = measured_note(spec, cl.hardware, plan.best)
    if note:
        console.print(note, highlight=False)
    if by_cp:
        console.print(context_table(by_cp), crop=False)
    why = plan.why()
    if why:
        console.print("[bold]compared with the paper's layout[/bold]" if plan.reference is not None else
                      "[bold]compared with the fastest layout of another (t, p)[/bold]")
        for line in why:
            console.print(line, highlight=False)
    for e in plan.ranked[:args.top]:
        if not e.runnable:
            console.print(f"[yellow]{e.layout.short}: priced, but autopar's runtime cannot run it: "
                          f"{'; '.join(e.runtime_errors)}[/yellow]", highlight=False)
    if other is not None:
        console.print("[bold]versus[/bold]")
        for line in term_lines(plan.best, other, "best", "vs"):
            console.print(line, highlight=False)
    if args.explain:
        best = plan.best
        console.print(explain_table(best), crop=False)
        console.print(breakdown_table(best), crop=False)
        console.print(ops_table(best), crop=False)
    return 0
