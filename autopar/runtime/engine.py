"""One rank's training engine: local parameter shards and the rank program.

``train_step(*inputs, *targets)`` runs the rank's graph forward and backward,
accumulating gradients into the local shards (call your optimizer's
``step()`` and ``zero_grad()`` around it, as with ``loss.backward()``).
``full_state_dict()`` and ``full_grads()`` all-gather shards back to the
original names and shapes (vocabulary padding removed).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING

import torch
import torch.fx as fx
import torch.nn as nn

from autopar.comm import TPGroup, _all_gather
from autopar.placement import Shard

if TYPE_CHECKING:
    from autopar.api import ParallelProgram

__all__ = ["RankEngine"]


class RankEngine(nn.Module):
    """Holds this rank's parameter shards and runs its program."""

    def __init__(self, program: "ParallelProgram", tp: TPGroup, local_params: dict[str, torch.Tensor],
                 buffers: dict[str, torch.Tensor]):
        super().__init__()
        self.program = program
        self.tp = tp
        self.module: fx.GraphModule = program.rank_module
        self.shards = nn.ParameterDict({_key(n): nn.Parameter(t) for n, t in local_params.items()})
        self._buffers_by_placeholder = buffers
        self._order = [n for n in self.module.graph.nodes if n.op == "placeholder"][1:]  # after ``tp``

    # ----------------------------------------------------------------- running
    def forward(self, *batch: torch.Tensor) -> torch.Tensor:
        traced = self.program.traced
        n_expected = len(traced.input_names) + len(traced.target_names)
        if len(batch) != n_expected:
            raise TypeError(f"expected {len(traced.input_names)} input(s) and {len(traced.target_names)} "
                            f"target(s), got {len(batch)} tensors")
        feed = dict(zip(traced.input_names + traced.target_names, batch))
        args = []
        for node in self._order:
            name = node.name
            if name in traced.param_of:
                args.append(self.shards[_key(traced.param_of[name])])
            elif name in feed:
                args.append(feed[name])
            else:
                args.append(self._buffers_by_placeholder[name])
        return self.module(self.tp, *args)[0]

    def train_step(self, *batch: torch.Tensor) -> float:
        """Forward and backward of one batch; returns the loss (the same on every rank)."""
        self._check_shapes(batch)
        loss = self(*batch)
        loss.backward()
        return float(loss.detach())

    def _check_shapes(self, batch) -> None:
        traced = self.program.traced
        phs = {n.name: n for n in traced.gm.graph.nodes if n.op == "placeholder"}
        for name, x in zip(traced.input_names + traced.target_names, batch):
            want = tuple(phs[name].meta["val"].shape)
            if tuple(x.shape) != want:
                raise ValueError(f"batch tensor '{name}' has shape {tuple(x.shape)}, but the program was "
                                 f"compiled for {want} (shapes are fixed by example_inputs/example_targets)")

    # ---------------------------------------------------------------- parameters
    def named_local_parameters(self) -> Iterator[tuple[str, nn.Parameter]]:
        """(original name, local shard) for every parameter."""
        for name in self.program.param_names:
            yield name, self.shards[_key(name)]

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """Full parameters (and buffers) under every original name, on every rank."""
        return self._gather(lambda p: p.detach())

    def full_grads(self) -> dict[str, torch.Tensor]:
        """Full gradients under every original parameter name (zeros where none)."""
        return self._gather(lambda p: p.grad if p.grad is not None else torch.zeros_like(p), buffers=False)

    def _gather(self, get, buffers: bool = True) -> dict[str, torch.Tensor]:
        out = {}
        for name, p in self.named_local_parameters():
            spec = self.program.param_spec(name)
            value = get(p)
            if isinstance(spec, Shard) and self.tp.size > 1:
                full = _all_gather(value, self.tp, spec.dim, spec.segments)
                value = full.narrow(spec.dim, 0, self.program.full_shape(name)[spec.dim])
            elif isinstance(spec, Shard):
                value = value.narrow(spec.dim, 0, self.program.full_shape(name)[spec.dim])
            for alias in self.program.traced.aliases.get(name, [name]):
                out[alias] = value.clone()
        if buffers:
            for pname, bname in self.program.traced.buffer_of.items():
                out[bname] = self._buffers_by_placeholder[pname].clone()
        return out


def _key(name: str) -> str:
    return name.replace(".", "__")
