"""From a compiled program to one rank's engine: its mesh groups and its parameter shards.

Collective: every rank of the world calls it (the process groups are created
here). A process started by ``autopar run`` or torchrun that is in no process
group yet joins the one they set up (``launch.join_from_env``): NCCL on
``cuda:LOCAL_RANK`` where GPUs exist, gloo on the CPU elsewhere. Each rank
keeps only the slices of the parameters its pipeline stage reads (its piece
of the full weight along the sharded dim), on the rank's
device: the current GPU when the process group is NCCL (it communicates GPU
tensors only), else the full weights' device. The engine computes there.

The weights come from a ``state_dict``, a HuggingFace safetensors
``checkpoint`` read slice by slice, the model's own parameters, or, for a
model on the meta device, its own initialisation made one module at a time
(``weight_plan`` decides and checks, before any other work); with no full
weights given, the rank's device is the CPU (the GPU under NCCL). The base
seed of that initialisation is rank 0's (``seed``, or its
``torch.initial_seed()``), so every layout makes the same full weights as
``init_weights(model, seed)``. A rank that fails while making its weights
makes every rank fail, naming it.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

import torch
import torch.distributed as dist

from autopar.compiler.program import Program
from autopar.core.mesh import Mesh
from autopar.runtime.engine import RankEngine, rank_device
from autopar.runtime.engine.errors import EngineRuntimeError, EngineUsageError
from autopar.runtime.launch import join_from_env
from autopar.runtime.weights.weight_plan import plan_weights

__all__ = ["materialize"]


def materialize(program: Program, state_dict: dict[str, torch.Tensor] | None = None,
                checkpoint: str | Path | None = None, seed: int | None = None) -> RankEngine:
    """This rank's engine.

    ``state_dict``: full weights to use instead of the model's (or only buffers a
    meta-device model cannot make). ``checkpoint``: a HuggingFace safetensors
    checkpoint (a directory with ``model.safetensors`` or its sharded index) to
    read this rank's slices from. Neither, and a model on the meta device: its
    own initialisation, seeded by ``seed`` (default: rank 0's ``torch.initial_seed()``).
    """
    shape = program.config.mesh
    if shape.world > 1:
        join_from_env()
    world = dist.get_world_size() if dist.is_initialized() else 1
    if world != shape.world:
        cp = f" * cp({shape.cp})" if shape.cp > 1 else ""
        raise EngineUsageError(f"the program needs tp({shape.tp}){cp} * pp({shape.pp}) * dp({shape.dp}) = "
                               f"{shape.world} ranks, but {_world_hint(world, shape.world)}")
    # every rank checks the same inputs, but a file one node lacks fails one rank only: all stop
    weights = _on_every_rank("checking its weights", lambda: plan_weights(program, state_dict, checkpoint))
    mesh = Mesh.create(shape, sorted(set(program.tied_params.values())))
    device = _device(weights.given.values())
    base_seed = _rank0_seed(seed, device)
    local, buffers = _on_every_rank("making its weights", lambda: weights.load(
        mesh.pp_rank, mesh.tp_rank, device, base_seed, mesh.ep_rank))
    return RankEngine(program, mesh, local, _replicated_inputs(program, buffers, device))


_T = TypeVar("_T")


def _on_every_rank(what: str, make: Callable[[], _T]) -> _T:
    """``make()``; when it raised on any rank, every rank raises (no rank waits for ever on a
    collective a failed one never joins): the failed rank its own error, the others one naming it."""
    error, result = None, None
    try:
        result = make()
    except Exception as e:  # noqa: BLE001 - reported to every rank, then re-raised
        error = e
    if dist.is_initialized() and dist.get_world_size() > 1:
        reports: list = [None] * dist.get_world_size()
        dist.all_gather_object(reports, None if error is None else f"{type(error).__name__}: {error}")
        failed = [(rank, text) for rank, text in enumerate(reports) if text is not None]
        if failed and error is None:
            rank, text = failed[0]
            raise EngineRuntimeError(f"rank {rank} failed {what}, so rank {dist.get_rank()} stops too: {text}")
    if error is not None:
        raise error
    return result


def _rank0_seed(seed: int | None, device: torch.device) -> int:
    """The base seed of the initialisation: ``seed`` or ``torch.initial_seed()``, rank 0's."""
    base = torch.tensor([(torch.initial_seed() if seed is None else int(seed)) % 2**63], dtype=torch.int64,
                        device=device)
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.broadcast(base, src=0)
    return int(base)


def _world_hint(world: int, want: int) -> str:
    if dist.is_initialized():
        return (f"the process group has {world}: start {want} ranks, or compile for this world "
                f"(parallelize(..., world_size={world}) with tp * cp * pp dividing {world})")
    return (f"this process is in no process group (it was not started by a launcher): start {want} ranks with "
            f"`autopar run --nproc {want} script.py` or `torchrun --nproc-per-node {want} script.py` "
            f"(materialize joins the group they set up), or run a function on {want} local ranks with "
            f"autopar.spawn(fn, {want})")


def _device(weights) -> torch.device:
    """The current GPU under NCCL, else the weights' device (the CPU for none). A script that made its
    NCCL group without choosing a GPU (the current one still 0) gets the GPU of its ``LOCAL_RANK``,
    not every rank on GPU 0."""
    if dist.is_initialized() and dist.get_backend() == "nccl":
        local = int(os.environ.get("LOCAL_RANK", 0)) % torch.cuda.device_count()
        if torch.cuda.current_device() == 0 and local != 0:
            torch.cuda.set_device(local)
        return torch.device("cuda", torch.cuda.current_device())
    return rank_device(t for w in weights for t in (w if isinstance(w, tuple) else (w,)))


def _replicated_inputs(program: Program, buffers: dict[str, torch.Tensor], device: torch.device
                       ) -> dict[str, torch.Tensor]:
    """Buffers (by name) and lifted constants by placeholder: every rank holds them whole. An
    empty constant traced on the meta device is made empty on ``device`` (``plan_weights``
    refuses one with elements)."""
    out = {}
    for ph, name in program.traced.buffer_of.items():
        out[ph] = buffers[name]
    for ph, name in program.traced.constant_of.items():
        value = program.traced.constants[name]
        out[ph] = torch.empty(value.shape, dtype=value.dtype, device=device) if value.is_meta else value
    return out
