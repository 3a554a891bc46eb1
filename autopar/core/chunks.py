"""The pipeline's data: chunks of the rank graph and the values sent between them.

The pipeline cut (``passes/pipeline_split.py``) produces these; the program
holds them; the runtime only reads them.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.fx as fx
import torch.nn as nn

__all__ = ["Boundary", "Chunk", "PipelineSplit"]


@dataclass(frozen=True)
class Boundary:
    """One value sent from chunk c to chunk c+1."""

    name: str
    shape: tuple[int, ...]
    """Local shape on one tensor-parallel rank, one microbatch."""
    dtype: torch.dtype
    requires_grad: bool
    """A gradient flows back for it."""
    replicated: bool
    """Identical on every tensor-parallel rank (eligible for scatter/gather)."""

    @property
    def numel(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n

    @property
    def nbytes(self) -> int:
        return self.numel * torch.empty((), dtype=self.dtype).element_size()


@dataclass
class Chunk:
    """One contiguous piece of the model: its graph and what flows in and out."""

    index: int
    gm: fx.GraphModule
    params: list[str] = field(default_factory=list)
    """Placeholder names of the parameters the chunk reads."""
    feeds: list[str] = field(default_factory=list)
    """Placeholder names of model inputs, targets, buffers and constants it reads."""
    inputs: list[Boundary] = field(default_factory=list)
    """Boundary values received from chunk index-1."""
    outputs: list[Boundary] = field(default_factory=list)
    """Boundary values sent to chunk index+1 (empty for the last chunk: it returns the loss)."""
    layers: list[int] = field(default_factory=list)
    """The layers (indices) the chunk holds."""
    cost: float = 0.0
    """Its balanced cost (roofline FLOP units, ``autopar.core.flops.node_cost``)."""
    module: nn.Module | None = None
    """What the runtime runs: ``gm``, or ``gm`` with activation recomputation applied (``Checkpointed``
    regions); ``gm`` itself when not given."""
    eval_gm: fx.GraphModule | None = None
    """What an evaluation step runs: ``gm`` with its ops in evaluation mode (dropout removed, training
    flags off; ``passes/eval_mode.py``), made at compile time; None when not made."""
    eval_notes: tuple[str, ...] = ()
    """What ``eval_gm`` changed from ``gm``, one line per node (and each random op left)."""

    def __post_init__(self) -> None:
        if self.module is None:
            self.module = self.gm


@dataclass
class PipelineSplit:
    """The p*v chunks of a rank graph, the layers each holds and their balanced costs."""

    chunks: list[Chunk]
    layer_of_chunk: list[list[int]]
    costs: list[float]

    @property
    def n(self) -> int:
        return len(self.chunks)
