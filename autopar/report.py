"""``program.summary()``: the plan as rich tables rendered to text."""

from __future__ import annotations

import io
import math
from collections import Counter
from typing import TYPE_CHECKING

from rich.console import Console
from rich.table import Table

from autopar.placement import Shard

if TYPE_CHECKING:
    from autopar.api import ParallelProgram

__all__ = ["render_summary"]

_DIRECTION = {
    "copy_to_tp": "bwd all-reduce",
    "reduce_from_tp": "fwd all-reduce",
    "gather_from_tp": "fwd all-gather (fallback)",
    "scatter_to_tp": "bwd all-gather",
    "vocab_parallel_embedding": "fwd all-reduce",
    "vocab_parallel_cross_entropy": "fwd all-reduces: max, then (target logit, sum exp)",
}


def render_summary(program: "ParallelProgram", width: int = 120) -> str:
    console = Console(record=True, width=width, file=io.StringIO(), force_terminal=False, color_system=None)
    t = program.tp
    total = sum(math.prod(program.full_shape(n)) for n in program.param_names)
    local = program.local_numel()
    layers = program.layers
    console.print(f"[bold]autopar program[/bold]: {program.traced.model_name}, tensor parallel tp={t}; "
                  f"{layers.count} layers under '{layers.prefix}'; parameters {total:,} total, {local:,} per rank "
                  f"({local / max(total, 1):.1%})")

    sharded = Table(title="Parameters", show_lines=False)
    for col in ("parameter", "full shape", "placement", "local shape", "role"):
        sharded.add_column(col)
    roles = _roles(program)
    shown = Counter()
    for name in program.param_names:
        layer = program.layer_params(name)
        key = (layer is not None and layer > 0, _strip_layer(name, layers.prefix))
        if layer is not None and layer > 0:
            shown[key] += 1
            continue  # layers repeat: show layer 0 only
        spec = program.param_spec(name)
        sharded.add_row(name, str(list(program.full_shape(name))), repr(spec), str(list(program.local_shape(name))),
                        roles.get(name, ""))
    if layers.count > 1:
        sharded.caption = f"layers 1..{layers.count - 1} are split like layer 0"
    console.print(sharded)

    coll = Table(title="Collectives per step (one microbatch)")
    for col in ("where", "collective", "direction", "count"):
        coll.add_column(col)
    by_layer = program.collectives(by_layer=True)
    per_layer = Counter()
    for (layer, name), n in by_layer.items():
        if layer is not None:
            per_layer[name] += n
    for name, n in sorted(per_layer.items()):
        coll.add_row("per layer", name, _DIRECTION[name], f"{n // max(layers.count, 1)}")
    for (layer, name), n in sorted(by_layer.items(), key=lambda kv: str(kv[0])):
        if layer is None:
            coll.add_row("outside layers", name, _DIRECTION[name], str(n))
    console.print(coll)

    pads = [(n, program.full_shape(n), program.param_spec(n)) for n in program.param_names
            if isinstance(program.param_spec(n), Shard) and program.param_spec(n).segments
            and sum(program.param_spec(n).segments) != program.full_shape(n)[program.param_spec(n).dim]]
    for name, shape, spec in pads:
        console.print(f"vocabulary padding: {name} dim {spec.dim} {shape[spec.dim]} -> {sum(spec.segments)} "
                      f"(padded rows are never looked up and never win the softmax)")

    fallbacks = program.fallbacks()
    if fallbacks:
        fb = Table(title=f"Fallbacks: {len(fallbacks)} op(s) run replicated (inputs all-gathered) — slower")
        for col in ("node", "reason", "source"):
            fb.add_column(col)
        for node, reason, src in fallbacks:
            fb.add_row(node, reason, src)
        console.print(fb)
    else:
        console.print("fallbacks: none (every op on a sharded value has a rule)")
    if program.plan.rejected:
        rj = Table(title="Left replicated (not split)")
        for col in ("node", "module", "why"):
            rj.add_column(col)
        for r in program.plan.rejected:
            rj.add_row(r.node, r.module, r.reason)
        console.print(rj)
    return console.export_text()


def _strip_layer(name: str, prefix: str) -> str:
    if prefix and name.startswith(prefix + "."):
        rest = name[len(prefix) + 1 :]
        return rest.split(".", 1)[1] if "." in rest else rest
    return name


def _roles(program: "ParallelProgram") -> dict[str, str]:
    plan, traced = program.plan, program.traced
    nodes = {n.name: n for n in traced.gm.graph.nodes}
    roles = {}
    for name, dec in plan.decisions.items():
        kind = {"column": "column-parallel", "row": "row-parallel", "vocab_embedding": "vocab-parallel embedding"}.get(dec.kind)
        if not kind:
            continue
        for a in nodes[name].all_input_nodes:
            if a.name in traced.param_of:
                pname = traced.param_of[a.name]
                roles[pname] = roles[pname] + ", " + kind if pname in roles and kind not in roles[pname] else kind
    return roles
