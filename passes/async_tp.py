"""Async tensor parallelism, found from the rank graph: each sequence-parallel collective fused with its GEMMs.

After ``passes/sequence_parallel.py`` every column-parallel region starts with
``gather_from_sp`` (all-gather of the tokens) and every row-parallel GEMM's
partial sum goes through ``reduce_scatter_to_sp``. This pass replaces

- a ``gather_from_sp`` whose every reader is a GEMM taking it as its input
  (a layer's q, k and v reading one gather, an MLP's first linear, a
  vocabulary-parallel LM head) by one ``comm.all_gather_matmul`` over all of
  them; each GEMM's node becomes the ``getitem`` of its output (its name,
  shapes and source line kept), and the gather is placed after the last
  weight it reads;
- a ``reduce_scatter_to_sp`` of a bias-free GEMM's output read by nothing
  else (the row-parallel linears: tensor parallelism adds their bias after
  the sum) by one ``comm.matmul_reduce_scatter``, the GEMM's node removed.

A GEMM is ``linear(x, W[, b])``, or ``x @ W`` with a 2-D W as ``mm``,
``matmul`` or ``addmm(b, x, W)`` (HuggingFace's Conv1D), x its only tensor
operand that is not a weight or bias.

Both ops decompose the collective into t ring steps under the GEMMs
(``autopar/core/comm/async_tp.py``), with the same values. A collective that
does not match is left whole and listed with why: a gathered value also read
by another op, a reduce-scatter of something other than one GEMM's output,
the embedding's reduce-scatter (a table lookup, no GEMM), the sum of a
parallel block's two row-parallel outputs. The pass reads
node targets and graph structure only, never module names.

``async_tp_refusal`` says when the pass does not run at all: sequence
parallelism off (there is nothing to decompose), compiled chunks (Dynamo
cannot trace point-to-point messages: the collectives stay whole in the
compiled graph), and the zero-bubble schedules (their W defers the weight
GEMMs, which a fused op's backward computes with the input's gradient, in B).
"""

from __future__ import annotations

import operator
from dataclasses import dataclass

import torch
import torch.fx as fx

from autopar.core import comm
from autopar.core.config import SPLIT_BACKWARD_SCHEDULES, ParallelConfig
from autopar.core.graph import module_path

__all__ = ["AsyncTPPlan", "FusedCollective", "LeftWhole", "apply_async_tp", "async_tp_refusal"]

aten = torch.ops.aten


@dataclass(frozen=True)
class FusedCollective:
    """A collective now decomposed with its GEMMs: its node, the GEMMs fused with it, where."""

    node: str
    """The node of the fused op (the collective's own node, retargeted)."""
    collective: str
    """What it was: 'gather_from_sp' or 'reduce_scatter_to_sp'."""
    gemms: tuple[str, ...]
    """The GEMM nodes fused with it (an all-gather's readers, a reduce-scatter's producer)."""
    module: str


@dataclass(frozen=True)
class LeftWhole:
    """A sequence-parallel collective the pass left as it was, and why."""

    node: str
    collective: str
    module: str
    reason: str


@dataclass(frozen=True)
class AsyncTPPlan:
    """What the async tensor-parallel pass fused and what it left; read by the summary."""

    fused: tuple[FusedCollective, ...]
    left: tuple[LeftWhole, ...]

    def count(self, collective: str) -> int:
        """How many collectives of kind ``collective`` were fused."""
        return sum(f.collective == collective for f in self.fused)


def async_tp_refusal(config: ParallelConfig, sequence_parallel_on: bool) -> str | None:
    """Why the pass does not run for ``config`` (None: it runs). ``sequence_parallel_on``: whether the
    sequence-parallel pass split the tokens."""
    if "tp" not in config.overlap:
        return "overlap has no 'tp'"
    if not sequence_parallel_on:
        return ("sequence parallelism is off, so there is no all-gather or reduce-scatter of the tokens to "
                "decompose (sequence_parallel=True or None turns it on)")
    if config.compile:
        return (f"compile={config.compile!r}: Dynamo cannot trace the ring's point-to-point messages, so the "
                f"compiled chunks keep the collectives whole (as functional collectives inside the graph)")
    if config.schedule in SPLIT_BACKWARD_SCHEDULES:
        return (f"schedule {config.schedule!r} defers each backward's weight GEMMs to W; a fused op's backward "
                f"computes its weights' gradients with its input's, in B")
    return None


