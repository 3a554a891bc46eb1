"""``program.summary()``: the plan as rich tables rendered to text.

The mesh, which layers and parameters each stage holds, memory per rank
(weights, gradients, optimizer state, activations at peak), collectives per
step with their bytes, the pipeline schedule's bubble, what runs under compute
(``overlap``), and every fallback.
"""

from __future__ import annotations

import io
import math
from typing import Any

from rich.console import Console
from rich.table import Table

from autopar.compiler.context_report import context_lines
from autopar.compiler.example_batch import example_seq_len
from autopar.compiler.expert_report import expert_lines
from autopar.compiler.overlap_report import overlap_lines
from autopar.compiler.sequence_report import sequence_parallel_lines
from autopar.planning.drawing.tables import PIPED_WIDTH, compact_table
from autopar.core.collectives import collective_named
import torch

from autopar.core.config import optimizer_bytes_per_param
from autopar.core.flops import node_bytes
from autopar.core.graph import local_val
from autopar.core.tensor_placement import Shard
from autopar.schedules import Sends, simulate

Program = Any
"""A ``autopar.compiler.program.Program``: it imports this module for ``summary()``, so this
module names it without importing it (an import back would be a cycle)."""

__all__ = ["render_summary", "memory_per_rank", "predicted_bubble"]


def _gib(n: float) -> str:
    if n >= 1 << 30:
        return f"{n / (1 << 30):.2f} GiB"
    if n >= 1 << 20:
        return f"{n / (1 << 20):.1f} MiB"
    return f"{n / 1024:.1f} KiB"


def memory_per_rank(program: Program) -> list[dict[str, float]]:
    """Per pipeline stage: bytes of weights, gradients, optimizer state (Adam,
    ``optimizer_bytes_per_param``) and activations at peak, each memory feature with and without.

    Activations: the bytes a chunk keeps for its backward per microbatch
    (``Program.chunk_activation_bytes``) times the most microbatches
    the schedule keeps in flight on that stage, plus one recomputation's
    working set. ``activations_sp``: the same with sequence parallelism, the values whole on
    every tensor-parallel rank that carry the sequence (norms, dropout, residual stream) split
    t ways. ``optimizer_distopt``: the distributed optimizer's share, an fp32 master and Adam's
    moments (12 bytes) per parameter over the d replicas. ``sequence_parallel`` and
    ``distributed_optimizer`` say which the program uses (``program.config``'s, off when absent).
    """
    p, t, d = program.pp, program.tp, program.config.data_parallel * program.config.cp  # distopt shards over dp x cp
    seq = example_seq_len(program)
    out = []
    for stage in range(p):
        params, weights, optimizer = 0, 0.0, 0.0
        for name in program.param_names:
            if stage in program.param_stages.get(name, ()):
                n = math.prod(program.local_shape(name))
                params += n
                weights += n * program.param_dtype_bytes(name)
                optimizer += n * optimizer_bytes_per_param(program.param_dtype_bytes(name))
        chunks = program.chunks_of_stage(stage)
        kept = [program.chunk_activation_bytes(c) for c in chunks]
        in_flight = program.schedule.in_flight_bound(stage)
        act = max((k for k, _ in kept), default=0.0) * in_flight + max((w for _, w in kept), default=0.0)
        split = max((_sequence_share(c, seq) for c in chunks), default=0.0) if t > 1 else 0.0
        out.append({"params": params, "weights": weights, "grads": weights,
                    "optimizer": optimizer, "optimizer_distopt": DISTRIBUTED_STATE_BYTES * params / d,
                    "activations": act, "activations_sp": act * (1 - split * (1 - 1 / t)), "in_flight": in_flight,
                    "sequence_parallel": bool(getattr(program.config, "sequence_parallel", False)) and t > 1,
                    "distributed_optimizer": bool(getattr(program.config, "distributed_optimizer", False)) and d > 1})
    return out


DISTRIBUTED_STATE_BYTES = 12
"""The distributed optimizer's state per parameter before sharding: an fp32 master and Adam's m and v."""


def _sequence_share(chunk, seq: int) -> float:
    """Fraction of the bytes ``chunk``'s values hold that sequence parallelism splits: values whole on
    every tensor-parallel rank (local numel = global numel) with a sequence dim (dim 1 = s)."""
    total = whole = 0.0
    for node in chunk.gm.graph.nodes:
        if node.op != "call_function":
            continue
        nbytes = node_bytes(node)
        total += nbytes
        full, local = node.meta.get("val"), local_val(node)
        if (isinstance(full, torch.Tensor) and isinstance(local, torch.Tensor) and full.dim() >= 3
                and full.shape[1] == seq and full.numel() == local.numel()):
            whole += nbytes
    return whole / total if total else 0.0


