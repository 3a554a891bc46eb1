"""From a compiled program to one rank's engine: its mesh groups and its parameter shards.

Collective: every rank of the world calls it (the process groups are created
here). A process started by ``autopar run`` or torchrun that is in no process
group yet joins the one they set up (``launch.join_from_env``): NCCL on
``cuda:LOCAL_RANK`` where GPUs exist, gloo on the CPU elsewhere. Each rank keeps only the slices of the parameters its pipeline stage
reads (``local_slice`` of the full weight along the sharded dim), on the rank's
device: the current GPU when the process group is NCCL (it communicates GPU
tensors only), else the full weights' device. The engine computes there.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from autopar.compiler.program import Program
from autopar.core.comm import local_slice
from autopar.core.mesh import Mesh
from autopar.core.placement import Shard
from autopar.runtime.engine import RankEngine, rank_device
from autopar.runtime.launch import join_from_env

__all__ = ["materialize"]


def materialize(program: Program, state_dict: dict[str, torch.Tensor] | None = None) -> RankEngine:
    """This rank's engine. ``state_dict``: full weights to use instead of the model's
    (needed for a meta-device model)."""
    full = _full_weights(program, state_dict)
    shape = program.config.mesh
    if shape.world > 1:
        join_from_env()
    world = dist.get_world_size() if dist.is_initialized() else 1
    if world != shape.world:
        raise ValueError(f"the program needs tp({shape.tp}) * pp({shape.pp}) * dp({shape.dp}) = {shape.world} "
                         f"ranks, but {_world_hint(world, shape.world)}")
    mesh = Mesh.create(shape, sorted(set(program.tied_params.values())))
    tp_rank, stage = mesh.tp_rank, mesh.pp_rank
    device = _device(full[n] for n in program.param_names)
    local = {}
    for name in program.param_names:
        if stage not in program.param_stages[name]:
            continue
        spec = program.param_spec(name)
        w = full[name].detach()
        if isinstance(spec, Shard):
            w = local_slice(w, tp_rank, program.tp, spec.dim, spec.segments)
        local[name] = w.to(device, copy=True).contiguous()
    return RankEngine(program, mesh, local, _replicated_inputs(program, state_dict))


def _world_hint(world: int, want: int) -> str:
    if dist.is_initialized():
        return (f"the process group has {world}: start {want} ranks, or compile for this world "
                f"(parallelize(..., world_size={world}) with tp * pp dividing {world})")
    return (f"this process is in no process group (it was not started by a launcher): start {want} ranks with "
            f"`autopar run --nproc {want} script.py` or `torchrun --nproc-per-node {want} script.py` "
            f"(materialize joins the group they set up), or run a function on {want} local ranks with "
            f"autopar.spawn(fn, {want})")


def _device(weights) -> torch.device:
    """The current GPU under NCCL, else the weights' device (the CPU for none)."""
    if dist.is_initialized() and dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return rank_device(w for w in weights)


def _full_weights(program: Program, state_dict) -> dict[str, torch.Tensor]:
    if state_dict is not None:
        missing = [n for n in program.param_names if n not in state_dict]
        if missing:
            raise KeyError(f"state_dict lacks {len(missing)} parameter(s), e.g. {missing[:3]}")
        return state_dict
    params = dict(program.model.named_parameters())
    meta = [n for n in program.param_names if params[n].is_meta]
    if meta:
        raise ValueError(f"the model's parameters are on the meta device ({meta[0]}, ...): pass "
                         "materialize(state_dict=...) with real weights")
    return params


def _replicated_inputs(program: Program, state_dict) -> dict[str, torch.Tensor]:
    """Buffers and lifted constants: every rank holds them whole."""
    bufs = dict(program.model.named_buffers())
    out = {}
    for ph, name in program.traced.buffer_of.items():
        out[ph] = (state_dict or {}).get(name, bufs.get(name))
    for ph, name in program.traced.constant_of.items():
        out[ph] = program.traced.constants[name]
    return out
