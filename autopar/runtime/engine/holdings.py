"""What one rank holds of the model, and the whole model made from it on every rank.

``Holdings`` keeps the rank's parameter shards (the engine's ``nn.Parameter``s),
its buffers and constants (``feeds``, by graph placeholder) and, once a
distributed optimizer is made, that optimizer's parameter all-gathers in flight
(``gathers``), which every read of the parameters waits for first. It is the
narrow view of the engine that checkpoints and the HuggingFace export read:
the program, the mesh, the device, the shards by name and the feeds.

``full_state_dict`` and ``full_grads`` put the model back together on every
rank: each parameter all-gathered over tp (sharded ones), then broadcast over
pp from the first stage holding it, under every name the model gives it.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Iterator
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
import torch.nn as nn

from autopar.compiler.state_keys import state_sources, untraced_value
from autopar.core.comm import TPGroup, in_buckets, wholes_from_shards
from autopar.core.mesh import Mesh
from autopar.core.tensor_placement import Shard
from autopar.runtime.engine.errors import EngineUsageError
from autopar.runtime.hf.export import RankHoldings
from autopar.runtime.optim.gradient_sync import GradientSync
from autopar.runtime.optim.param_gathers import ParamGathers

GATHER_BUCKET_BYTES = 64 * 2**20
"""The most bytes one all-gather over tp or one broadcast over pp of ``gather`` carries (a whole
model gathered in buckets, never in one extra copy of itself)."""

if TYPE_CHECKING:
    from autopar.compiler.program import Program

__all__ = ["Holdings", "shard_key", "rank_device", "nccl"]


def shard_key(name: str) -> str:
    """Parameter ``name``'s key among the engine's shards (``nn.ParameterDict`` keys hold no dots)."""
    return name.replace(".", "__")


def rank_device(tensors: Iterable[torch.Tensor]) -> torch.device:
    """The device a rank computes on: the one device of ``tensors``; with none, the current
    GPU when the default process group is NCCL, else the CPU."""
    devices = {t.device for t in tensors}
    if len(devices) > 1:
        raise EngineUsageError(f"a rank's parameters must all be on one device, got {sorted(map(str, devices))}")
    if devices:
        return devices.pop()
    if nccl():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def nccl() -> bool:
    """Whether the default process group is NCCL's (it communicates GPU tensors only)."""
    return dist.is_initialized() and dist.get_backend() == "nccl"


