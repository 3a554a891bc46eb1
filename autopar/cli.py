"""The ``autopar`` command line.

    autopar plan --model gpt-39b --gpus 512 --batch 1536 --hardware dgx-a100-80gb
    autopar plan --hf-config path/to/config.json --gpus 64 --batch 512 --seq-len 4096
    autopar plan --layers 48 --hidden 8192 --heads 64 --gpus 512 --batch 1536 --tp 8 --pp 2 --vp 4 --micro-batch 4
    autopar plan ... --json          # the same results as JSON
    autopar plan ... --explain       # the paper's formulas, symbolic and with values
    autopar plan ... --tp 8 --pp 8 --vs-tp 16 --vs-pp 4   # two layouts' terms side by side
    autopar simulate --model gpt-76b --gpus 1024 --batch 1792 --tp 8 --pp 4 --vp 3 --micro-batch 2 --svg step.svg
    autopar simulate --pp 4 --vp 2 --microbatches 8         # unit costs (F = 1, B = 2)
    autopar simulate ... --eager     # draw the planner's eager-send model instead of the lowered schedule
    autopar simulate --measured step.json   # a trace engine.write_trace wrote, beside its simulation
    autopar export checkpoints/ --to-hf hf-model/   # a saved checkpoint as a HuggingFace directory

``--recompute`` takes 'layer' (Megatron's "full" recomputation; 'full' is accepted as an
alias), 'none' or 'any' (the default: try both).
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from dataclasses import replace

import sympy as sp
from rich.console import Console
from rich.table import Table

from autopar.core.config import SCHEDULE_NAMES, SPLIT_BACKWARD_SCHEDULES, Recompute, microbatch_errors
from autopar.planning.estimate import Estimate, simulate_estimate
from autopar.planning.formulas import explain
from autopar.planning.hardware import PROFILES, Hardware, get_hardware
from autopar.planning.layout import PRICED_RECOMPUTE, Cluster, Layout
from autopar.planning.models import ModelSpec, get_model
from autopar.planning.op_times import op_time
from autopar.planning.planner import Plan, SearchSpace, search
from autopar.planning.sensitivity import flip_points
from autopar.planning.simulate import runtime_schedule, simulate_layout_lowered
from autopar.planning.tables import PIPED_WIDTH, compact_table
from autopar.planning.transformer import layer_ops
from autopar.planning.versus import term_lines, term_rows
from autopar.schedules import Sends, SimResult, generate, simulate

__all__ = ["main", "build_parser"]

_RECOMPUTE_FLAG: dict[str, tuple[Recompute, ...]] = {
    "layer": (Recompute.LAYER,),
    "full": (Recompute.LAYER,),  # Megatron's name for per-layer recomputation, kept as an alias
    "none": (Recompute.NONE,),
    "any": PRICED_RECOMPUTE,
}


def _add_model_args(ap: argparse.ArgumentParser, required_cluster: bool = True) -> None:
    g = ap.add_argument_group("model (a preset, a HuggingFace config, or dimensions)")
    g.add_argument("--model", help="preset: gpt-1.7b, gpt-3.6b, gpt-7.5b, gpt-18b, gpt-39b, gpt-76b, "
                                   "gpt-145b, gpt-310b, gpt-530b, gpt-1t")
    g.add_argument("--hf-config", help="a HuggingFace config.json (or its folder): the model is built on the "
                                       "meta device and its dimensions read from its traced graph "
                                       "(needs transformers; --seq-len sets the sequence, default 2048)")
    g.add_argument("--layers", type=int)
    g.add_argument("--hidden", type=int)
    g.add_argument("--heads", type=int)
    g.add_argument("--seq-len", type=int, default=None)
    g.add_argument("--vocab", type=int, default=None)
    g.add_argument("--ffn", type=int, default=None, help="MLP width (default 4 * hidden)")
    g.add_argument("--kv-heads", type=int, default=None, help="key/value heads (default: heads)")
    g.add_argument("--gated-mlp", action="store_true", help="SwiGLU MLP (three projections)")
    for flag, default, what in _FEATURES:
        g.add_argument(f"--{flag}", action=argparse.BooleanOptionalAction, default=None,
                       help=f"{what} (dimensions: default {'on' if default else 'off'}, as current models; "
                            f"--model: the preset's; --hf-config reads it from the model)")
    c = ap.add_argument_group("cluster")
    c.add_argument("--gpus", type=int, required=required_cluster)
    c.add_argument("--batch", type=int, required=required_cluster, help="global batch (sequences)")
    c.add_argument("--hardware", default="dgx-a100-80gb", choices=sorted(PROFILES))
    c.add_argument("--memory-headroom", type=float, default=None,
                   help="fraction of each GPU's HBM a layout may use (default: the profile's, 0.90); "
                        "lower it to keep a margin for fragmentation and buffers the model does not count")
    lay = ap.add_argument_group("layout (fix any of these to restrict the search)")
    lay.add_argument("--tp", type=int, help="tensor-parallel degree t")
    lay.add_argument("--pp", type=int, help="pipeline stages p")
    lay.add_argument("--vp", type=int, help="model chunks per stage v (interleaved when > 1)")
    lay.add_argument("--micro-batch", type=int, help="micro-batch size b")
    lay.add_argument("--schedule", choices=SCHEDULE_NAMES,
                     help="pipeline schedule (default: search 1f1b, interleaved and the zero-bubble 'zb-h1' "
                          "and 'zbv', v=2 in a V)")
    lay.add_argument("--recompute", choices=tuple(_RECOMPUTE_FLAG), default="any",
                     help="activation recomputation: 'layer' keeps each layer's input and recomputes the layer "
                          "in the backward ('full' is an alias, Megatron's name), 'none' keeps every activation, "
                          "'any' tries both (default). The cost model does not price 'chunk'.")
    lay.add_argument("--dp-overlap", action="store_true",
                     help="overlap the gradient all-reduce with the backward (PyTorch DDP) in layouts without "
                          "a pipeline (Megatron-LM 2021 could not with one)")
    lay.add_argument("--dp-overlap-pipelined", action="store_true",
                     help="overlap it in pipelined layouts too (autopar's runtime can)")
    lay.add_argument("--no-scatter-gather", action="store_true")
    lay.add_argument("--uneven-layers", action="store_true", help="allow layers not divisible by p*v")
    lay.add_argument("--sequence-parallel", choices=tuple(_FEATURE_FLAG), default="off",
                     help="sequence parallelism (norms, dropout, residual adds on s/t tokens; activations /t): "
                          "'off' (default, the paper's Megatron-LM 2021 had none), 'on', or 'search' both when t > 1")
    lay.add_argument("--distributed-optimizer", choices=tuple(_FEATURE_FLAG), default="off",
                     help="distributed optimizer (optimizer state 12/d bytes per parameter, gradients "
                          "reduce-scattered, parameters all-gathered): 'off' (default, as in the paper), 'on', "
                          "or 'search' both when d > 1")


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="autopar", description="3D-parallel training planner and tools.")
    sub = ap.add_subparsers(dest="command", required=True)
    plan = sub.add_parser("plan", help="rank layouts (t, p, d, v, micro-batch, schedule, recompute)")
    _add_model_args(plan)
    plan.add_argument("--top", type=int, default=10, help="rows to show")
    plan.add_argument("--json", action="store_true", help="print JSON instead of tables")
    plan.add_argument("--explain", action="store_true", help="print the formulas and their values")
    vs = plan.add_argument_group("versus: a second layout, its terms beside the first's (compute, bubble, "
                                 "imbalance, tensor-parallel, pipeline and data-parallel communication, optimizer)")
    vs.add_argument("--vs-tp", type=int, help="the other layout's t (default: the first's restriction)")
    vs.add_argument("--vs-pp", type=int, help="the other layout's p")
    vs.add_argument("--vs-vp", type=int, help="the other layout's v")
    vs.add_argument("--vs-micro-batch", type=int, help="the other layout's micro-batch")
    sim = sub.add_parser("simulate", help="simulate a pipeline step and draw its timeline")
    _add_model_args(sim, required_cluster=False)
    sim.add_argument("--microbatches", type=int, help="m, for unit-cost simulation without a model")
    sim.add_argument("--svg", default="autopar-timeline.svg", help="SVG output path ('' for none)")
    sim.add_argument("--width", type=int, default=0, help="terminal columns for the timeline")
    sim.add_argument("--svg-width", type=int, default=0,
                     help="SVG width in pixels (default: about 34 px per action of the busiest stage)")
    sim.add_argument("--eager", action="store_true",
                     help="draw the planner's model (compute-only schedule, eager blocking sends, as "
                          "Megatron-LM) instead of the lowered schedule autopar's runtime runs")
    sim.add_argument("--measured", "--from-trace", metavar="TRACE", dest="measured",
                     help="a trace engine.write_trace(path, steps=k) wrote: simulate its schedule with the run's "
                          "per-action costs; --svg draws measured above predicted; see --trace-out")
    sim.add_argument("--trace-out", default=None,
                     help="with --measured: a Perfetto trace of the measured steps and the prediction "
                          "(default: TRACE with -vs-predicted.json)")
    run = sub.add_parser("run", help="start N local ranks of a training script (torchrun-style)")
    run.add_argument("--nproc", type=int, required=True, help="number of ranks")
    run.add_argument("--timeout", type=float, default=None, help="stop all ranks after this many seconds")
    run.add_argument("script")
    run.add_argument("script_args", nargs=argparse.REMAINDER)
    exp = sub.add_parser("export", help="convert a saved autopar checkpoint to a HuggingFace directory")
    exp.add_argument("checkpoint", help="a checkpoint root (the step its 'latest' file names) or one step directory")
    exp.add_argument("--to-hf", required=True, metavar="DIR",
                     help="the directory to write: safetensors, their index, config.json (from_pretrained loads it)")
    exp.add_argument("--max-shard-size", default="5GB",
                     help="largest weight file, e.g. 5GB, 500MB, 2GiB or bytes (a larger tensor gets a file alone)")
    return ap


_FEATURES = (
    ("fused-attention", True, "attention as one fused kernel (FlashAttention, sdpa) keeping no s x s scores"),
    ("dropout", False, "dropout after the embedding, on the attention and before each residual add"),
    ("tied-head", False, "the LM head uses the word embedding's table (GPT-2) instead of its own (Llama)"),
    ("learned-positions", False, "a learned position table (GPT-2) instead of rotary positions (Llama)"),
)
"""(flag, default for a model given by its dimensions, what it is): what the dimensions do not say
(``ModelSpec``'s fields of the same names); the defaults fit current models (Llama, Mistral, Qwen)."""


def _feature_flags(args: argparse.Namespace) -> dict[str, bool]:
    """The ``_FEATURES`` flags given on the command line, as ``ModelSpec`` fields."""
    given = {flag.replace("-", "_"): getattr(args, flag.replace("-", "_"), None) for flag, _, _ in _FEATURES}
    return {k: v for k, v in given.items() if v is not None}


def _spec(args: argparse.Namespace) -> ModelSpec | None:
    if getattr(args, "hf_config", None):
        given = [f"--{a.replace('_', '-')}" for a in ("layers", "hidden", "heads", "vocab", "ffn", "kv_heads")
                 if getattr(args, a) is not None]
        given += ["--gated-mlp"] * args.gated_mlp + [f"--{k.replace('_', '-')}" for k in _feature_flags(args)]
        if given:
            raise SystemExit(f"autopar: --hf-config reads the model from its graph; {', '.join(given)} would be "
                             f"ignored: drop them, or describe the model by its dimensions instead")
        return _hf_spec(args.hf_config, args.seq_len or 2048)
    if args.model:
        spec = get_model(args.model)
        over = {k: getattr(args, a) for k, a in (("seq_len", "seq_len"), ("vocab", "vocab"))
                if getattr(args, a) is not None}
        over |= _feature_flags(args)
        if over:
            spec = replace(spec, **over)
        return spec
    dims = (args.layers, args.hidden, args.heads)
    if all(x is None for x in dims):
        return None
    if any(x is None for x in dims):
        raise SystemExit("autopar: give --model, or all of --layers --hidden --heads")
    features = {flag.replace("-", "_"): default for flag, default, _ in _FEATURES} | _feature_flags(args)
    return ModelSpec(layers=args.layers, hidden=args.hidden, heads=args.heads,
                     seq_len=args.seq_len or 2048, vocab=args.vocab or 51200, ffn=args.ffn,
                     kv_heads=args.kv_heads, gated_mlp=args.gated_mlp, **features)


def _hf_spec(path: str, seq_len: int) -> ModelSpec:
    """Build a HuggingFace causal LM from its config on the meta device and read its dimensions."""
    import torch  # noqa: PLC0415  (only this path needs torch and transformers)

    from autopar.compiler.model_spec import SpecError, spec_from_model  # noqa: PLC0415

    try:
        import transformers  # noqa: PLC0415
    except ImportError:
        raise SystemExit("autopar: --hf-config needs transformers (pip install transformers)") from None
    try:
        config = transformers.AutoConfig.from_pretrained(path)
    except (OSError, ValueError) as e:
        raise SystemExit(f"autopar: cannot read a HuggingFace config from {path}: {e}") from None
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(config)
    try:
        return spec_from_model(model, (torch.zeros(1, seq_len, dtype=torch.long),), name=config.model_type)
    except SpecError as e:
        raise SystemExit(f"autopar: {e}") from None


def _space(args: argparse.Namespace) -> SearchSpace:
    one = (lambda x: None if x is None else (x,))
    scheds = SearchSpace.schedules if args.schedule is None else (args.schedule,)
    if args.schedule is None and args.vp is not None:
        with_v = {1: ("1f1b", "zb-h1"), 2: ("interleaved", "zbv")}  # the schedules that run --vp chunks
        scheds = with_v.get(args.vp, ("interleaved",))
    return SearchSpace(
        t=one(args.tp), p=one(args.pp), v=one(args.vp), b=one(args.micro_batch), schedules=scheds,
        include_unrunnable=args.tp is not None and args.pp is not None,  # a layout the user fixes
        recompute=_recompute_choices(args.recompute),
        dp_overlap=args.dp_overlap, pipeline_dp_overlap=args.dp_overlap_pipelined,
        scatter_gather=not args.no_scatter_gather,
        divisible_layers=not args.uneven_layers,
        sequence_parallel=_FEATURE_FLAG[args.sequence_parallel],
        distributed_optimizer=_FEATURE_FLAG[args.distributed_optimizer],
    )


_FEATURE_FLAG: dict[str, tuple[bool, ...]] = {"off": (False,), "on": (True,), "search": (False, True)}
"""``--sequence-parallel`` / ``--distributed-optimizer`` -> the choices the planner tries."""


def _recompute_choices(flag: str) -> tuple[Recompute, ...]:
    """The recomputation modes ``--recompute`` allows."""
    return _RECOMPUTE_FLAG[flag]


GiB = 2**30


def _row(e: Estimate) -> list[str]:
    lay = e.layout
    sched = {"1f1b": "1F1B", "interleaved": "interl.", "gpipe": "GPipe", "zb-h1": "ZB-H1",
             "zbv": "ZB-V"}[lay.schedule] if lay.p > 1 else "-"
    return [str(lay.t), str(lay.p), str(lay.d), str(lay.v), str(lay.b), str(e.m),
            sched + ("*" if e.simulated else "") + ("" if e.runnable else "!"), str(lay.recompute),
            "on" if lay.sp else "-", "on" if lay.distopt else "-",
            f"{e.t_iter:.3f}", f"{e.tflops_per_gpu:.1f}", f"{e.frac_peak:.1%}", f"{e.memory.total / GiB:.1f}",
            f"{e.bubble:.1%}", f"{e.comm_time:.3f}"]


_PLAN_COLUMNS = ("#", "t", "p", "d", "v", "b", "m", "sched", "recomp", "SP", "DO", "iter s", "TFLOP/s",
                 "peak", "GiB", "bubble", "comm s")
"""The plan table's headers, short so that the table fits 120 columns (the caption says each)."""


def _plan_table(plan: Plan, top: int) -> Table:
    hw = plan.cluster.hardware
    rows = [[str(k), *_row(e)] for k, e in enumerate(plan.ranked[:top], 1)]
    styles: list[str | None] = [None] * len(rows)
    if plan.reference is not None:
        rows.append(["paper", *_row(plan.reference)])
        styles.append("yellow")
    return compact_table(
        f"{plan.spec.label} on {plan.cluster.gpus} x {hw.gpu} ({hw.name}), global batch "
        f"{plan.cluster.global_batch}: {plan.evaluated} layouts in {plan.seconds:.2f} s", _PLAN_COLUMNS, rows,
        caption="ranked by predicted iteration time (s); sched: schedule (interl. = interleaved 1F1B, * = simulated, "
                "! = priced but not runnable: the schedule's rules, listed below); recomp: recomputation; SP: "
                "sequence parallelism; DO: distributed optimizer; TFLOP/s per GPU count the FLOPs executed "
                "(recomputation included, as the paper counts); peak: of the GPU's peak; GiB per GPU; comm: "
                "exposed tensor-parallel, pipeline and data-parallel communication (s)",
        left=("sched", "recomp", "SP", "DO"), styles=styles)


def _breakdown_table(e: Estimate) -> Table:
    rows = [[k, f"{v:.3f}", f"{v / e.t_iter:.1%}"] for k, v in e.breakdown.items()]
    rows.append(["iteration", f"{e.t_iter:.3f}", "100%"])
    return compact_table(f"where the time goes: {e.layout.short}", ("part", "seconds", "share"), rows,
                         left=("part",), styles=[None] * (len(rows) - 1) + ["bold"])


def _ops_table(e: Estimate) -> Table:
    hw, lay = e.cluster.hardware, e.layout
    ops = layer_ops(e.spec, lay.b, lay.t)
    rows = [[op.name, op.kind, str(op.gemm) if op.gemm else "", f"{op.flops / 1e9:.2f}", f"{op.bytes / 1e6:.1f}",
             f"{op_time(op, hw, lay.t) * 1e6:.0f}"] for op in ops.forward]
    return compact_table(f"one layer, forward, on one GPU (b={lay.b}, t={lay.t})",
                         ("op", "kind", "GEMM (batch, M, N, K)", "GFLOP", "MB", "time (us)"), rows,
                         left=("op", "kind", "GEMM (batch, M, N, K)"))


def _explain_lines(e: Estimate) -> list[tuple[str, str, str, str]]:
    rows = []
    for x in explain(e):
        val = f"{x.value:.4g}" + (f" {x.unit}" if x.unit else "")
        rows.append((x.key, x.description, sp.sstr(x.expr), val))
    return rows


def _explain_table(e: Estimate) -> Table:
    """Name and value (never cut), then the formula and under it what it is (wrapped at spaces)."""
    rows = [[name, value, f"{formula}\n{what}"] for name, what, formula, value in _explain_lines(e)]
    return compact_table(f"the paper's formulas for {e.layout.short}", ("name", "value", "formula, and what it is"),
                         rows, left=("name",), wrap=("formula, and what it is",))


def _hardware(args: argparse.Namespace) -> Hardware:
    hw = get_hardware(args.hardware)
    if args.memory_headroom is None:
        return hw
    if not 0 < args.memory_headroom <= 1:
        raise SystemExit(f"autopar: --memory-headroom must be in (0, 1], got {args.memory_headroom} "
                         f"(a fraction of the {hw.hbm_bytes / 2**30:.0f} GiB of a {hw.gpu})")
    return replace(hw, memory_headroom=args.memory_headroom)


def _flip_json(plan: Plan) -> list[dict]:
    other, _ = plan.compared_with()
    if other is None or other.layout == plan.best.layout:
        return []
    return [{"input": fp.knob.name, "what": fp.knob.what, "factor": fp.factor, "physical": fp.physical}
            for fp in flip_points(plan.best, other)]


def _versus(args: argparse.Namespace, spec: ModelSpec, cluster: Cluster, space: SearchSpace) -> Estimate | None:
    """The fastest layout of ``space`` with the ``--vs-*`` flags replacing its restrictions, or
    None without them; its search's own error when no layout is valid or fits."""
    flags = {"t": args.vs_tp, "p": args.vs_pp, "v": args.vs_vp, "b": args.vs_micro_batch}
    if all(x is None for x in flags.values()):
        return None
    over = {k: (x,) for k, x in flags.items() if x is not None}
    if args.vs_vp is not None:
        over["schedules"] = ("interleaved",) if args.vs_vp > 1 else ("1f1b",)
    other = replace(space, **over, include_unrunnable=True)
    plan = search(spec, cluster, other, top=1)
    if plan.ranked:
        return plan.ranked[0]
    if plan.too_big:
        return plan.too_big[0]
    raise ValueError(f"--vs-*: {plan.no_fit_message()}")


def _versus_json(best: Estimate, other: Estimate) -> dict:
    return {"layout": other.as_dict(),
            "terms": [{"term": r.term, "best_s": r.a, "other_s": r.b, "difference_s": r.difference}
                      for r in term_rows(best, other)]}


def _cmd_plan(args: argparse.Namespace, console: Console) -> int:
    spec = _spec(args)
    if spec is None:
        raise SystemExit("autopar plan: give --model, or --layers --hidden --heads")
    cluster = Cluster(args.gpus, _hardware(args), args.batch)
    space = _space(args)
    plan = search(spec, cluster, space, top=args.top)
    other = _versus(args, spec, cluster, space)
    if args.json:
        out = {
            "model": {"name": spec.label, "layers": spec.layers, "hidden": spec.hidden, "heads": spec.heads,
                      "seq_len": spec.seq_len, "vocab": spec.vocab, "ffn": spec.ffn_size, "kv_heads": spec.kv,
                      "gated_mlp": spec.gated_mlp, "fused_attention": spec.fused_attention, "dropout": spec.dropout,
                      "tied_head": spec.tied_head, "learned_positions": spec.learned_positions},
            "cluster": {"gpus": cluster.gpus, "hardware": cluster.hardware.name, "global_batch": args.batch},
            "evaluated": plan.evaluated, "seconds": plan.seconds, "rejected": plan.rejected,
            "ranked": [e.as_dict() for e in plan.ranked[:args.top]],
            "reference": plan.reference.as_dict() if plan.reference else None,
            "why": plan.why(),
            "notes": plan.notes(),
            "flip_points": _flip_json(plan),
        }
        if other is not None and plan.ranked:
            out["versus"] = _versus_json(plan.best, other)
        if not plan.ranked:
            out["error"] = plan.no_fit_message()
        if args.explain and plan.ranked:
            out["explain"] = [dict(zip(("name", "what", "formula", "value"), r)) for r in _explain_lines(plan.best)]
        print(json.dumps(out, indent=2))
        return 0 if plan.ranked else 1
    if not plan.ranked:
        console.print(f"[red]{plan.no_fit_message()}[/red]")
        return 1
    console.print(f"model {spec.label}: {spec.features}", highlight=False)
    console.print(_plan_table(plan, args.top), crop=False)
    if plan.rejected:
        console.print("rejected: " + ", ".join(f"{n} x {rule}" for rule, n in plan.rejected.items()),
                      highlight=False)
    for line in plan.notes():
        console.print(line, highlight=False)
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
        console.print(_explain_table(best), crop=False)
        console.print(_breakdown_table(best), crop=False)
        console.print(_ops_table(best), crop=False)
    return 0


def _cmd_simulate(args: argparse.Namespace, console: Console) -> int:
    from autopar.planning.viz import timeline_text, write_svg  # noqa: PLC0415  (rich pictures, only here)

    if args.measured:
        return _simulate_measured(args, console)
    spec = _spec(args)
    width = args.width or max(40, console.width - 10)
    if spec is None:
        eager, lowered, title, unit, notes = _simulate_unit_costs(args)
    else:
        eager, lowered, title, unit, notes = _simulate_model(args, spec, console)
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
    from autopar.planning.measured import compare, read_trace  # noqa: PLC0415  (only here)
    from autopar.planning.measured_viz import write_comparison_svg  # noqa: PLC0415
    from autopar.runtime.engine.timeline import write_chrome_trace  # noqa: PLC0415  (loads torch)

    console.print(f"reading {args.measured} ...", highlight=False)
    run = read_trace(args.measured)
    sched = run.schedule
    console.print(f"{sched.name} p={sched.p} v={sched.v} m={sched.m}, {run.shape.world} ranks, {len(run.steps)} steps: "
                  f"simulating each (the first is a warm-up) ...", highlight=False)
    comp = compare(run)
    console.print(_measured_table(comp), crop=False)
    console.print(_costs_table(comp), crop=False)
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


def _measured_table(comp) -> Table:
    """Per step: measured, predicted with its own median costs, replayed action by action."""
    rows = [[str(s.step), f"{s.measured * 1e3:.2f}", f"{s.predicted * 1e3:.2f}", f"{s.ratio:.3f}",
             f"{s.replayed * 1e3:.2f}", f"{s.replay_ratio:.3f}"] for s in comp.per_step]
    return compact_table("steps (ms): measured, simulated with the step's own costs, replayed action by action",
                         ("step", "measured", "predicted", "ratio", "replayed", "ratio"), rows)


def _costs_table(comp) -> Table:
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


def _simulate_unit_costs(args: argparse.Namespace) -> tuple[SimResult, SimResult, str, str, list[str]]:
    """(eager, lowered, title, unit, notes) of a schedule with F = 1 and B = 2."""
    if args.pp is None or args.microbatches is None:
        raise SystemExit("autopar simulate: give a model and cluster, or --pp and --microbatches (unit costs)")
    v = args.vp or (2 if args.schedule == "zbv" else 1)
    name = args.schedule or ("interleaved" if v > 1 else "1f1b")
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


def _simulate_model(args: argparse.Namespace, spec: ModelSpec,
                    console: Console) -> tuple[SimResult, SimResult, str, str, list[str]]:
    """(eager, lowered, title, unit, notes) of the given layout of ``spec``, or of the planner's best."""
    if args.gpus is None or args.batch is None:
        raise SystemExit("autopar simulate: a model needs --gpus and --batch")
    cluster = Cluster(args.gpus, _hardware(args), args.batch)
    space = _space(args)
    if all(x is not None for x in (args.tp, args.pp, args.micro_batch)):
        v = args.vp or (2 if args.schedule == "zbv" else 1)
        lay = Layout(t=args.tp, p=args.pp, d=args.gpus // (args.tp * args.pp), b=args.micro_batch, v=v,
                     schedule=args.schedule or "", recompute=_recompute_choices(args.recompute)[0],
                     scatter_gather=not args.no_scatter_gather, dp_overlap=space.overlap_for(args.pp))
    else:
        lay = search(spec, cluster, space, top=1).best.layout
    if lay.p == 1:
        console.print(f"[yellow]{lay.short} has no pipeline (p = 1): the timeline is one rank.[/yellow]")
    est, eager = simulate_estimate(spec, cluster, lay)
    split = lay.schedule in SPLIT_BACKWARD_SCHEDULES
    lowered = simulate_layout_lowered(lay.schedule, lay.p, lay.v, est.m, est.t_chunk_f, est.t_chunk_b,
                                      est.t_p2p, (est.t_emb_f, est.t_emb_b), (est.t_head_f, est.t_head_b),
                                      t_w=est.t_chunk_w if split else None, last_extra_w=est.t_head_w)
    t_iter_low = est.t_iter - est.t_pipeline + lowered.step_time
    tflops_low = est.flops / (t_iter_low * cluster.gpus) / 1e12
    title = f"{spec.label}, {lay.short}, {cluster.gpus} GPUs, batch {cluster.global_batch}"
    notes = [f"lowered schedule (autopar's runtime): pipeline {lowered.step_time:.4g} s, bubble "
             f"{lowered.bubble:.1%}, iteration {t_iter_low:.4g} s, {tflops_low:.1f} TFLOP/s/GPU",
             f"eager sends (the planner's model, Megatron-LM-like): pipeline {eager.step_time:.4g} s, bubble "
             f"{eager.bubble:.1%}, iteration {est.t_iter:.4g} s, {est.tflops_per_gpu:.1f} TFLOP/s/GPU",
             f"per chunk and microbatch: forward {est.t_chunk_f * 1e3:.3g} ms, backward (+recompute) "
             f"{est.t_chunk_b * 1e3:.3g} ms" + (f" (W: {est.t_chunk_w * 1e3:.3g} ms)" if split else "")
             + f", one send {est.t_p2p * 1e3:.3g} ms; drawn: "
             + ("eager sends" if args.eager else "the lowered schedule")]
    return eager, lowered, title, "s", notes


_SIZE_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
               "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}


def _size_bytes(text: str) -> int:
    """``5GB``, ``500MB``, ``2GiB`` or a number of bytes, as bytes (HuggingFace's units)."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([A-Za-z]*)\s*", text)
    unit = match.group(2).upper() if match else None
    if match is None or unit not in _SIZE_UNITS or float(match.group(1)) <= 0:
        raise ValueError(f"--max-shard-size {text!r} is not a size: give e.g. 5GB, 500MB, 2GiB or a number of bytes")
    return int(float(match.group(1)) * _SIZE_UNITS[unit])


def _cmd_export(args: argparse.Namespace, console: Console) -> int:
    """``autopar export CKPT --to-hf DIR``: one line per file written."""
    from autopar.runtime.hf.export_checkpoint import export_checkpoint  # noqa: PLC0415  (loads torch's DCP)

    written = export_checkpoint(args.checkpoint, args.to_hf, _size_bytes(args.max_shard_size),
                                progress=lambda line: console.print(line, highlight=False))
    console.print(f"wrote {len(written)} file(s) to {args.to_hf}: {', '.join(written)}", highlight=False)
    return 0


def make_console(width: int | None = None) -> Console:
    """The console the commands print to: ``width`` columns if given, else the terminal's, or
    ``PIPED_WIDTH`` when the output is not a terminal (rich would assume 80 and cut the tables).
    Tables are printed uncropped: in a terminal narrower than a table its lines run on (the
    terminal wraps them) rather than lose their last columns."""
    console = Console(width=width)
    if width is None and not console.is_terminal:
        console = Console(width=PIPED_WIDTH)
    return console


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    console = make_console()
    try:
        if args.command == "plan":
            return _cmd_plan(args, console)
        if args.command == "simulate":
            return _cmd_simulate(args, console)
        if args.command == "run":
            try:
                from autopar.runtime.launch import run_script
            except KeyboardInterrupt:  # Ctrl-C while torch loads: no rank started yet
                print("autopar run: interrupted: stopped 0 ranks", file=sys.stderr)
                return 130
            return run_script(args.nproc, args.script, args.script_args, args.timeout)
        if args.command == "export":
            return _cmd_export(args, console)
    except ValueError as e:
        console.print(f"[red]autopar {args.command}: {e}[/red]", highlight=False)
        return 2
    return 1


if __name__ == "__main__":
    sys.exit(main())
