"""What a rank puts into a checkpoint and takes back out: its shards as pieces of the full
parameters, the persistent buffers, its random stream, and ``autopar.json``.

Keys (DCP's flat state dict):

- ``model.<name>``   each parameter in its full, unpadded shape as in the user's
                     model (``program.full_shape``), this rank's shard as pieces
                     at their global offsets (``param_regions``: a stacked
                     expert weight's at expert-parallel rank e start at its
                     first expert on dim 0, its tp regions on the other dims);
- ``buffer.<name>``  each persistent buffer, whole (every rank holds it; DCP
                     writes it once), and any other ``state_dict`` tensor the
                     graph never reads (``state_keys``);
- ``rng.<stage>.<replica>.<i>``  the engine's random stream (generator i: the
                     CPU's, then the GPU's), one per (pipeline stage, dp replica):
                     the t ranks of a stage draw alike, so tp rank 0 saves it.
                     With context parallelism each cp rank has its own stream:
                     ``rng.<stage>.<replica>.cp<c>.<i>``.

Context parallelism does not change what the parameters are: the c ranks of a
replica hold the same shards, as replicas do, so their identical pieces are
written once (DCP keeps one of identical chunks) and a checkpoint saved at one
cp loads at any other. ``autopar.json``'s layout names ``cp`` when it is > 1.

The optimizer's keys are ``optimizer_state``'s. What is read of the engine is
narrow: its ``holdings`` (``engine.holdings``: the program, the mesh, the
device, the shards by name, the feeds) and its ``stream`` (``engine.random_stream``:
``get_state``/``set_state``/``reseed``), left unannotated because the engine
imports the checkpoint code, not the other way round.
"""

from __future__ import annotations

import json
from typing import TYPE_CHECKING

import torch

from autopar.core.tensor_placement import Shard
from autopar.runtime.checkpoint.dcp import Pieces
from autopar.runtime.checkpoint.description import FORMAT
from autopar.compiler.state_keys import state_sources, untraced_value

if TYPE_CHECKING:
    from autopar.compiler.program import Program

__all__ = ["shard_regions", "param_regions", "shard_pieces", "as_pieces", "model_entries", "buffer_entries",
           "rng_entries", "rng_targets", "restore_rng", "describe", "same_streams"]

_GOLDEN = 0x9E3779B97F4A7C15
"""Mixes the step into a reseeded stream (an odd constant: consecutive steps land far apart)."""


def shard_regions(spec, full_shape: tuple[int, ...], rank: int, t: int) -> list[tuple[torch.Size, int, int, int]]:
    """Where tensor-parallel rank ``rank``'s shard lies in the full tensor: (global offsets of the
    region, the dim it is cut along, its first local index on that dim, its length there) each.

    ``Shard(dim, segments)``: rank r holds every segment's r-th 1/t, so one
    region per segment; rows past the full size (vocabulary padding) belong to
    no region. ``Replicate``: the whole tensor at offset 0 (length -1: all of it).
    """
    zeros = [0] * len(full_shape)
    if not isinstance(spec, Shard) or (t == 1 and spec.segments is None):
        return [(torch.Size(zeros), 0, 0, -1)]
    dim, full = spec.dim, full_shape[spec.dim]
    regions, local_start, global_start = [], 0, 0
    for size in spec.segments or (full,):
        n = size // t
        first = global_start + rank * n
        rows = min(n, full - first)
        if rows > 0:
            offsets = list(zeros)
            offsets[dim] = first
            regions.append((torch.Size(offsets), dim, local_start, rows))
        local_start += n
        global_start += size
    return regions


def param_regions(program: "Program", name: str, tp_rank: int,
                  ep_rank: int = 0) -> list[tuple[torch.Size, int, int, int]]:
    """``shard_regions`` of parameter ``name`` on (``tp_rank``, ``ep_rank``): a stacked expert weight's
    shard holds experts ``program.expert_range(name, ep_rank)`` only, so each of its tp regions (cut
    along another dim, never dim 0) is moved to that first expert on dim 0; a region whole along
    the cut (length -1) then stands for the rank's whole (E/ep, ...) shard at those offsets."""
    regions = shard_regions(program.param_spec(name), program.full_shape(name), tp_rank, program.tp)
    experts = program.expert_range(name, ep_rank)
    if experts is None:
        return regions
    first = experts[0]
    return [(torch.Size([offsets[0] + first, *offsets[1:]]), dim, start, rows)
            for offsets, dim, start, rows in regions]


def shard_pieces(local: torch.Tensor, spec, full_shape: tuple[int, ...], rank: int,
                 t: int) -> list[tuple[torch.Size, torch.Tensor]]:
    """Tensor-parallel rank ``rank``'s shard ``local`` as (global offsets, view) pieces of the full
    tensor, one per region of ``shard_regions``."""
    return _pieces(local, shard_regions(spec, full_shape, rank, t))


def _pieces(local: torch.Tensor, regions) -> list[tuple[torch.Size, torch.Tensor]]:
    return [(offsets, local if rows < 0 else local.narrow(dim, start, rows)) for offsets, dim, start, rows in regions]