class Holdings:
    """This rank's parameter shards and feeds, on its device."""

    def __init__(self, program: "Program", mesh: Mesh, tp: TPGroup, device: torch.device, shards: nn.ParameterDict,
                 feeds: dict[str, torch.Tensor]) -> None:
        self.program = program
        self.mesh = mesh
        self.tp = tp
        self.device = device
        """Where every tensor of this rank lives."""
        self.stage = mesh.pp_rank
        self.shards = shards
        """``shard_key(name)`` -> this rank's shard of parameter ``name`` (its stage's parameters only)."""
        self.feeds = {n: t.to(device) if isinstance(t, torch.Tensor) else t for n, t in feeds.items()}
        """Buffers and constants by graph placeholder, on the device."""
        self.gathers: ParamGathers | None = None
        """A distributed optimizer's parameter all-gathers, waited for before a read."""

    def holds(self, name: str) -> bool:
        return shard_key(name) in self.shards

    def shard(self, name: str) -> nn.Parameter:
        """This rank's shard of parameter ``name``."""
        return self.shards[shard_key(name)]

    def wait(self, where: str) -> None:
        """Finish the parameter all-gathers still in flight before ``where`` reads the parameters."""
        if self.gathers is not None:
            self.gathers.wait_all(where)

    def wait_for(self, names: Iterable[str], where: str) -> None:
        """Finish the all-gathers of parameters ``names`` before ``where`` reads them."""
        if self.gathers is not None:
            self.gathers.wait_for(names, where)

    def named_local_parameters(self) -> Iterator[tuple[str, nn.Parameter]]:
        """(original name, local shard) of every parameter this rank holds, the all-gathers in flight done."""
        self.wait("named_local_parameters")
        for name in self.program.param_names:
            if self.holds(name):
                yield name, self.shard(name)

    def for_export(self) -> RankHoldings:
        """What the HuggingFace export reads of this rank."""
        return RankHoldings(self.program, self.mesh, self.tp, dict(self.named_local_parameters()), self.feeds,
                            self.device)

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """The model's ``state_dict()``, whole, on every rank (see ``RankEngine.full_state_dict``)."""
        self.wait("full_state_dict")
        params = self.gather(lambda p: p.detach())
        out = {}
        for source in state_sources(self.program):
            if source.kind == "param":
                out[source.key] = params[source.key]
            elif source.kind == "buffer":
                out[source.key] = self.feeds[source.name].clone()
            else:
                out[source.key] = untraced_value(self.program, source, self.device)
        return out

    def full_grads(self, grads: GradientSync) -> dict[str, torch.Tensor]:
        """Full gradients under every original parameter name, on every rank (reduce-scattered ones:
        the reduced gradients, all-gathered from the replicas' shards)."""
        if grads.sharded is not None:
            reduced = grads.reduced_grads()
            name_of = {id(p): n for n, p in self.named_local_parameters()}
            return self.gather(lambda p: reduced[name_of[id(p)]])
        return self.gather(lambda p: p.grad if p.grad is not None else torch.zeros_like(p))

    def gather(self, get: Callable[[nn.Parameter], torch.Tensor]) -> dict[str, torch.Tensor]:
        """``get(shard)`` of every parameter, whole, on every rank, on the device: all-gathered over tp
        (sharded ones, in buckets of ``GATHER_BUCKET_BYTES``), stacked expert weights over the expert
        group, then broadcast over pp from the first stage
        holding it; under every alias (a stacked list of experts: each expert under its own name)."""
        program = self.program
        whole = {name: get(self.shard(name)) if self.holds(name) else None for name in program.param_names}
        sharded = [(name, program.param_spec(name)) for name, value in whole.items()
                   if value is not None and isinstance(program.param_spec(name), Shard)]
        wholes = wholes_from_shards([(whole[n], s.dim, s.segments, program.full_shape(n)[s.dim]) for n, s in sharded],
                                    self.tp, GATHER_BUCKET_BYTES)
        whole.update({name: value for (name, _), value in zip(sharded, wholes)})
        experts = [n for n in program.expert_params if whole.get(n) is not None]
        if experts and self.mesh.groups.get("ep") is not None:  # each rank of the expert group holds E/ep
            group = TPGroup.of(self.mesh.groups["ep"], tuple(self.mesh.ep_members()))
            wholes = wholes_from_shards([(whole[n], 0, None, program.full_shape(n)[0]) for n in experts], group,
                                        GATHER_BUCKET_BYTES)
            whole.update(zip(experts, wholes))
        if self.mesh.shape.pp > 1:
            whole = self._from_owners(whole)
        out = {}
        for name in program.param_names:
            members = program.traced.stacked.get(name)
            if members:  # a list of experts stacked by the compiler: each expert under its own name
                out.update((m, whole[name][e].clone()) for e, m in enumerate(members))
            else:
                out.update((alias, whole[name].clone()) for alias in program.traced.aliases.get(name, [name]))
        return out

    def _from_owners(self, whole: dict[str, torch.Tensor | None]) -> dict[str, torch.Tensor]:
        """Every parameter (full shape, traced dtype) broadcast over pp from the first stage holding it
        (``whole`` holds this rank's copies, None where its stage holds none): the parameters of one
        owner and dtype flattened into buckets of at most ``GATHER_BUCKET_BYTES``, one broadcast each,
        in the program's order on every rank."""
        program, dtypes = self.program, self.param_dtypes()
        names = program.param_names
        keyed = [((program.param_stages[n][0], dtypes[n]), math.prod(program.full_shape(n)) * dtypes[n].itemsize)
                 for n in names]
        out = {}
        for (owner, dtype), indices in in_buckets(keyed, GATHER_BUCKET_BYTES):
            bucket = [names[i] for i in indices]
            sizes = [math.prod(program.full_shape(n)) for n in bucket]
            if self.stage == owner:
                buf = torch.cat([whole[n].to(dtype).reshape(-1) for n in bucket])
            else:
                buf = torch.empty(sum(sizes), dtype=dtype, device=self.device)
            dist.broadcast(buf, src=self.mesh.peer(owner), group=self.mesh.groups["pp"])
            for n, piece in zip(bucket, buf.split(sizes)):
                out[n] = piece.view(program.full_shape(n))
        return out

    def param_dtypes(self) -> dict[str, torch.dtype]:
        """Parameter name -> its dtype as traced (the same on every stage, held or not)."""
        traced = self.program.traced
        phs = {n.name: n for n in traced.gm.graph.nodes if n.op == "placeholder"}
        return {name: phs[ph].meta["val"].dtype for ph, name in traced.param_of.items()}