def predicted_bubble(program: Program, sends: Sends = Sends.POSTED) -> float:
    """Bubble fraction of the schedule with the chunks' estimated costs (backward = 2x forward), its
    exchanges run as ``sends`` says: posted and each receive waited for by its consumer (the runtime on
    gloo), or batched, each batch waited for whole (NCCL's coalesced batches). The two agree unless
    receives were posted early (``overlap`` 'p2p')."""
    costs = {c.index: max(c.cost, 1.0) for c in program.split.chunks}
    run = simulate(program.schedule, lambda a: costs[a.chunk], lambda a: 2 * costs[a.chunk], sends=sends)
    return float(run.bubble)


def render_summary(program: Program, width: int = PIPED_WIDTH, hardware: Any = None,
                   distributed_optimizer: bool = False) -> str:
    """The plan as text ``width`` columns wide: header, stages and memory, parameters,
    collectives, and whatever runs slower than it could (fallbacks, weights left whole, linears
    left replicated); with ``hardware`` (``Program.summary``'s), last, the step predicted there
    (``predicted_cost``). Numbers and names are never cut or wrapped (``planning/drawing/tables.py``)."""
    from autopar.compiler.predicted_cost import predicted_lines  # noqa: PLC0415  (the cost model, when asked)

    predicted = predicted_lines(program, hardware, distributed_optimizer) if hardware is not None else []
    console = Console(record=True, width=width, file=io.StringIO(), force_terminal=False, color_system=None)
    console.print(_header(program))
    if program.layers.count:
        console.print(_layers_table(program))
    console.print(_stages_table(program))
    for line in _stage_notes(program):
        console.print(line)
    console.print(_params_table(program))
    console.print(_collectives_table(program))
    for line in _collective_notes(program):
        console.print(line)
    for line in _padding_notes(program):
        console.print(line)
    for line in sequence_parallel_lines(program):
        console.print(line, highlight=False, markup=False)
    for line in overlap_lines(program):
        console.print(line, highlight=False, markup=False)
    for line in expert_lines(program):
        console.print(line, highlight=False, markup=False)
    for line in context_lines(program):
        console.print(line, highlight=False, markup=False)
    console.print(_fallbacks_table(program))
    for table in (_unsplit_weights_table(program), _rejected_table(program)):
        if table is not None:
            console.print(table)
    for line in predicted:
        console.print(line, highlight=False, markup=False)
    return console.export_text()


def _header(program: Program) -> str:
    cfg, mesh, layers = program.config, program.config.mesh, program.layers
    total = sum(math.prod(program.full_shape(n)) for n in program.param_names)
    return (
        f"[bold]autopar program[/bold]: {program.traced.model_name}, {total:,} parameters, "
        f"{layers.describe()}\n"
        f"{_mesh_line(mesh)}\n"
        f"data-parallel size {mesh.dp}: {cfg.dp_source}\n"
        f"schedule {cfg.schedule}, virtual stages {cfg.virtual_stages}, {cfg.microbatches} microbatches per "
        f"replica; recompute {program.recompute}; precision {program.precision}\n"
        f"{_compile_line(cfg)}\n"
        f"{_trace_line(program)}"
        f"{_batch_line(program)}\n"
        f"{_loss_line(program)}"
    )


def _ep_text(mesh) -> str:
    """The expert-parallel degree and what its groups are cut from, when there is one."""
    if mesh.ep == 1:
        return ""
    return f" (ep={mesh.ep} inside dp)" if mesh.etp == mesh.tp else f" (ep={mesh.ep} over tp x dp, whole experts)"


def _trace_line(program: Program) -> str:
    """Whether the graph was stamped from a short trace (a line of its own then, else nothing)."""
    stamping = program.traced.stamping
    return f"trace: {stamping.describe()}\n" if stamping is not None else ""


def _compile_line(cfg) -> str:
    if not cfg.compile:
        return "chunks: run op by op (compile=None)"
    turns = ("; a stage's tp ranks take turns, tp rank 0 compiles and the others load its kernels from "
             "Inductor's cache" if cfg.compile == "inductor" and cfg.mesh.tp > 1 else "")
    return (f"chunks: compiled with {cfg.compile} at their first run{turns} (engine.compiled(): seconds, graphs, "
            "breaks, cache hits)")


