"""Zero-bubble with compiled chunks: the backward graph split into B and W before it is compiled.

A zero-bubble schedule runs each backward in two actions: B, the gradient of
the chunk's inputs (what the previous stage waits for), and W, the gradients of
its weights (filling the bubbles). Eagerly, ``optim/split_backward.py`` splits
at run time over the autograd graph. A compiled chunk's backward is one
compiled function, so the split is made in its graph instead, when AOTAutograd
hands the backward graph to the compiler (``split_backward_graph``):

- B: the nodes the input gradients need, plus, as extra outputs, the values W
  reads that B computed (a linear's output gradient, say);
- W: the rest of the nodes the weight gradients need, reading those values and
  the saved tensors it uses itself, nothing else.

Each half is compiled on its own (Inductor, or eager kernels with
``aot_eager``). At run time the backward runs B and returns the input gradients
with no weight gradient; W is left as a thunk in the collector the engine's B
action opened (``collecting_weight_grads``), which the W action runs, adding
each gradient into its parameter's ``.grad``. W keeps only what it reads. A
backward run with no collector open (a plain ``backward``) runs W right away
and returns every gradient, as an unsplit backward would.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Callable, Iterator

import torch
import torch.fx as fx

from autopar.core.graph import ancestors
from autopar.runtime.engine.errors import EngineRuntimeError

__all__ = ["split_backward_graph", "split_backend", "collecting_weight_grads", "WeightGrads"]

_COLLECTOR: contextvars.ContextVar[list | None] = contextvars.ContextVar("autopar_weight_grads", default=None)


class WeightGrads:
    """The W of one compiled backward (one chunk, one microbatch): its thunks, run once."""

    def __init__(self, thunks: list[tuple[Callable[[], list], list[str], int]]):
        self.thunks = thunks
        """(run W -> the gradients, the chunk placeholders they are for, bytes W holds)."""

    def held_bytes(self) -> int:
        """Bytes W keeps until it runs (the values it reads)."""
        return sum(nbytes for _, _, nbytes in self.thunks)

    def run(self) -> dict[str, torch.Tensor]:
        """The weight gradients, by the chunk graph's placeholder name."""
        out: dict[str, torch.Tensor] = {}
        thunks, self.thunks = self.thunks, []
        for run, names, _ in thunks:
            with torch.no_grad():  # as inside autograd's backward: the W graph records nothing
                grads = run()
            for name, g in zip(names, grads):
                if g is not None:
                    out[name] = out[name] + g if name in out else g
        return out


@contextlib.contextmanager
def collecting_weight_grads() -> Iterator[WeightGrads]:
    """Around a B's ``backward``: the compiled backwards inside leave their W here instead of running it."""
    collected = WeightGrads([])
    token = _COLLECTOR.set(collected.thunks)
    try:
        yield collected
    finally:
        _COLLECTOR.reset(token)


def split_backward_graph(bw: fx.GraphModule, is_weight: list[bool]):
    """(B, W, the ``bw`` inputs W reads, the B values W reads): ``bw``'s output i is the gradient of
    forward input i, a weight's where ``is_weight[i]``. B takes ``bw``'s inputs and returns the
    input gradients, then the values W reads that B computed; W takes, in order, the ``bw`` inputs
    it reads (their indices) and those values, and returns the weight gradients."""
    g = bw.graph
    outs = list(next(n for n in g.nodes if n.op == "output").args[0])
    if len(outs) != len(is_weight):
        raise EngineRuntimeError(f"cannot split a compiled chunk's backward into B and W: its graph has {len(outs)} "
                                 f"gradients for {len(is_weight)} forward inputs (run this schedule with compile=None)")
    b_roots = [o for o, w in zip(outs, is_weight) if not w]
    w_roots = [o for o, w in zip(outs, is_weight) if w]
    b_set = ancestors(b_roots)
    w_set = {n for n in ancestors(w_roots) - b_set if n.op != "placeholder"}
    reads = [n for n in g.nodes if n not in w_set and any(u in w_set for u in n.users)]
    carried = [n for n in reads if n.op != "placeholder"]
    placeholders = [n for n in g.nodes if n.op == "placeholder"]
    from_inputs = [placeholders.index(n) for n in reads if n.op == "placeholder"]

    b_graph, env = fx.Graph(), {}
    for n in g.nodes:
        if n.op == "placeholder" or n in b_set:
            env[n] = b_graph.node_copy(n, env.__getitem__)
    b_graph.output(tuple(env[o] if isinstance(o, fx.Node) else o for o in b_roots) + tuple(env[n] for n in carried))
    w_graph, wenv = fx.Graph(), {}
    for n in [placeholders[i] for i in from_inputs] + carried:
        wenv[n] = w_graph.placeholder(n.name)
        wenv[n].meta = dict(n.meta)
    for n in g.nodes:
        if n in w_set:
            wenv[n] = w_graph.node_copy(n, wenv.__getitem__)
    w_graph.output(tuple(wenv[o] if isinstance(o, fx.Node) else o for o in w_roots))
    return fx.GraphModule(bw, b_graph), fx.GraphModule(bw, w_graph), from_inputs, carried


