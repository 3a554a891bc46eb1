"""This rank's random stream: what random ops of its chunks (dropout) draw from.

Random ops draw from the engine's own stream, not the process's default
generator: one seed, ``torch.initial_seed()`` of global rank 0, offset per
pipeline stage and data-parallel replica (``stream_seed``). So stage 1 does not
repeat stage 0's masks on its own layers, replicas draw independent masks for
their different samples (as one device drawing for the whole batch would), and
the t ranks of a stage draw identically for the values they all hold (split
values get per-rank streams from ``comm.tp_rng_call``). With context parallelism
each cp rank of a replica has a stream of its own (its replica index is
``dp_rank * c + cp_rank``): dropout on its S/c tokens draws masks independent
of the other cp ranks', as one device draws independent masks for every token.
These are not the masks one device would draw for the whole sequence (that
would need one stream cut by token position), so dropout under cp matches one
device in distribution, not bit for bit. Recomputation replays
the same masks: the checkpoint saves and restores this stream's state
(``get_state``/``set_state``: one state per generator, the CPU's, then the
GPU's). An evaluation step puts the stream back as it found it
(``unchanged``), so a training step draws the same masks with or without
evaluations before it.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

from autopar.core.comm import seed_forked
from autopar.core.mesh import Mesh
from autopar.runtime.engine.errors import EngineUsageError

__all__ = ["RandomStream", "stream_seed"]


def stream_seed(base: int, mesh: Mesh) -> int:
    """The seed of this rank's stream: ``base`` (global rank 0's) offset by its (stage, replica, cp rank)
    (with c = 1 the replica alone, as before context parallelism)."""
    replica = mesh.dp_cp_rank + mesh.shape.dp_cp * mesh.pp_rank
    return (base + 1_000_003 * replica) % 2**63


class RandomStream:
    """The generators' states of one rank's stream, swapped in around its chunks' random ops."""

    def __init__(self, seed: int, device: torch.device) -> None:
        self.seed = seed
        """Where the stream started; equal on the t ranks of a stage."""
        self.devices = [device.index] if device.type == "cuda" else []
        """The GPUs whose generators the stream drives besides the CPU's (the engine's, under CUDA)."""
        self._states: list[torch.Tensor] = []
        self.reseed(seed)

    def get_state(self) -> list[torch.Tensor]:
        """The state of each generator (the CPU's, then each GPU's), as ``torch.get_rng_state`` gives it."""
        return list(self._states)

    def set_state(self, states: list[torch.Tensor]) -> None:
        """Continue from ``states`` (as ``get_state`` returns them, on any device)."""
        if len(states) != len(self._states):
            raise EngineUsageError(f"a random stream of {len(self._states)} generator(s) cannot take "
                                   f"{len(states)} states")
        self._states = [s.cpu() for s in states]

    def reseed(self, seed: int) -> None:
        """Start the stream over from ``seed``."""
        with torch.random.fork_rng(devices=self.devices):
            seed_forked(seed, self.devices)
            self._states = self._current()

    def _current(self) -> list[torch.Tensor]:
        return [torch.get_rng_state()] + [torch.cuda.get_rng_state(d) for d in self.devices]

    @contextlib.contextmanager
    def active(self) -> Iterator[None]:
        """Run random ops on this stream; the process's default generators are left untouched."""
        with torch.random.fork_rng(devices=self.devices):
            torch.set_rng_state(self._states[0])
            for d, state in zip(self.devices, self._states[1:]):
                torch.cuda.set_rng_state(state, d)
            try:
                yield
            finally:
                self._states = self._current()

    @contextlib.contextmanager
    def unchanged(self) -> Iterator[None]:
        """Whatever draws from the stream inside draws from a copy: the stream is left where it was."""
        states = self._states
        try:
            yield
        finally:
            self._states = states