def _loss_line(program: Program) -> str:
    """How the step's loss weighs its microbatches (``config.loss_reduction``), and why when the
    token-exact weighting does not apply."""
    loss = program.batch_roles.loss
    if program.config.loss_reduction == "microbatch":
        return "loss: the mean of the microbatches' losses (loss_reduction='microbatch')"
    if loss is None:
        why = program.batch_roles.why_not_tokens or "the loss is not a mean over counted targets"
        return f"loss: the mean of the microbatches' losses ({why})"
    return (f"loss: {loss.op}, the mean over the global batch's counted targets (ignore_index "
            f"{loss.ignore_index}), as on one device")


def _batch_line(program: Program) -> str:
    """The batch tensors by name with one microbatch's shape, and what ``train_step`` takes."""
    traced, mesh = program.traced, program.config.mesh
    shapes = {n.name: n.meta["val"] for n in traced.gm.graph.nodes if n.op == "placeholder"}

    def listed(names: list[str]) -> str:
        return ", ".join(f"{n} {list(shapes[n].shape)} {str(shapes[n].dtype).removeprefix('torch.')}"
                         for n in names) or "none"

    rows = mesh.dp * program.microbatches
    return (f"batch (one microbatch): inputs {listed(traced.input_names)}; targets {listed(traced.target_names)}; "
            f"train_step takes {rows}x the rows (dp {mesh.dp} x {program.microbatches} microbatches)")


def _layers_table(program: Program) -> Table:
    """Which traced nodes became which layer: its module, its first and last node, how many."""
    layers = program.layers
    nodes: dict[int, list[str]] = {}
    for node in program.traced.gm.graph.nodes:
        if (layer := layers.node_layer.get(node.name)) is not None:
            nodes.setdefault(layer, []).append(node.name)
    rows = []
    for i in range(layers.count):
        names = nodes.get(i, [])
        span = f"{names[0]} .. {names[-1]}" if names else "-"
        rows.append([str(i), layers.label(i), span, str(len(names))])
    return compact_table("Layers: the repeated module calls, in graph order",
                         ("layer", "module", "nodes (first .. last)", "count"), rows, left=("module",),
                         wrap=("nodes (first .. last)",))


def _stages_table(program: Program) -> Table:
    mesh = program.config.mesh
    mem, rows = memory_per_rank(program), []
    for s in range(mesh.pp):
        chunks = program.chunks_of_stage(s)
        desc = "; ".join(f"{c.index}: {_span(c.layers)}" for c in chunks)
        ranks = sorted(mesh.rank(s, d, j, c) for d in range(mesh.dp) for j in range(mesh.tp) for c in range(mesh.cp))
        m = mem[s]
        opt = m["optimizer_distopt"] if m["distributed_optimizer"] else m["optimizer"]
        act = m["activations_sp"] if m["sequence_parallel"] else m["activations"]
        rows.append([str(s), _ranks(ranks), desc, f"{m['params']:,}", _gib(m["weights"]), _gib(m["grads"]),
                     _gib(m["optimizer"]), _gib(m["optimizer_distopt"]) if mesh.dp * mesh.cp > 1 else "-",
                     _gib(m["activations"]), str(m["in_flight"]), _gib(m["activations_sp"]) if mesh.tp > 1 else "-",
                     _gib(m["weights"] + m["grads"] + opt + act)])
    return compact_table("Pipeline stages: layers per chunk, memory per rank",
                         ("stage", "ranks", "chunks: layers", "params", "weights", "grads", "optimizer", "distopt",
                          "act. peak", "in flight", "with SP", "total"), rows, left=("ranks",),
                         wrap=("chunks: layers",))


