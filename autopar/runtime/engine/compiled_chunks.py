"""Chunks compiled by ``torch.compile``: one graph per chunk, collectives inside, time and breaks kept.

With ``compile=`` set (``ParallelConfig.compile``), each chunk's graph (and its
evaluation graph) is handed to ``torch.compile`` as it stands after the passes:
Dynamo captures it, AOTAutograd makes the joint forward-backward graph and
partitions it, the backend compiles both halves (Inductor: fused kernels
between the GEMMs). The tensor- and sequence-parallel collectives are
functional collectives while traced (``core/comm``), so they stay inside the
graph; a checkpointed region is a checkpoint inside it, recomputed by the
compiled backward (``core/activation_recompute.py``).

The tensor-parallel ranks of one stage and replica mostly run the same chunk
graphs (they differ only in the shards they are given; a vocabulary-parallel
chunk's graph holds its rank's vocabulary offset), so with Inductor they take
turns (``CompileTurns``): the stage's tp rank 0 compiles each graph and
publishes a fingerprint of the graph Dynamo captured; another rank whose graph
has the same fingerprint waits until that compile ends (not its run, whose
collectives need it) and loads the result from Inductor's cache on disk (one
cache directory per host by default; ``TORCHINDUCTOR_CACHE_DIR`` on a shared
file system for many hosts); a rank whose graph differs compiles at once. The
first rank's compile end is Dynamo's compile-end callback (the forward's, then
the lazily compiled backward's), published on the job's store; a rank that
waits past the engine's failure timeout compiles on its own.

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
Inductor lowers random ops to torch's own kernels (``INDUCTOR_CONFIG``), so
dropout draws the masks an eager chunk and one device draw.
"""

from __future__ import annotations

import contextlib
import contextvars
import hashlib
import re
import time
from collections import Counter
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import torch
import torch.nn as nn

from autopar.core.log import get_logger
from autopar.runtime.engine.compiled_split import INDUCTOR_CONFIG, split_backend

__all__ = ["CompiledChunk", "CompileReport", "CompileTurns", "compiled"]

_log = get_logger(__name__)

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
    cache_hits: int = 0
    """Inductor graphs of the chunk loaded from the cache on disk (compiled by another rank or run)."""
    cache_misses: int = 0
    """Inductor graphs of the chunk compiled here."""
    waited_s: float = 0.0
    """Seconds this rank waited for its stage's tp rank 0 to compile the same graphs (``CompileTurns``)."""

    def describe(self) -> str:
        cache = (f", Inductor cache {self.cache_hits} hit(s) {self.cache_misses} miss(es)"
                 if self.cache_hits or self.cache_misses else "")
        waited = f", waited {self.waited_s:.1f} s for tp rank 0's compile" if self.waited_s else ""
        counted = Counter(self.breaks)
        broke = (", breaks: " + "; ".join(f"{n} x {why}" if n > 1 else why for why, n in counted.items())
                 if self.breaks else "")
        return f"{self.seconds:.1f} s, {self.graphs} graph(s){cache}{waited}{broke}"


@dataclass(frozen=True)
class CompileTurns:
    """How the ranks compiling the same graphs take turns: the first compiles, each other one waits for
    the end of that compile (``wait``) and loads it from the cache. Keys on ``store``: ``prefix/what``."""

    store: Any
    """The job's key-value store (``torch.distributed``'s default store)."""
    prefix: str
    """Unique per engine, stage and replica."""
    first: bool
    """Whether this rank compiles first (tp rank 0 of the stage)."""
    timeout_s: float
    """How long a follower waits before compiling on its own."""

    def publish(self, what: str, value: str = "1") -> None:
        """Publish ``what`` (a compile's end, or a graph's fingerprint as ``value``) for the waiting ranks."""
        self.store.set(f"{self.prefix}/{what}", value.encode())

    def published(self, what: str) -> bool:
        return self.store.check([f"{self.prefix}/{what}"])

    def wait(self, what: str) -> tuple[float, str | None]:
        """Wait until the first rank published ``what`` (at most ``timeout_s``): the seconds waited and
        the value (None when it never came)."""
        start = time.perf_counter()
        try:
            self.store.wait([f"{self.prefix}/{what}"], timedelta(seconds=self.timeout_s))
            value = self.store.get(f"{self.prefix}/{what}").decode()
        except Exception:  # noqa: BLE001 - a first rank that never compiled: compile here instead
            value = None
        return time.perf_counter() - start, value