def apply_async_tp(gm: fx.GraphModule) -> AsyncTPPlan:
    """Fuse every matching sequence-parallel collective of the rank graph ``gm`` with its GEMMs, in place."""
    graph = gm.graph
    order = {n: i for i, n in enumerate(graph.nodes)}
    fused, left = [], []
    for node in list(graph.nodes):
        if node.op != "call_function":
            continue
        if node.target is comm.gather_from_sp:
            why = _fuse_gather(graph, node, order)
        elif node.target is comm.reduce_scatter_to_sp:
            why = _fuse_scatter(graph, node)
        elif node.target is comm.vocab_parallel_embedding_sp:
            why = "the embedding's reduce-scatter: a table lookup, no GEMM to decompose it with"
        else:
            continue
        where = module_path(node) or "(top level)"
        if isinstance(why, str):
            left.append(LeftWhole(node.name, _name(node.target), where, why))
        else:
            fused.append(FusedCollective(node.name, *why, where))
    graph.lint()
    gm.recompile()
    return AsyncTPPlan(tuple(fused), tuple(left))


def _name(target) -> str:
    return getattr(target, "__name__", str(target))


_FORMS = {aten.linear.default: "linear", aten.addmm.default: "addmm", aten.mm.default: "mm",
          aten.matmul.default: "matmul"}
"""The GEMMs the fused ops run, by their op (the forms ``comm.async_tp`` runs)."""


def _gemm_of(user: fx.Node, value: fx.Node) -> tuple[str, fx.Node, fx.Node | None] | None:
    """(form, weight, bias) when ``user`` is a GEMM reading ``value`` as its input and nowhere else."""
    form = _FORMS.get(user.target) if user.op == "call_function" and not user.kwargs else None
    if form is None:
        return None
    if form == "addmm":
        if len(user.args) != 3:
            return None
        bias, x, weight = user.args
    else:
        x, weight, bias = (*user.args, None)[:3]
    others = [a for a in (weight, bias) if a is not None]
    if x is not value or value in others or not isinstance(weight, fx.Node):
        return None
    w = weight.meta.get("local_val")
    if form == "matmul" and not (isinstance(w, torch.Tensor) and w.dim() == 2):
        return None
    return form, weight, bias


def _fuse_gather(graph: fx.Graph, gather: fx.Node, order: dict[fx.Node, int]) -> tuple[str, tuple[str, ...]] | str:
    """``gather`` and the GEMMs reading it -> one ``all_gather_matmul``; or why not."""
    users = sorted(gather.users, key=order.__getitem__)
    gemms = [_gemm_of(u, gather) for u in users]
    if None in gemms:
        u = users[gemms.index(None)]
        return (f"its value is also read by {_name(u.target)} ({u.name} in {module_path(u) or '(top level)'}), "
                f"not only as the input of a GEMM")
    forms, weights, biases = (tuple(g[i] for g in gemms) for i in range(3))
    reads = [a for a in (*weights, *biases) if isinstance(a, fx.Node)]
    latest = max(reads, key=order.__getitem__)
    if order[latest] >= order[users[0]]:
        return f"the weight {latest.name} of a later GEMM is computed after the first one ({users[0].name})"
    value, tp, dim, segments = gather.args
    if order[latest] > order[gather]:
        latest.append(gather)  # the fused op reads every weight: after the last of them
    gather.target, gather.args = comm.all_gather_matmul, (value, tp, dim, segments, weights, biases, forms)
    for j, u in enumerate(users):
        u.target, u.args, u.kwargs = operator.getitem, (gather, j), {}
    return "gather_from_sp", tuple(u.name for u in users)


def _fuse_scatter(graph: fx.Graph, scatter: fx.Node) -> tuple[str, tuple[str, ...]] | str:
    """A bias-free GEMM and the ``reduce_scatter_to_sp`` of its output -> one ``matmul_reduce_scatter``;
    or why not."""
    value, tp, dim, segments = scatter.args
    form = _FORMS.get(value.target) if value.op == "call_function" else None
    if form is None or form == "addmm" or value.kwargs:
        what = "adds a bias before the sum" if form == "addmm" else f"is {_name(value.target)}"
        return f"its input {value.name} {what}, not one bias-free GEMM's output"
    if form == "linear" and len(value.args) > 2 and value.args[2] is not None:
        return f"the linear {value.name} adds its bias before the sum"
    if len(value.users) > 1:
        return f"the GEMM's output {value.name} is also read elsewhere"
    gemm = _gemm_of(value, value.args[0])
    if gemm is None:
        return f"{value.name} is not a GEMM of an activation with a 2-D weight"
    scatter.target, scatter.args = comm.matmul_reduce_scatter, (value.args[0], gemm[1], tp, dim, segments, form)
    graph.erase_node(value)
    return "reduce_scatter_to_sp", (value.name,)