def _stage_notes(program: Program) -> list[str]:
    cfg, mesh = program.config, program.config.mesh
    per_chunk = f"layers per chunk: {[len(c.layers) for c in program.split.chunks]}"
    if mesh.pp > 1:
        per_chunk += (f"; predicted bubble {predicted_bubble(program):.1%} (uniform costs: (p-1)/(v*m) = "
                      f"{(mesh.pp - 1) / (cfg.virtual_stages * cfg.microbatches):.1%})")
        if "p2p" in cfg.overlap:
            per_chunk += (f"; with each batch of sends and receives waited for whole (NCCL) "
                          f"{predicted_bubble(program, Sends.BATCHED):.1%}")
    lines = [per_chunk, "params: per rank; distopt: optimizer state with the distributed optimizer (fp32 master + "
             "Adam's m, v: 12 bytes per parameter / d, or / (d x cp)); act. peak: activations at the peak, with the microbatches "
             "in flight; with SP: activations with sequence parallelism (values whole on every tensor-parallel "
             "rank split t ways); total: the program's own choices"]
    if program.tied_params:
        lines.append("held by several stages (gradients summed across them): "
                     + ", ".join(f"{n} on stages {list(s)}" for n, s in program.tied_params.items()))
    return lines


def _params_table(program: Program) -> Table:
    """Every parameter's split; layer 0 stands for every layer."""
    roles, rows = _roles(program), []
    for name in program.param_names:
        layer = program.layer_params(name)
        if layer is not None and program.layers.stands_for(layer) != layer:
            continue
        rows.append([name, str(list(program.full_shape(name))), repr(program.param_spec(name)),
                     str(list(program.local_shape(name))), roles.get(name, "")])
    return compact_table("Parameters (tensor-parallel split; each layer as the first of its kind)",
                         ("parameter", "full shape", "placement", "local shape", "role"), rows,
                         left=("parameter", "full shape", "local shape"), wrap=("placement", "role"))


def _collectives_table(program: Program) -> Table:
    """Per pipeline stage, what one of its ranks moves: its own chunks' tensor-parallel collectives
    (stages alike share a row), then the pipeline sends and the data-parallel gradient reduction."""
    per_stage, rows = [program.tp_communication(s) for s in range(program.pp)], []
    for key in dict.fromkeys(k for stage in per_stage for k in stage):
        for stages, (calls, nbytes) in _runs([stage.get(key) for stage in per_stage]):
            rows.append([_stage_span(stages), _where(program, key[0], stages[0]), key[1], _direction(*key),
                         str(calls), _gib(nbytes)])
    for label, value in program.p2p_and_dp_bytes().items():
        rows.append(["", label[0], label[1], label[2], "", _gib(value)])
    return compact_table("Collectives per step (one rank of each stage: its own chunks)",
                         ("stages", "where", "collective", "direction", "calls / microbatch", "bytes / step / rank"),
                         rows, left=("stages", "collective"), wrap=("where", "direction"))


def _collective_notes(program: Program) -> list[str]:
    """The tensor-parallel total of one rank of each stage."""
    totals = [sum(n for _, n in program.tp_communication(s).values()) for s in range(program.pp)]
    if not any(totals):
        return []
    return ["tensor-parallel bytes / step / rank: "
            + ", ".join(f"stage {s} {_gib(n)}" for s, n in enumerate(totals))]


def _runs(values: list) -> list[tuple[list[int], Any]]:
    """Consecutive stages with the same value, the stages without one (None) left out."""
    runs: list[tuple[list[int], Any]] = []
    for stage, value in enumerate(values):
        if value is None:
            continue
        if runs and runs[-1][1] == value and runs[-1][0][-1] == stage - 1:
            runs[-1][0].append(stage)
        else:
            runs.append(([stage], value))
    return runs


def _stage_span(stages: list[int]) -> str:
    return str(stages[0]) if len(stages) == 1 else f"{stages[0]}-{stages[-1]}"


def _where(program: Program, where: str, stage: int) -> str:
    if where != "layers":
        return where
    n = sum(len(c.layers) for c in program.chunks_of_stage(stage))
    return f"{n} layer{'s' if n != 1 else ''}" + (" each" if program.pp > 1 else "")


def _direction(where: str, name: str) -> str:
    if where == "boundary":
        return f"{'bwd' if 'gradient' in name else 'fwd'} all-gather of the 1/t slices received"
    direction = collective_named(name).direction
    return f"{direction} (forward part, rerun in the backward)" if where == "replayed by recompute" else direction


def _padding_notes(program: Program) -> list[str]:
    out = []
    for name in program.param_names:
        spec = program.param_spec(name)
        full = program.full_shape(name)
        if isinstance(spec, Shard) and spec.segments and sum(spec.segments) != full[spec.dim]:
            out.append(f"vocabulary padding: {name} dim {spec.dim} {full[spec.dim]} -> {sum(spec.segments)} "
                       f"(padded rows are never looked up and never win the softmax)")
    return out


