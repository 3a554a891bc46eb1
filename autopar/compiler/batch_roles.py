"""What the batch tensors are to the traced graph: ids looked up in a table, targets of the loss.

Read once from the traced graph (``TracedModel.gm``, before any tensor-parallel
rewrite) and kept in the frozen ``Program`` as ``program.batch_roles``; the
runtime checks each step's batch against it before any work
(``autopar/runtime/engine/batch_checks.py``) and weights the microbatch losses by it
(``autopar/runtime/engine/loss_weights.py``).

- **Ids** (``IdUse``): a batch tensor that reaches, through ops that only move
  its values (views, slices, pads, copies, integer casts), the indices of an
  embedding (checked against the table's rows), the target of a
  cross-entropy / nll loss (against the logits' class dim; the op's
  ``ignore_index`` is allowed) or the index of a gather (against the gathered
  dim). Under tensor parallelism the vocabulary-parallel embedding and losses
  mask ids outside a rank's rows, so an id beyond the vocabulary would not fail
  by itself; one device raises an index error.
- **Index-only** tensors: every use is such an index. An integer tensor of
  another width is accepted for them and cast to the traced dtype.
- **The token loss** (``TokenLoss``): the traced loss is a mean-reduced
  cross-entropy / nll over integer targets with an ``ignore_index`` and no class
  weights, its value the graph's output (past casts and views). Its mean runs
  over the targets not ignored, so a batch of m microbatches has the one-device
  loss sum_i n_i / N * loss_i (n_i counted targets in microbatch i, N in all).
  The targets the op reads are computed from the batch tensors by a small graph
  (``TokenLoss.targets``: the ops between them, a shift or a pad included) that
  the runtime runs on each microbatch to count n_i.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass

import torch
import torch.fx as fx

from autopar.core.graph import TracedModel, module_path, source_line

__all__ = ["IdUse", "TokenLoss", "BatchRoles", "find_batch_roles"]

_aten = torch.ops.aten


def _ops(*names: str) -> frozenset:
    """The aten overloads named ``op.overload`` that this torch has."""
    out = set()
    for name in names:
        op, overload = name.split(".")
        packet = getattr(_aten, op, None)
        if packet is not None and hasattr(packet, overload):
            out.add(getattr(packet, overload))
    return frozenset(out)


_MOVES = _ops("view.default", "_unsafe_view.default", "reshape.default", "flatten.using_ints", "unflatten.int",
              "alias.default", "clone.default", "contiguous.default", "unsqueeze.default", "squeeze.dim",
              "squeeze.dims", "squeeze.default", "permute.default", "transpose.int", "t.default", "expand.default",
              "slice.Tensor", "select.int", "narrow.default", "detach.default", "lift_fresh_copy.default",
              "pad.default", "constant_pad_nd.default", "_to_copy.default", "to.dtype", "to.dtype_layout",
              "split.Tensor", "chunk.default")
"""Ops whose output holds values of their first input (or a constant pad): an id stays an id through them."""

_CLASS_LOSSES = _ops("cross_entropy_loss.default", "nll_loss.default", "nll_loss_nd.default",
                     "nll_loss_forward.default", "nll_loss2d.default", "nll_loss2d_forward.default")
"""Losses over class indices: (input, target, weight, reduction, ignore_index, ...)."""

_SCALAR_PASS = _ops("alias.default", "clone.default", "_to_copy.default", "to.dtype", "view.default",
                    "reshape.default", "squeeze.default", "_unsafe_view.default")
"""Ops between the loss op and the graph's output that leave the loss's value as it is."""

_MEAN = 1
"""``torch.nn._reduction``'s code of reduction='mean'."""


@dataclass(frozen=True)
class IdUse:
    """A batch tensor whose values index something: they must lie in ``[0, size)`` (or equal ``ignore_index``)."""

    name: str
    """The batch tensor (the graph's placeholder, named after the forward's or the loss's parameter)."""
    size: int
    """The table's rows, the classes of the loss, or the gathered dim's size."""
    ignore_index: int | None
    """The loss's ``ignore_index`` (allowed), or None for a lookup."""
    what: str
    """What the ids index, for messages ('rows of the embedding table model.embed_tokens.weight')."""
    where: str
    """The op's source line or module path."""
    kind: str
    """'embedding', 'target' (of a loss) or 'gather'."""


@dataclass(frozen=True, eq=False)
class TokenLoss:
    """The traced loss is a mean over the targets not equal to ``ignore_index``."""

    op: str
    """The loss op ('cross_entropy_loss', 'nll_loss_nd', ...)."""
    ignore_index: int
    targets: fx.GraphModule
    """(batch tensors named by ``reads``, one microbatch each) -> the targets the loss op reads."""
    reads: tuple[str, ...]
    """The batch tensors ``targets`` takes, in order."""
    where: str


@dataclass(frozen=True, eq=False)
class BatchRoles:
    """What the batch tensors are to the graph (``find_batch_roles``)."""

    ids: tuple[IdUse, ...] = ()
    index_only: frozenset[str] = frozenset()
    """Batch tensors every use of which is an index (another integer width is cast to the traced one)."""
    loss: TokenLoss | None = None
    """The token-mean loss; None when the loss is anything else (microbatches weighted equally)."""
    why_not_tokens: str = ""
    """Why ``loss`` is None, for the summary and the docs."""


