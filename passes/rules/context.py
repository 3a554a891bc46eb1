"""What a sharding rule reads besides placements: the ``Ctx`` of an analysis and a node's operands.

An operand is named by its *path* in the node's arguments: ``("a", i)`` for
positional argument i, ``("a", i, j)`` for item j of a list argument (the
tensors of ``cat``, the operands of ``einsum``), ``("k", name)`` for a keyword
argument. Decisions name operands by path, and the rewrite puts f, scatters
and gathers there.

Shapes come from ``node.meta["val"]`` (global shapes). Dims are non-negative.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
import torch.fx as fx

from autopar.core.graph import TracedModel
from autopar.core.tensor_placement import Shard

__all__ = ["Ctx", "Path", "operands", "operand", "arg", "arg_path", "is_param", "ndim", "shape", "norm_dims",
           "contiguous", "padded"]

aten = torch.ops.aten

Path = tuple
"""``("a", i)``, ``("a", i, j)`` or ``("k", name)``: where an operand sits in a node's arguments."""


@dataclass
class Ctx:
    """What the rules need to know besides placements."""

    tp: int
    param_of: dict[str, str]
    """Parameter placeholder name -> parameter name."""
    requires_grad: set[str]
    """Nodes whose value depends on a parameter (float): their gradients matter."""
    vocab_embeddings: set[str]
    """Embedding nodes that look up a parameter table by input ids: split by vocabulary."""
    column: dict[fx.Node, tuple[int, ...] | None] = field(default_factory=dict)
    """Column-parallel linear node -> segments of its output features (None = one)."""
    linear_parts: dict[fx.Node, Any] = field(default_factory=dict, repr=False, compare=False)
    """Node -> its ``matmul.linear_parts`` (None: not linear-like), found once: the graph does not
    change while an analysis runs, and each trial asks again of the same nodes."""

    @staticmethod
    def build(traced: TracedModel, tp: int, split_vocabulary: bool | None = None) -> "Ctx":
        """The context of an analysis for ``tp`` ranks; embeddings are split by vocabulary when
        ``split_vocabulary`` (default: tp > 1; the analysis of which degrees fit asks for it at t = 1)."""
        split_vocabulary = tp > 1 if split_vocabulary is None else split_vocabulary
        requires_grad, from_input = set(traced.param_of), set(traced.input_names)
        for n in traced.gm.graph.nodes:
            if n.op != "call_function":
                continue
            inputs = {a.name for a in n.all_input_nodes}
            if inputs & requires_grad and _is_float(n):
                requires_grad.add(n.name)
            if inputs & from_input:
                from_input.add(n.name)
        vocab = set()
        for n in traced.gm.graph.nodes:
            if n.op == "call_function" and n.target == aten.embedding.default:
                table, ids = n.args[0], n.args[1]
                if split_vocabulary and table.name in traced.param_of and ids.name in from_input:
                    vocab.add(n.name)
        return Ctx(tp, dict(traced.param_of), requires_grad, vocab)

    def divides(self, size: int) -> bool:
        """``size`` splits t ways: a multiple of t, and at least 2. For t >= 2 the second condition
        follows from the first; at t = 1, where ``sharding.ideal_decisions`` looks for the plan any
        degree could follow, it keeps out splits no t >= 2 could make (a dimension of size 1)."""
        return size % self.tp == 0 and size >= 2

    def is_column(self, name: str | None) -> bool:
        """``name`` is a linear tried or kept column-parallel."""
        return name is not None and any(n.name == name for n in self.column)


def _is_float(n: fx.Node) -> bool:
    v = n.meta.get("val")
    if isinstance(v, torch.Tensor):
        return v.dtype.is_floating_point
    if isinstance(v, (list, tuple)):
        return any(isinstance(x, torch.Tensor) and x.dtype.is_floating_point for x in v)
    return False


def operands(node: fx.Node) -> list[tuple[Path, fx.Node]]:
    """(path, node) of every fx.Node argument of ``node``."""
    out = []
    for i, a in enumerate(node.args):
        if isinstance(a, fx.Node):
            out.append((("a", i), a))
        elif isinstance(a, (list, tuple)):
            out.extend((("a", i, j), b) for j, b in enumerate(a) if isinstance(b, fx.Node))
    for k, a in node.kwargs.items():
        if isinstance(a, fx.Node):
            out.append((("k", k), a))
    return out


def operand(node: fx.Node, path: Path) -> Any:
    """The argument of ``node`` at ``path``."""
    if path[0] == "k":
        return node.kwargs[path[1]]
    a = node.args[path[1]]
    return a[path[2]] if len(path) == 3 else a


def arg(node: fx.Node, index: int, name: str, default=None) -> Any:
    """Argument ``name`` of ``node``, given positionally at ``index`` or by keyword."""
    if len(node.args) > index:
        return node.args[index]
    return node.kwargs.get(name, default)


def arg_path(node: fx.Node, index: int, name: str) -> Path:
    """The path of argument ``name``: positional if given so, else its keyword."""
    return ("a", index) if len(node.args) > index else ("k", name)


def is_param(ctx: Ctx, n) -> bool:
    return isinstance(n, fx.Node) and n.op == "placeholder" and n.name in ctx.param_of


def ndim(n: fx.Node) -> int:
    return len(n.meta["val"].shape)


def shape(n: fx.Node) -> tuple[int, ...]:
    return tuple(int(s) for s in n.meta["val"].shape)


def norm_dims(dims, nd: int) -> list[int]:
    """A dim argument (None, an int, a list; empty means all) as non-negative dims."""
    if dims is None:
        return list(range(nd))
    if isinstance(dims, int):
        dims = [dims]
    if len(dims) == 0:
        return list(range(nd))
    return [d % nd for d in dims]


def contiguous(p: Shard) -> bool:
    """One block per rank (possibly padded): the layout the vocabulary-parallel kernels read."""
    return p.segments is None or len(p.segments) == 1


def padded(x: fx.Node, p: Shard) -> bool:
    """The split dim of ``x`` is padded to a multiple of t (a vocabulary)."""
    return p.segments is not None and sum(p.segments) != shape(x)[p.dim]