def _fallbacks_table(program: Program) -> Table | str:
    fallbacks = program.fallbacks()
    if not fallbacks:
        return "fallbacks: none (every op on a sharded value has a rule)"
    return compact_table(f"Fallbacks: {len(fallbacks)} op(s) run replicated (inputs all-gathered) — slower",
                         ("node", "reason", "source"), [list(f) for f in fallbacks], left=("node",),
                         wrap=("reason", "source"))


def _unsplit_weights_table(program: Program) -> Table | None:
    whole = program.replicated_weights()
    if not whole:
        return None
    total_params = sum(math.prod(program.full_shape(n)) for n in program.param_names)
    n_whole = sum(n for _, n, _ in whole)
    rows = []
    for name, n, why in whole:
        layer = program.layer_params(name)
        if layer is not None and program.layers.stands_for(layer) != layer:
            continue
        rows.append([name, f"{n:,}", why])
    return compact_table(f"Weights not split: {n_whole:,} parameters ({n_whole / total_params:.0%} of the model) "
                         f"held whole by every tp rank — more memory, computed {program.tp} times",
                         ("parameter (each layer as the first of its kind)", "elements", "why"), rows,
                         left=("parameter (each layer as the first of its kind)",), wrap=("why",))


def _rejected_table(program: Program) -> Table | None:
    """Linears left replicated, one row per module of the layer with the layers it covers."""
    if not program.plan.rejected:
        return None
    layers = program.layers
    rows, groups = [], {}
    for r in program.plan.rejected:
        layer = layers.node_layer.get(r.node)
        key = r.module.replace(layers.label(layer), "*", 1) if layer is not None else r.module
        groups.setdefault(key, []).append((layer, r))
    for entries in groups.values():
        idx = sorted(x for x, _ in entries if x is not None)
        first = entries[0][1]
        rows.append([first.node, first.module, _span(idx) if idx else "-", first.reason])
    return compact_table("Left replicated (not split)", ("node", "module", "layers", "why"), rows,
                         left=("node", "module", "layers"), wrap=("why",))


def _span(layers: list[int]) -> str:
    if not layers:
        return "-"
    return f"layer {layers[0]}" if len(layers) == 1 else f"layers {layers[0]}-{layers[-1]}"


def _mesh_line(mesh) -> str:
    """The axes, the world and how a rank is numbered (tp fastest, then cp, dp, pp)."""
    if mesh.cp == 1:
        return (f"mesh: tp={mesh.tp} x pp={mesh.pp} x dp={mesh.dp}{_ep_text(mesh)} = {mesh.world} ranks "
                f"(rank = tp + dp*{mesh.tp} + pp*{mesh.tp * mesh.dp})")
    t, c, d = mesh.tp, mesh.cp, mesh.dp
    return (f"mesh: tp={t} x cp={c} x pp={mesh.pp} x dp={d} = {mesh.world} ranks "
            f"(rank = tp + cp*{t} + dp*{t * c} + pp*{t * c * d})")


def _ranks(ranks: list[int]) -> str:
    """``4-7`` for consecutive ranks (a stage's, rank = tp + dp*t + pp*t*d), else listed."""
    if len(ranks) > 1 and ranks == list(range(ranks[0], ranks[-1] + 1)):
        return f"{ranks[0]}-{ranks[-1]}"
    return ",".join(map(str, ranks)) if len(ranks) <= 8 else f"{ranks[0]},{ranks[1]},...,{ranks[-1]}"


def _roles(program: Program) -> dict[str, str]:
    plan, traced = program.plan, program.traced
    nodes = {n.name: n for n in traced.gm.graph.nodes}
    roles: dict[str, str] = {}
    for name, dec in plan.decisions.items():
        kind = {"column": "column-parallel", "row": "row-parallel",
                "vocab_embedding": "vocab-parallel embedding"}.get(dec.kind)
        if not kind:
            continue
        for a in nodes[name].all_input_nodes:
            if a.name in traced.param_of:
                pname = traced.param_of[a.name]
                if kind not in roles.get(pname, ""):
                    roles[pname] = f"{roles[pname]}, {kind}" if pname in roles else kind
    for name, experts in program.expert_params.items():
        held = f"experts: E/ep = {experts // program.ep} of {experts} per rank"
        roles[name] = f"{roles[name]}, {held}" if name in roles else held
    return roles