def _break_reason(text: str) -> str:
    """A graph break in one line: Dynamo's first line, and the reason a disabled function gives."""
    first = text.strip().splitlines()[0]
    why = re.search(r"\(reason: (.*?)\)\s*$", text, re.MULTILINE)
    return f"{first}: {why.group(1)}" if why else first


def _inductor(gm: torch.fx.GraphModule, example_inputs):
    """``torch.compile``'s Inductor backend with the chunks' settings (``INDUCTOR_CONFIG``)."""
    from torch._inductor.compile_fx import compile_fx

    return compile_fx(gm, example_inputs, config_patches=INDUCTOR_CONFIG)


def _fingerprint(gm: torch.fx.GraphModule, example_inputs) -> str:
    """What a graph Dynamo captured compiles from: its code and its inputs' shapes and dtypes."""
    inputs = [(tuple(t.shape), t.dtype) if isinstance(t, torch.Tensor) else repr(t) for t in example_inputs]
    return hashlib.sha256(f"{gm.code}\n{inputs}".encode()).hexdigest()


_SIGNAL: contextvars.ContextVar[tuple[CompileTurns, str] | None] = contextvars.ContextVar(
    "autopar_compile_turn", default=None)
"""What the compile running now ends for the ranks waiting on it (set on the first rank only)."""


def _on_compile_end(_args) -> None:
    signal = _SIGNAL.get()
    if signal is not None:
        signal[0].publish(signal[1])


def _signal_compile_ends() -> None:
    """Have Dynamo's compile-end callback (a frame's compile, a lazy backward's) publish the turn's
    end; installed again after ``torch._dynamo.reset()``, which drops callbacks."""
    from torch._dynamo.callback import callback_handler

    if _on_compile_end not in callback_handler.end_callbacks:
        callback_handler.register_end_callback(_on_compile_end)


@contextlib.contextmanager
def _inductor_cache_counts(report: "CompileReport"):
    """Add the Inductor cache hits and misses of the block to ``report``."""
    from torch._dynamo.utils import counters

    hits, misses = counters["inductor"]["fxgraph_cache_hit"], counters["inductor"]["fxgraph_cache_miss"]
    try:
        yield
    finally:
        report.cache_hits += counters["inductor"]["fxgraph_cache_hit"] - hits
        report.cache_misses += counters["inductor"]["fxgraph_cache_miss"] - misses


