"""``engine.save_pretrained(path)``: a running engine's model as a HuggingFace directory.

Written by the ranks that hold the weights, never gathered on one rank: each
pipeline stage writes its own file (``model-0000k-of-0000p.safetensors``, or
``model.safetensors`` when p = 1), one tensor at a time, by the rank at tp rank
0 of data-parallel replica 0 of that stage. A sharded parameter is all-gathered
over that stage's tp group only (never over pp), its vocabulary padding dropped
and its fused segments put back in the model's order, then streamed to the file.
With expert parallelism, the ranks of replica 0's expert group (dp ranks
0..ep-1) take part too: a stacked expert weight is all-gathered over that
group (each holds E/ep experts), then written by the same rank.

What is written is the model's own ``state_dict()`` (``state_keys``): its names
and unpadded shapes, persistent buffers, not non-persistent ones (a rotary
``inv_freq``), under HuggingFace's rules for tied weights and ignored keys and,
for a HuggingFace model, under the names and in the layout its own
``save_pretrained`` writes (``layout.saved_tensors``: transformers' checkpoint
conversion reversed, GPT-NeoX's ``lm_head`` written as ``embed_out``, stacked
experts one tensor each). A written tensor made of several of the model's is
written by their stage (they must share one). A parameter that several stages
read (a tied embedding and LM head on the first and last stages) is written
once, by the first of them; a buffer by the first stage that reads it. Global
rank 0 writes the index (p > 1) and ``config.json`` /
``generation_config.json`` for a HuggingFace model.

Collective: every rank calls it. The directory is checked on the writing ranks,
and every rank's parameters for NaN and infinities, before any work (a
directory that cannot take the export, or a non-finite weight: ``CheckpointError``
on every rank), and a rank whose write fails keeps taking part in its stage's gathers;
every rank then learns of every failure and raises it (``ExportError``), so no
rank is left waiting.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from autopar.compiler.state_keys import StateSource, state_sources, untraced_value
from autopar.core.comm import TPGroup, whole_from_shards
from autopar.core.mesh import Mesh
from autopar.core.tensor_placement import Shard
from autopar.runtime.checkpoint.errors import CheckpointError
from autopar.runtime.hf.conversion import Lazy, Leaf, Reads, Region, region_slices
from autopar.runtime.hf.errors import ExportError
from autopar.runtime.hf.layout import (FILE_METADATA, HFFile, check_output_dir, remove_stale_weight_files,
                                       saved_tensors, weight_file_name, write_directory_files)
from autopar.runtime.hf.safetensors_stream import SafetensorsStream, TensorEntry

if TYPE_CHECKING:
    from autopar.compiler.program import Program

__all__ = ["RankHoldings", "save_pretrained", "stage_files"]


@dataclass(frozen=True)
class RankHoldings:
    """What one rank holds of the model: the engine's program, mesh, shards and buffers."""

    program: "Program"
    mesh: Mesh
    tp: TPGroup
    shards: dict[str, torch.Tensor]
    """Canonical parameter name -> this rank's shard (its stage's parameters only)."""
    feeds: dict[str, torch.Tensor]
    """Graph placeholder -> buffer or constant, whole."""
    device: torch.device


def save_pretrained(path: str, rank: RankHoldings) -> list[str]:
    """Write the HuggingFace directory ``path``; the names of the files this rank wrote."""
    program, mesh, path = rank.program, rank.mesh, str(path)
    files, values = stage_files(program)
    writer = mesh.dp_rank == 0 and mesh.cp_rank == 0 and mesh.tp_rank == 0
    problems = [p for p in (check_output_dir(path) if writer else None, _nonfinite_weights(rank)) if p]
    _raise_if_any("; ".join(problems) or None, CheckpointError)
    written, error = [], None
    # replica 0, with the rest of its expert group; its cp rank 0 (the others hold the same weights)
    if mesh.dp_rank < mesh.shape.replicas_with_every_expert and mesh.cp_rank == 0:
        file = files[mesh.pp_rank]
        error = _write_file(os.path.join(path, file.name), file, _file_values(rank, file, values), writer)
        written = [file.name] if writer and error is None else []
    if _global_rank() == 0 and error is None:
        error, extra = _guarded(_write_directory_files, path, program, files)
        written += extra or []
    _raise_if_any(error, ExportError)
    return written


def _nonfinite_weights(rank: RankHoldings) -> str | None:
    """The parameters of this rank holding a NaN or an infinity, as one problem (None when all are
    finite): an export is never written with non-finite weights, as a checkpoint is not."""
    names = list(rank.shards)
    if not names:
        return None
    finite = torch.stack([torch.isfinite(rank.shards[n].detach()).all() for n in names]).tolist()  # one transfer
    bad = [n for n, ok in zip(names, finite) if not ok]
    if not bad:
        return None
    shown = ", ".join(bad[:6]) + (f" and {len(bad) - 6} more" if len(bad) > 6 else "")
    return (f"parameter(s) {shown} hold NaN or infinite values: an export is never written with non-finite "
            f"weights, and nothing was written. Fix: find the step that made them (engine.last_step; "
            f"engine.optimizer_step skips such steps instead of applying them) and export from the last "
            f"checkpoint")