def find_batch_roles(traced: TracedModel) -> BatchRoles:
    """The ids, the index-only tensors and the token loss of ``traced``'s batch tensors."""
    nodes = {n.name: n for n in traced.gm.graph.nodes if n.op == "placeholder"}
    batch = [nodes[n] for n in traced.input_names + traced.target_names if n in nodes]
    ids: list[IdUse] = []
    index_only = set()
    for ph in batch:
        uses, other = _index_uses(ph, traced)
        for use in uses:
            if use not in ids:
                ids.append(use)
        if uses and not other:
            index_only.add(ph.name)
    loss, why = _token_loss(traced, {p.name for p in batch})
    return BatchRoles(ids=tuple(ids), index_only=frozenset(index_only), loss=loss, why_not_tokens=why)


def _moves(node: fx.Node) -> bool:
    if node.op != "call_function":
        return False
    if node.target is operator.getitem:
        return True
    if node.target not in _MOVES:
        return False
    val = node.meta.get("val")
    return not isinstance(val, torch.Tensor) or not (val.is_floating_point() or val.is_complex())


def _index_uses(ph: fx.Node, traced: TracedModel) -> tuple[list[IdUse], bool]:
    """The index operands ``ph`` reaches through value-moving ops; and whether it has any other use."""
    uses, other = [], False
    frontier, seen = [ph], set()
    while frontier:
        node = frontier.pop()
        for user in node.users:
            if user in seen:
                continue
            seen.add(user)
            if _moves(user) and user.args and user.args[0] is node:
                frontier.append(user)
                continue
            use = _index_use(ph.name, node, user, traced)
            if use is None:
                other = True
            else:
                uses.append(use)
    return uses, other


def _arg(node: fx.Node, i: int, name: str, default=None):
    if len(node.args) > i:
        return node.args[i]
    return node.kwargs.get(name, default)


def _where(node: fx.Node) -> str:
    return source_line(node) or module_path(node) or f"graph node {node.name}"


def _index_use(name: str, value: fx.Node, op: fx.Node, traced: TracedModel) -> IdUse | None:
    """``value`` (ids of batch tensor ``name``) as an index operand of ``op``, or None."""
    if op.op != "call_function":
        return None
    if op.target is _aten.embedding.default and _arg(op, 1, "indices") is value:
        table = op.args[0]
        rows = int(table.meta["val"].shape[0])
        label = traced.param_of.get(table.name, table.name)
        return IdUse(name, rows, None, f"rows of the embedding table {label}", _where(op), "embedding")
    if op.target in _CLASS_LOSSES and _arg(op, 1, "target") is value:
        logits = op.args[0].meta["val"]
        classes = int(logits.shape[0] if logits.dim() == 1 else logits.shape[1])
        ignore = int(_arg(op, 4, "ignore_index", -100))
        return IdUse(name, classes, ignore, f"classes of {op.target._schema.name.split('::')[-1]}",
                     _where(op), "target")
    if op.target is _aten.gather.default and _arg(op, 2, "index") is value:
        src = op.args[0].meta["val"]
        dim = int(op.args[1]) % src.dim()
        return IdUse(name, int(src.shape[dim]), None, f"entries of dim {dim} of gather", _where(op), "gather")
    return None


def _token_loss(traced: TracedModel, batch: set[str]) -> tuple[TokenLoss | None, str]:
    """The output's loss op when it is a token mean (see the module's docstring); else why not."""
    out = next(n for n in traced.gm.graph.nodes if n.op == "output")
    node = out.args[0][0]
    while node.op == "call_function" and node.target in _SCALAR_PASS:
        node = node.args[0]
    if node.op == "call_function" and node.target is operator.getitem and node.args[1] == 0:
        node = node.args[0]  # nll_loss_forward returns (loss, total weight)
    if node.op != "call_function" or node.target not in _CLASS_LOSSES:
        return None, "the loss is not a cross-entropy or nll loss (the graph's output)"
    name = node.target._schema.name.split("::")[-1]
    if _arg(node, 2, "weight") is not None:
        return None, f"{name} has class weights (its mean is weighted)"
    if _arg(node, 3, "reduction", _MEAN) != _MEAN:
        return None, f"{name} is not mean-reduced"
    target = _arg(node, 1, "target")
    val = target.meta.get("val")
    if not isinstance(val, torch.Tensor) or val.is_floating_point():
        return None, f"{name} has class probabilities as targets (every row counts)"
    graph, reads, why = _subgraph(target, batch)
    if graph is None:
        return None, why
    loss = TokenLoss(op=name, ignore_index=int(_arg(node, 4, "ignore_index", -100)),
                     targets=fx.GraphModule(torch.nn.Module(), graph), reads=reads, where=_where(node))
    return loss, ""


def _subgraph(target: fx.Node, batch: set[str]) -> tuple[fx.Graph | None, tuple[str, ...], str]:
    """The ops computing ``target`` from the batch tensors alone, as a graph of its own."""
    seen, stack = set(), [target]
    while stack:
        node = stack.pop()
        if node in seen:
            continue
        seen.add(node)
        if node.op == "placeholder":
            if node.name not in batch:
                return None, (), f"the loss's targets are computed from {node.name}, not from the batch alone"
        elif node.op != "call_function":
            return None, (), f"the loss's targets are computed by {node.op} {node.name}"
        elif isinstance(node.target, torch._ops.OpOverload) and torch.Tag.nondeterministic_seeded in node.target.tags:
            return None, (), f"the loss's targets are drawn at random ({node.name})"
        stack.extend(node.all_input_nodes)
    graph, env = fx.Graph(), {}
    keep = [n for n in target.graph.nodes if n in seen]  # graph order: inputs before users
    reads = tuple(n.name for n in keep if n.op == "placeholder")
    for node in keep:
        env[node] = graph.node_copy(node, env.__getitem__)
    graph.output(env[target])
    return graph, reads, ""