def _boxed(run):
    """``run``, a function of the argument list, marked as AOTAutograd's boxed calling convention."""
    run._boxed_call = True
    return run


INDUCTOR_CONFIG = {"fallback_random": True}
"""Inductor's settings for every chunk: random ops (dropout) lowered to torch's own kernels, which draw
from the generator as an eager chunk does, so a compiled chunk's masks are the eager chunk's and one
device's (Inductor's own random kernels draw other numbers)."""


def _inner_compiler(backend: str):
    """gm, example inputs -> a function of a list of arguments, for ``backend``'s forward and halves."""
    if backend == "inductor":
        from torch._inductor import config
        from torch._inductor.compile_fx import compile_fx_inner

        def inductor(gm: fx.GraphModule, example_inputs):
            with config.patch(INDUCTOR_CONFIG):
                compiled = compile_fx_inner(gm, list(example_inputs))
            return lambda args: compiled(list(args))

        return inductor

    def eager(gm: fx.GraphModule, example_inputs):
        return lambda args: gm(*args)

    return eager


def split_backend(backend: str, weights: frozenset[str]):
    """A ``torch.compile`` backend: AOTAutograd with ``backend``'s kernels, the backward split into
    B and W (``split_backward_graph``). ``weights``: the names of the compiled function's arguments
    that are weights; W reports their gradients under these names."""
    from torch._dynamo.backends.common import aot_autograd

    inner = _inner_compiler(backend)

    def compile_graph(gm: fx.GraphModule, example_inputs):
        args = [n for n in gm.graph.nodes if n.op == "placeholder"]
        local = [getattr(getattr(n.meta.get("grapharg"), "source", None), "local_name", None) for n in args]
        is_weight = [name in weights for name in local]

        def fw_compiler(fw: fx.GraphModule, ex):
            return _boxed(inner(fw, ex))

        def bw_compiler(bw: fx.GraphModule, ex):
            b_gm, w_gm, from_inputs, carried = split_backward_graph(bw, is_weight)
            b_run = inner(b_gm, ex)
            w_run = inner(w_gm, [ex[i] for i in from_inputs] + [n.meta.get("val") for n in carried])
            names = [name for name, w in zip(local, is_weight) if w]
            n_b = is_weight.count(False)

            def backward(args):
                res = list(b_run(args))
                b_grads = res[:n_b]
                w_args = [args[i] for i in from_inputs] + res[n_b:]
                args.clear()  # from here W alone holds what it reads
                kept = sum(t.numel() * t.element_size() for t in w_args if isinstance(t, torch.Tensor))
                collector = _COLLECTOR.get()
                if collector is not None:
                    collector.append((lambda: w_run(w_args), names, kept))
                    w_grads = [None] * len(names)
                else:
                    w_grads = list(w_run(w_args))
                b_iter, w_iter = iter(b_grads), iter(w_grads)
                return [next(w_iter) if w else next(b_iter) for w in is_weight]

            return _boxed(backward)

        options = {}
        if backend == "inductor":  # traced into the ops Inductor lowers, partitioned as Inductor partitions
            from torch._functorch.partitioners import min_cut_rematerialization_partition
            from torch._inductor.decomposition import select_decomp_table

            options = dict(decompositions=select_decomp_table(), partition_fn=min_cut_rematerialization_partition)
        return aot_autograd(fw_compiler=fw_compiler, bw_compiler=bw_compiler, **options)(gm, example_inputs)

    return compile_graph