def as_pieces(program: "Program", name: str, local: torch.Tensor, tp_rank: int, ep_rank: int = 0) -> Pieces:
    """A tensor shaped like parameter ``name``'s shard (the shard, a moment) as pieces of its full shape."""
    return Pieces(torch.Size(program.full_shape(name)),
                  _pieces(local.detach(), param_regions(program, name, tp_rank, ep_rank)))


def model_entries(holdings) -> dict[str, Pieces]:
    """``model.<name>`` for every parameter this rank holds (views of its shards)."""
    mesh = holdings.mesh
    return {f"model.{name}": as_pieces(holdings.program, name, shard, mesh.tp_rank, mesh.ep_rank)
            for name, shard in holdings.named_local_parameters()}


def buffer_entries(holdings, *, saving: bool) -> dict[str, torch.Tensor]:
    """``buffer.<key>`` for every tensor of the model's ``state_dict()`` that is not a trained parameter.

    A persistent buffer the graph reads is the engine's own tensor (a load
    writes into it); one the graph never reads is unchanged since the model was
    built, so it is saved (a reader of the checkpoint gets the whole
    ``state_dict``) but not loaded (``saving=False`` leaves it out).
    """
    out = {}
    for source in state_sources(holdings.program):
        if source.kind == "buffer":
            out[f"buffer.{source.key}"] = holdings.feeds[source.name]
        elif source.kind == "model" and saving:
            out[f"buffer.{source.key}"] = untraced_value(holdings.program, source, holdings.device)
    return out


def _stream_keys(mesh, stream) -> list[str]:
    """``rng.<stage>.<replica>.<i>`` of each generator of this rank's stream (``rng.<stage>.<replica>.cp<c>.<i>``
    with context parallelism)."""
    cp = f"cp{mesh.cp_rank}." if mesh.shape.cp > 1 else ""
    return [f"rng.{mesh.pp_rank}.{mesh.dp_rank}.{cp}{i}" for i in range(len(stream.get_state()))]


def rng_entries(holdings, stream) -> dict[str, torch.Tensor]:
    """The random stream of this rank's (stage, replica, cp rank), from tp rank 0 only, on the engine's device."""
    if holdings.mesh.tp_rank != 0:
        return {}
    return {k: state.to(holdings.device, copy=True)
            for k, state in zip(_stream_keys(holdings.mesh, stream), stream.get_state())}


def same_streams(holdings, stream, layout: dict, saved_keys) -> bool:
    """Whether the checkpoint holds this rank's own stream: saved with as many pipeline stages and
    replicas and cp ranks, and as many generators (a CPU run's stream does not continue on a GPU)."""
    shape = holdings.mesh.shape
    keys = set(_stream_keys(holdings.mesh, stream))
    saved = [k for k in saved_keys if k in keys]
    return (layout.get("pp") == shape.pp and layout.get("dp") == shape.dp and layout.get("cp", 1) == shape.cp
            and len(saved) == len(stream.get_state()))


def rng_targets(holdings, stream) -> dict[str, torch.Tensor]:
    """Tensors on the engine's device that a load fills with this rank's saved stream."""
    return {k: torch.empty_like(state, device=holdings.device)
            for k, state in zip(_stream_keys(holdings.mesh, stream), stream.get_state())}


def restore_rng(holdings, stream, loaded: dict, step: int) -> None:
    """Continue the saved stream (``loaded`` holds ``rng_targets`` filled), or, at another layout
    where this rank's stream was never saved, reseed it from its own seed and the step: the masks
    after a resume then differ from the first steps' instead of repeating them."""
    keys = _stream_keys(holdings.mesh, stream)
    if all(k in loaded for k in keys):
        stream.set_state([loaded[k] for k in keys])
        return
    stream.reseed((stream.seed + _GOLDEN * (step + 1)) % 2**63)


def describe(program: "Program", step: int) -> dict:
    """``autopar.json``: what a reader without a process group needs (``docs/training.md``)."""
    buffers = {s.key: list(s.shape) for s in state_sources(program) if s.kind != "param"}
    config = program.config
    return {
        "format": FORMAT,
        "step": step,
        "params": {name: list(program.full_shape(name)) for name in program.param_names},
        "aliases": {name: list(program.traced.aliases.get(name, [name])) for name in program.param_names},
        "buffers": buffers,
        **({"stacked": {name: list(m) for name, m in program.traced.stacked.items()}} if program.traced.stacked
           else {}),
        "hf_config": _hf_config(program.model),
        "layout": {"tp": config.tp, "pp": config.pp, "dp": config.data_parallel,
                   "virtual_stages": config.virtual_stages, **({"ep": config.ep} if config.ep > 1 else {}),
                   **({"cp": config.cp} if config.cp > 1 else {})},
    }


def _hf_config(model) -> dict | None:
    """The model's HuggingFace config as a dict, when it has one; values JSON cannot hold become strings."""
    config = getattr(model, "config", None)
    if config is None or not callable(getattr(config, "to_dict", None)):
        return None
    return json.loads(json.dumps(config.to_dict(), default=str))
