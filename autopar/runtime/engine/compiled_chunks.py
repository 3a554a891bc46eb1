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
break (``CompiledChunk.report``). With Inductor, the code it generated for the
chunk's forward (at that call) and backward (at the chunk's first backward,
which runs inside ``CompiledChunk.capturing()``) is kept too: the Python
wrapper that calls each fused kernel, with the kernels' source and, above each,
the graph nodes it fuses (``engine.compiled_code()``). A break is not an error
(the pieces run compiled, the ops between them eagerly), but it cuts the chunk:
it is reported, never silent. The parameters stay the engine's (the chunk's graph takes them
as arguments), so checkpoints, export and the optimizers see the same tensors.
"""

from __future__ import annotations

import contextlib
import contextvars
import time
from collections import Counter
from dataclasses import dataclass, field

import torch
import torch.nn as nn

from autopar.runtime.engine.compiled_split import split_backend

__all__ = ["CompiledChunk", "CompileReport", "compiled"]

_CAPTURE: contextvars.ContextVar[list[str] | None] = contextvars.ContextVar("autopar_inductor_code", default=None)
"""Where Inductor's generated code goes while a chunk compiles (None: nowhere)."""


def _keep_inductor_code() -> None:
    """Route the code Inductor generates (or loads from its cache) to the chunk compiling now, keeping
    any hook already installed."""
    from torch._inductor.graph import GraphLowering

    earlier = GraphLowering.save_output_code
    if getattr(earlier, "autopar", False):
        return

    def save(code: str) -> None:
        kept = _CAPTURE.get()
        if kept is not None:
            kept.append(code)
        if earlier is not None:
            earlier(code)

    save.autopar = True
    GraphLowering.save_output_code = save


@dataclass
class CompileReport:
    """What compiling one chunk graph cost and made."""

    seconds: float = 0.0
    """Wall time of the first forward and the first backward (the compiles and one run of each)."""
    graphs: int = 0
    """Graphs Dynamo made of the chunk: 1 when nothing broke it; 0 when this process had compiled the
    same graph already (a second engine of the program) and reused it."""
    breaks: list[str] = field(default_factory=list)
    """Why the chunk was cut, one line per graph break (Dynamo's reason's first line)."""
    code: dict[str, list[str]] = field(default_factory=lambda: {"forward": [], "backward": []})
    """Inductor's generated modules for the chunk's forward and for its backward (B's, then W's when
    the backward is split); empty with another backend."""


class CompiledChunk:
    """A chunk graph under ``torch.compile(backend)``; its first call is timed and its graphs counted."""

    def __init__(self, module: nn.Module, backend: str, weights: frozenset[str] | None = None) -> None:
        self.compiled = torch.compile(module, backend=split_backend(backend, weights) if weights is not None
                                      else backend, dynamic=False)
        self.report: CompileReport | None = None
        """Set by the first call."""
        self.backward_seen = False
        """Whether a backward of this chunk ran (its compile captured) yet."""
        if backend == "inductor":
            _keep_inductor_code()

    def __call__(self, *args):
        if self.report is not None:
            return self.compiled(*args)
        from torch._dynamo.utils import counters

        breaks_before = Counter(counters["graph_break"])
        graphs_before = counters["stats"]["unique_graphs"]
        code: dict[str, list[str]] = {"forward": [], "backward": []}
        token = _CAPTURE.set(code["forward"])
        start = time.perf_counter()
        try:
            out = self.compiled(*args)
        finally:
            _CAPTURE.reset(token)
        broke = Counter(counters["graph_break"]) - breaks_before
        self.report = CompileReport(
            seconds=time.perf_counter() - start, graphs=counters["stats"]["unique_graphs"] - graphs_before,
            breaks=[reason.strip().splitlines()[0] for reason in broke.elements()], code=code)
        return out

    @contextlib.contextmanager
    def capturing(self):
        """Around a backward of this chunk: the first one compiles the chunk's backward graph; its
        time is added to the report, and its generated code kept."""
        if self.backward_seen or self.report is None:
            yield
            return
        self.backward_seen = True
        token = _CAPTURE.set(self.report.code["backward"])
        start = time.perf_counter()
        try:
            yield
        finally:
            _CAPTURE.reset(token)
            self.report.seconds += time.perf_counter() - start


def compiled(module: nn.Module, backend: str | None, weights: frozenset[str] | None = None):
    """``module`` compiled with ``backend`` (a ``CompiledChunk``; ``weights``: its weight arguments, to
    split its backward into B and W), or ``module`` itself when ``backend`` is None."""
    return CompiledChunk(module, backend, weights) if backend else module
