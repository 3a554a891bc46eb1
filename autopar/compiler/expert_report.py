"""The summary's experts section: the mixture-of-experts layers found, and how expert parallelism splits them.

Each layer's router (its module, E experts, top-k), the experts' module and
stacked weights; with ep > 1 the expert groups and the expert replicas (the
mesh's ``ep_groups``/``expert_dp_groups``), which experts each expert-parallel
rank holds, and what the dispatcher moves per layer and microbatch; experts
written as a list of modules, which the compiler stacked. The load
(rows routed to each expert) is a run's figure: ``engine.expert_load()`` after
a step. A layer expert parallelism cannot split says why.
"""

from __future__ import annotations

from typing import Any

import torch

from autopar.core.graph import local_val
from passes.experts import ExpertLayer

__all__ = ["expert_lines", "exchange_bytes"]

Program = Any
"""A ``autopar.compiler.program.Program`` (named, not imported: it imports the summary)."""


def exchange_bytes(program: Program, layer: ExpertLayer) -> dict[str, int]:
    """Bytes one rank moves over its expert group for ``layer`` per microbatch, forward and backward:
    'allgather' receives (ep-1) x S rows of the region's inputs and reduce-scatters ep x S rows of its
    output (the backward the same, conjugated); 'alltoall' sends and receives the rows of the other
    ranks' experts, (ep-1)/ep of its S rows on average each way when the load is balanced. With whole
    experts under tensor parallelism (``expert_tp=1``) a rank sends its 1/t block of the S rows, and
    the results are all-gathered over tp ((t-1)/t of S rows of the output; the backward all-gathers
    the rows' gradient instead)."""
    ep = program.ep
    if ep == 1:
        return {"forward": 0, "backward": 0}
    nodes = {n.name: n for n in program.rank_module.graph.nodes}
    row_in = sum(_row_bytes(nodes[n]) for n in layer.rows_in if n in nodes)
    row_out = _row_bytes(nodes[layer.output]) if layer.output in nodes else 0
    split = program.config.mesh.rows_split
    rows = -(-layer.rows // split)
    if program.config.expert_dispatch == "allgather":
        moved = (ep - 1) * rows * (row_in + row_out)
    else:
        moved = (ep - 1) * rows * (row_in + row_out) // ep
    if split > 1:
        return {"forward": moved + (split - 1) * rows * row_out, "backward": moved + (split - 1) * rows * row_in}
    return {"forward": moved, "backward": moved}


def _row_bytes(node) -> int:
    val = local_val(node)
    if not isinstance(val, torch.Tensor) or val.dim() == 0 or val.shape[0] == 0:
        return 0
    return val.numel() // val.shape[0] * val.element_size()


def expert_lines(program: Program) -> list[str]:
    """The section as lines of text ([] for a model without experts)."""
    layers = list(program.experts)
    if not layers:
        return []
    first = layers[0]
    k = f"top-{first.top_k}" if first.top_k is not None else "no top-k found"
    lines = [f"Mixture of experts: {len(layers)} layer(s) of {first.experts} experts ({k}), router "
             f"{first.router or '-'}, experts {first.module} (weights {', '.join(_param_names(program, first))}); "
             f"every other linear (a shared expert, its gate) is dense"]
    lists = sorted({name.split(".*.")[0] for name in program.traced.stacked})
    if lists:
        lines.append(f"  written as lists of expert modules ({', '.join(lists[:3])}{' ...' if len(lists) > 3 else ''}"
                     f"): each stacked into one grouped computation, its weights as {lists[0]}.*.<name>; "
                     f"checkpoints and exports keep the model's per-expert names")
    mesh, cfg = program.config.mesh, program.config
    if program.ep == 1:
        lines.append("  expert parallelism: off (ep=1): every replica holds every expert"
                     + (f", each expert's MLP split over tp={mesh.tp}" if mesh.tp > 1 else ""))
        for layer in layers:
            if layer.refusal:
                lines.append(f"  {layer.module}: ep could not split it: {layer.refusal}")
        return lines
    per = first.experts // program.ep
    split = (f", each split over tp={mesh.tp}" if mesh.etp > 1 else
             f", whole (expert_tp=1): the tp={mesh.tp} ranks of a replica each send 1/{mesh.tp} of its rows, "
             f"the results gathered back over tp" if mesh.tp > 1 else "")
    lines.append(f"  expert parallelism ep={program.ep} ({cfg.expert_dispatch} dispatcher): {per} experts per "
                 f"rank{split}")
    lines.append(f"  expert groups (exchange tokens): {_groups(mesh.ep_groups())}")
    if mesh.edp > 1:
        lines.append(f"  expert replicas (average expert gradients, {mesh.edp} ranks): "
                     f"{_groups(mesh.expert_dp_groups())}")
    lines.append("  experts held: " + ", ".join(f"ep rank {r}: {r * per}-{(r + 1) * per - 1}"
                                                for r in range(program.ep)))
    moved = exchange_bytes(program, first)
    what = ("all-gather of the group's rows, reduce-scatter of the results" if cfg.expert_dispatch == "allgather"
            else "all-to-all of the routed rows and back, after the counts (balanced load assumed)")
    lines.append(f"  per layer and microbatch: {first.rows} rows, {_mib(moved['forward'])} forward + "
                 f"{_mib(moved['backward'])} backward per rank ({what}); the load per expert: "
                 f"engine.expert_load() after a step")
    return lines


def _param_names(program: Program, layer: ExpertLayer) -> list[str]:
    names = [program.traced.param_of.get(p, p) for p in layer.params]
    return [n.split(".*.", 1)[1] if ".*." in n else n.rsplit(".", 1)[-1] for n in names]


def _groups(groups: list[list[int]]) -> str:
    shown = " ".join("[" + ",".join(map(str, g)) + "]" for g in groups[:6])
    return shown + (f" ... ({len(groups)} groups)" if len(groups) > 6 else "")


def _mib(n: float) -> str:
    return f"{n / 2**20:.1f} MiB" if n >= 2**20 else f"{n / 2**10:.1f} KiB"
