"""The summary's overlap section: what ``overlap`` put under compute, and what it left and why.

Tensor parallelism: how many of sequence parallelism's all-gathers and
reduce-scatters were decomposed with their GEMMs (``passes/async_tp.py``), per
layer and outside the layers, and each one left whole with its reason; or why
the pass did not run. Pipeline: how many receives the training schedule posts
earlier than ``lower`` placed them (``schedules/early_receives.py``).
"""

from __future__ import annotations

import dataclasses
from collections import Counter
from typing import Any

from autopar.schedules import Schedule, lower
from passes.async_tp import async_tp_refusal

__all__ = ["overlap_lines"]

Program = Any
"""A ``autopar.compiler.program.Program`` (named, not imported: it imports the summary)."""


def overlap_lines(program: Program) -> list[str]:
    """The section as lines of text."""
    return [*_tp_lines(program), _p2p_line(program)]


def _tp_lines(program: Program) -> list[str]:
    plan = program.async_tp
    if plan is None:
        why = async_tp_refusal(program.config, program.sequence is not None)
        return [f"Overlap, tensor parallelism (async TP): off ({why})"]
    gathers, scatters = plan.count("gather_from_sp"), plan.count("reduce_scatter_to_sp")
    gemms = sum(len(f.gemms) for f in plan.fused if f.collective == "gather_from_sp")
    lines = [f"Overlap, tensor parallelism (async TP): {gathers} all-gather(s) decomposed in tp ring steps with "
             f"the {gemms} GEMM(s) reading them (all_gather_matmul), {scatters} reduce-scatter(s) with the "
             f"GEMM writing each (matmul_reduce_scatter); the same values, each chunk of tokens multiplied while "
             f"the next travels; backward: the input gradient's reduce-scatter and the re-gather of the input "
             f"(kept as this rank's slice) under the GEMMs"]
    nodes = {n.name: n for n in program.rank_module.graph.nodes}
    per_layer = Counter((program._layer_of_node(nodes[f.node]), f.collective) for f in plan.fused)
    layers = sorted({layer for layer, _ in per_layer if layer is not None})
    if layers:
        counts = Counter((per_layer[(i, "gather_from_sp")], per_layer[(i, "reduce_scatter_to_sp")]) for i in layers)
        lines.append("  per layer: " + "; ".join(f"{g} all-gather(s) + {r} reduce-scatter(s) in {n} layer(s)"
                                                  for (g, r), n in counts.items()))
    outside = [f for f in plan.fused if program._layer_of_node(nodes[f.node]) is None]
    if outside:
        lines.append("  outside the layers: " + ", ".join(f"{f.collective} -> {', '.join(f.gemms)} in {f.module}"
                                                          for f in outside))
    lines += [f"  left whole: {w.node} ({w.collective} in {w.module}): {w.reason}" for w in plan.left]
    return lines


def _p2p_line(program: Program) -> str:
    cfg = program.config
    if "p2p" not in cfg.overlap:
        why = "pp=1" if cfg.pp == 1 else "overlap has no 'p2p'"
        return f"Overlap, pipeline receives: as lowered, each in the gap before its consumer ({why})"
    early, moved = _moved_receives(program.schedule)
    return (f"Overlap, pipeline receives: posted as early as the exchanges allow, {moved} of {early} earlier than "
            f"lowered (in flight during the compute before their consumer; gloo waits for each receive alone)")


def _moved_receives(schedule: Schedule) -> tuple[int, int]:
    """(receives, how many of them ``schedule`` posts before the compute action ``lower`` put them after)."""
    compute = dataclasses.replace(schedule, actions={s: [a for a in acts if a.is_compute]
                                                     for s, acts in schedule.actions.items()})
    lowered = lower(compute)
    receives = moved = 0
    for s, acts in schedule.actions.items():
        before = _computes_before(acts)
        for a, n in _computes_before(lowered.actions[s]).items():
            receives += 1
            moved += before[a] < n
    return receives, moved


def _computes_before(actions: list) -> dict:
    """Each receive of a stage's list -> how many compute actions precede it."""
    out, n = {}, 0
    for a in actions:
        if a.is_compute:
            n += 1
        elif a.is_recv:
            out[a] = n
    return out
