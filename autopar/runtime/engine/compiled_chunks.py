"""Chunks compiled by ``torch.compile``: one graph per chunk, collectives inside, time and breaks kept.

With ``compile=`` set (``ParallelConfig.compile``), each chunk's graph (and its
evaluation graph) is handed to ``torch.compile`` as it stands after the passes:
Dynamo captures it, AOTAutograd makes the joint forward-backward graph and
partitions it, the backend compiles both halves (Inductor: fused kernels
between the GEMMs). The tensor- and sequence-parallel collectives are
functional collectives while traced (``core/comm``), so they stay inside the
graph; a checkpointed region is a checkpoint inside it, recomputed by the
compiled backward (``core/activation_recompute.py``).

Compiling happens at a chunk's first run, so its cost is measured there: the
seconds of that first call, the graphs Dynamo made and the reason of each graph
break (``CompiledChunk.report``). A break is not an error (the pieces run
compiled, the ops between them eagerly), but it cuts the chunk: it is reported,
never silent. The parameters stay the engine's (the chunk's graph takes them
as arguments), so checkpoints, export and the optimizers see the same tensors.
"""

from __future__ import annotations

import time
from collections import Counter
from dataclasses import dataclass, field

import torch
import torch.nn as nn

__all__ = ["CompiledChunk", "CompileReport", "compiled"]


@dataclass
class CompileReport:
    """What compiling one chunk graph cost and made."""

    seconds: float = 0.0
    """Wall time of the first call (the compile and one run)."""
    graphs: int = 0
    """Graphs Dynamo made of the chunk: 1 when nothing broke it; 0 when this process had compiled the
    same graph already (a second engine of the program) and reused it."""
    breaks: list[str] = field(default_factory=list)
    """Why the chunk was cut, one line per graph break (Dynamo's reason's first line)."""


class CompiledChunk:
    """A chunk graph under ``torch.compile(backend)``; its first call is timed and its graphs counted."""

    def __init__(self, module: nn.Module, backend: str) -> None:
        self.module = module
        self.backend = backend
        self.compiled = torch.compile(module, backend=backend, dynamic=False)
        self.report: CompileReport | None = None
        """Set by the first call."""

    def __call__(self, *args):
        if self.report is not None:
            return self.compiled(*args)
        from torch._dynamo.utils import counters

        breaks_before = Counter(counters["graph_break"])
        graphs_before = counters["stats"]["unique_graphs"]
        start = time.perf_counter()
        out = self.compiled(*args)
        broke = Counter(counters["graph_break"]) - breaks_before
        self.report = CompileReport(
            seconds=time.perf_counter() - start, graphs=counters["stats"]["unique_graphs"] - graphs_before,
            breaks=[reason.strip().splitlines()[0] for reason in broke.elements()])
        return out


def compiled(module: nn.Module, backend: str | None):
    """``module`` compiled with ``backend`` (a ``CompiledChunk``), or ``module`` itself when None."""
    return CompiledChunk(module, backend) if backend else module