def stage_files(program: "Program") -> tuple[list[HFFile], dict[str, Lazy]]:
    """One file per pipeline stage, each with the tensors its stage writes in the model's key
    order; and written name -> its value over the model's tensors (each a ``Leaf`` whose ``info``
    is its ``StateSource``). Tied duplicates and ignored keys left out; names and shapes as
    ``save_pretrained`` writes them."""
    stored = {source.key: Leaf.of_shape(source.key, source.shape, source.dtype, source)
              for source in state_sources(program)}
    values = saved_tensors(program.model, stored, program.traced.aliases.values())
    p = program.pp
    by_stage: list[list[TensorEntry]] = [[] for _ in range(p)]
    for name, value in values.items():
        leaves = value.leaves()
        stages = sorted({_writing_stage(program, leaf.info) for leaf in leaves})
        if len(stages) > 1:
            raise CheckpointError(f"'{name}' is saved as one tensor made of {[leaf.key for leaf in leaves]}, "
                                  f"which pipeline stages {stages} hold: save_pretrained writes each stage's "
                                  "tensors on that stage; export a checkpoint instead (engine.save, then autopar "
                                  "export --to-hf)")
        by_stage[stages[0]].append(TensorEntry(name, tuple(value.shape), value.dtype))
    return [HFFile(weight_file_name(s + 1, p), tuple(entries)) for s, entries in enumerate(by_stage)], values


def _file_values(rank: RankHoldings, file: HFFile, values: dict[str, Lazy]) -> Callable[[TensorEntry], torch.Tensor]:
    """Each entry's whole value, asked for in the file's order: a model tensor that several
    written ones are made of is made whole once (gathered over tp) and kept until the last of them."""
    position = {e.name: i for i, e in enumerate(file.entries)}
    last_use = {leaf.key: position[e.name] for e in file.entries for leaf in values[e.name].leaves()}
    held: dict[str, torch.Tensor] = {}

    def fetch(leaf: Leaf, region: Region | None) -> torch.Tensor:
        if leaf.key not in held:
            held[leaf.key] = _whole(rank, leaf.info)
        value = held[leaf.key]
        return value if region is None else value[region_slices(region)]

    reads = Reads(fetch)

    def whole(entry: TensorEntry) -> torch.Tensor:
        try:
            return values[entry.name].whole(reads)
        finally:
            for key in [k for k in held if last_use[k] <= position[entry.name]]:
                del held[key]

    return whole


def _writing_stage(program: "Program", source: StateSource) -> int:
    """The stage that writes ``source``: the first holding the parameter, the first reading the
    buffer; stage 0 for what no graph reads."""
    if source.kind == "param":
        return program.param_stages[source.name][0]
    if source.kind == "buffer":
        readers = [program.stage_of_chunk(c.index) for c in program.split.chunks if source.name in c.feeds]
        return min(readers, default=0)
    return 0


def _whole(rank: RankHoldings, source: StateSource) -> torch.Tensor:
    """The whole value of ``source`` on the engine's device; a sharded parameter all-gathered over
    this stage's tp group (collective on it), padding dropped; a stacked expert weight then over the
    expert group (collective on it: each rank holds E/ep experts)."""
    program = rank.program
    if source.kind == "buffer":
        return rank.feeds[source.name]
    if source.kind == "model":
        return untraced_value(program, source, rank.device)
    value = rank.shards[source.name].detach()
    spec = program.param_spec(source.name)
    shape = program.full_shape(source.name) if source.index is not None else source.shape
    if isinstance(spec, Shard):
        value = whole_from_shards(value, rank.tp, spec.dim, spec.segments, shape[spec.dim])
    mesh = rank.mesh
    if source.name in program.expert_params and mesh.groups.get("ep") is not None:  # E/ep experts per rank
        group = TPGroup.of(mesh.groups["ep"], tuple(mesh.ep_members()))
        value = whole_from_shards(value, group, 0, None, shape[0])
    return value if source.index is None else value[source.index]


def _write_file(path: str, file: HFFile, whole: Callable[[TensorEntry], torch.Tensor], writes: bool) -> str | None:
    """Every tensor of ``file`` made whole, in order (collective over the stage's tp group); the
    writing rank streams them to ``path``. A failure is returned, not raised, after every gather
    has run, so the stage's other ranks are never left waiting."""
    stream, error = None, None
    if writes:
        error, stream = _guarded(SafetensorsStream, path, list(file.entries), FILE_METADATA)
    for entry in file.entries:
        failed, value = _guarded(whole, entry)  # a value that cannot be made (left on meta) is reported, not raised
        error = error or failed
        if stream is not None and error is None:
            error, _ = _guarded(stream.write, entry.name, value)
    if stream is not None:
        failed, _ = _guarded(stream.abort if error else stream.close)
        error = error or failed
    return error


def _write_directory_files(path: str, program: "Program", files: list[HFFile]) -> list[str]:
    """The index (more than one file) and the HuggingFace configs: what rank 0 writes after its
    stage's file; weight files of an earlier save in ``path`` (never this save's) removed."""
    remove_stale_weight_files(path, [f.name for f in files])
    total_parameters = sum(p.numel() for p in program.model.parameters())
    return write_directory_files(path, files, total_parameters, program.model)


def _guarded(action: Callable, *args):
    """(error message or None, ``action(*args)`` or None)."""
    try:
        return None, action(*args)
    except Exception as e:
        return f"{type(e).__name__}: {e}", None


def _global_rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def _raise_if_any(error: str | None, kind: type[Exception]) -> None:
    """Raise ``kind`` on every rank if any rank has an error, naming each failing rank.
    Collective over the world (the agreement is what keeps no rank waiting on a failed one)."""
    if dist.is_initialized() and dist.get_world_size() > 1:
        errors = [None] * dist.get_world_size()
        dist.all_gather_object(errors, error)
    else:
        errors = [error]
    failed = [f"rank {r}: {e}" for r, e in enumerate(errors) if e is not None]
    if failed:
        raise kind("save_pretrained failed on " + ("; ".join(failed)))