class CompiledChunk:
    """A chunk graph under ``torch.compile(backend)``; its first call is timed and its graphs counted."""

    def __init__(self, module: nn.Module, backend: str, weights: frozenset[str] | None = None,
                 turns: CompileTurns | None = None, name: str = "") -> None:
        inner = (split_backend(backend, weights) if weights is not None
                 else _inductor if backend == "inductor" else backend)
        self.compiled = torch.compile(module, backend=self._taking_turns(inner) if turns is not None else inner,
                                      dynamic=False)
        self.report: CompileReport | None = None
        """Set by the first call."""
        self._compiling: CompileReport | None = None
        """The report of the first call while it runs."""
        self.same_as_first: bool | None = None
        """On a rank other than its stage's tp rank 0: whether its graph is the one that rank compiled
        (it then waited for that compile and loaded it from the cache)."""
        self.backward_seen = False
        """Whether a backward of this chunk ran (its compile captured) yet."""
        self.backend = backend
        self.turns = turns
        """With Inductor and tensor parallelism: the turns its stage's tp ranks take compiling."""
        self.name = name
        """The graph's name among the engine's (``train/3``, ``eval/3``): its turns' keys."""
        if backend == "inductor":
            _keep_inductor_code()
        if turns is not None:
            _signal_compile_ends()

    def __call__(self, *args):
        if self.report is not None:
            return self.compiled(*args)
        from torch._dynamo.utils import counters

        report = CompileReport()
        _log.info("compiling chunk graph %s (forward) with %s", self.name or "?", self.backend)
        start = time.perf_counter()
        with self._turn("forward", report):
            breaks_before = Counter(counters["graph_break"])
            graphs_before = counters["stats"]["unique_graphs"]
            token = _CAPTURE.set(report.code["forward"])
            try:
                out = self.compiled(*args)
            finally:
                _CAPTURE.reset(token)
        broke = Counter(counters["graph_break"]) - breaks_before
        report.seconds = time.perf_counter() - start
        report.graphs = counters["stats"]["unique_graphs"] - graphs_before
        report.breaks = [_break_reason(reason) for reason in broke.elements()]
        self.report = report
        _log.info("chunk graph %s (forward): %s", self.name or "?", report.describe())
        return out

    @contextlib.contextmanager
    def capturing(self):
        """Around a backward of this chunk: the first one compiles the chunk's backward graph; its
        time is added to the report, and its generated code kept."""
        if self.backward_seen or self.report is None:
            yield
            return
        self.backward_seen = True
        start = time.perf_counter()
        token = _CAPTURE.set(self.report.code["backward"])
        try:
            with self._turn("backward", self.report):
                yield
        finally:
            _CAPTURE.reset(token)
            self.report.seconds += time.perf_counter() - start

    def _taking_turns(self, inner):
        """``inner`` (a backend or its name) behind the turns: on the first rank, the captured graph's
        fingerprint published before compiling; on another, compared with the first rank's, and on
        a match the compile waits for the first rank's to end (its kernels then come from the cache)."""
        compile_inner = torch._dynamo.lookup_backend(inner) if isinstance(inner, str) else inner

        def compile_graph(gm: torch.fx.GraphModule, example_inputs):
            turns, mine = self.turns, _fingerprint(gm, example_inputs)
            if turns.first:
                turns.publish(f"{self.name}/graph", mine)
            elif self.same_as_first is None:
                waited, theirs = turns.wait(f"{self.name}/graph")
                self.same_as_first = theirs == mine
                if self.same_as_first and self.backend == "inductor":  # only Inductor keeps a cache
                    waited += turns.wait(f"{self.name}/forward")[0]
                if self._compiling is not None:
                    self._compiling.waited_s += waited
            return compile_inner(gm, example_inputs)

        return compile_graph

    @contextlib.contextmanager
    def _turn(self, part: str, report: CompileReport):
        """Around the first run of the forward (or backward): the first rank publishes the end of
        its compile; another rank whose forward graph was the first rank's waits for its backward's
        compile too."""
        turns, what = self.turns, f"{self.name}/{part}"
        self._compiling = report
        if (turns is not None and not turns.first and part == "backward" and self.same_as_first
                and self.backend == "inductor"):
            report.waited_s += turns.wait(what)[0]
        token = _SIGNAL.set((turns, what) if turns is not None and turns.first else None)
        try:
            with _inductor_cache_counts(report):
                yield
        finally:
            _SIGNAL.reset(token)
            self._compiling = None
            if turns is not None and turns.first:
                turns.publish(what)  # also when the compile failed or made no graph: never leave one waiting
                if part == "forward" and not turns.published(f"{self.name}/graph"):
                    turns.publish(f"{self.name}/graph", "none")  # no graph captured: nobody waits for one


def compiled(module: nn.Module, backend: str | None, weights: frozenset[str] | None = None,
             turns: CompileTurns | None = None, name: str = ""):
    """``module`` compiled with ``backend`` (a ``CompiledChunk``; ``weights``: its weight arguments, to
    split its backward into B and W; ``turns``: the turns taken with the ranks compiling the same
    graph, under ``name``), or ``module`` itself when ``backend`` is None."""
    return CompiledChunk(module, backend, weights, turns, name) if backend else module
