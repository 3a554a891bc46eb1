"""The evaluation form of a chunk graph: the ops as ``model.eval()`` runs them.

autopar traces the model in training mode, so the graph carries the training
behaviour of its ops in their arguments. Which arguments those are is read from
each op's schema, not from a list of ops or of the model's modules:

- a bool argument named ``train``, ``training`` or ``use_input_stats``
  (dropout and its relatives, ``rrelu``, ``batch_norm``, ``instance_norm``)
  is set to False. An op that also takes running statistics (``running_mean``,
  ``running_var``) keeps its batch statistics when it was given none, as
  ``nn.BatchNorm(track_running_stats=False)`` does in eval mode;
- a float ``dropout_p`` (``scaled_dot_product_attention``) is set to 0;
- an op of the dropout family (its name ends in ``dropout``, one tensor out)
  returns its input when not training, so it is removed;
- an op that the tensor-parallel rewrite wrapped in ``comm.tp_rng_call`` (a
  random op on a split value) is unwrapped once its randomness is off: it no
  longer draws a seed.

The sub-graphs that higher-order ops run (``no_grad`` and ``autocast`` regions)
are made evaluation copies the same way.

What the graph cannot show is left as traced and listed: random ops without
such an argument (noise a model adds under ``if self.training:``, a branch
taken at trace time) draw in evaluation too, and each is named in the notes.
The result is a new graph; the training graph is not touched.

The last chunk's evaluation graph (``last=True``) also returns the logits: the
value ``output_fn`` returned, found by the mark tracing put in its meta
(``LOGITS_META``), as a second output after the loss. It is computed for the
loss anyway, so returning it costs nothing; ``engine.eval_step(outputs=True)``
keeps it, a plain ``eval_step`` drops it. A graph where no one node carries
the mark (``output_fn`` returned no tensor, a pass rewrote the value into a new
node) returns the loss alone; ``eval_step(outputs=True)`` then says why.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass

import torch
import torch.fx as fx

from autopar.core import comm
from autopar.core.errors import AutoparError
from autopar.core.graph import LOGITS_META

__all__ = ["EvalGraph", "eval_graph", "TRAIN_FLAGS", "EvalModeError"]

TRAIN_FLAGS: tuple[str, ...] = ("train", "training", "use_input_stats")
"""Bool schema arguments that switch an op to its training behaviour (False in evaluation)."""
_RUNNING_STATS = ("running_mean", "running_var")
_DROPOUT_P = "dropout_p"


@dataclass(frozen=True)
class EvalGraph:
    """A chunk graph in evaluation mode, and what was changed to make it."""

    gm: fx.GraphModule
    notes: tuple[str, ...]
    """One line per changed node (``dropout (aten.dropout): removed``), and per random op left."""


class EvalModeError(AutoparError, KeyError):
    """The evaluation pass asked an op for a schema argument the op does not have."""


@dataclass
class _Call:
    """An op call in the graph, seen through a ``tp_rng_call`` wrapper: the op and its own arguments."""

    node: fx.Node
    op: torch._ops.OpOverload
    args: list
    kwargs: dict
    wrapped: bool
    """The node is ``tp_rng_call(op, tp, *args)``."""

    @staticmethod
    def of(node: fx.Node) -> _Call | None:
        if node.op != "call_function":
            return None
        if node.target is comm.tp_rng_call:
            op, _tp, *args = node.args
            return _Call(node, op, args, dict(node.kwargs), True) if isinstance(op, torch._ops.OpOverload) else None
        if isinstance(node.target, torch._ops.OpOverload):
            return _Call(node, node.target, list(node.args), dict(node.kwargs), False)
        return None

    def get(self, name: str):
        """The value of schema argument ``name``: positional, keyword, or its default."""
        for i, arg in enumerate(self.op._schema.arguments):
            if arg.name == name:
                if i < len(self.args) and not arg.kwarg_only:
                    return self.args[i]
                return self.kwargs.get(name, arg.default_value if arg.has_default_value() else None)
        raise EvalModeError(f"{self.op} has no schema argument {name!r}")

    def set(self, name: str, value) -> None:
        for i, arg in enumerate(self.op._schema.arguments):
            if arg.name == name:
                if i < len(self.args) and not arg.kwarg_only:
                    self.args[i] = value
                else:
                    self.kwargs[name] = value
                return
        raise EvalModeError(f"{self.op} has no schema argument {name!r}")

    @property
    def names(self) -> set[str]:
        return {a.name for a in self.op._schema.arguments}

    @property
    def label(self) -> str:
        return f"{self.node.name} ({self.op._schema.name.replace('::', '.')})"


def eval_graph(gm: fx.GraphModule, last: bool = False) -> EvalGraph:
    """A copy of ``gm`` with every op in its evaluation form (see the module's docstring); ``last``:
    the last chunk's, which returns ``(loss, logits)`` where a node is marked as the logits."""
    graph = copy.deepcopy(gm.graph)
    notes: list[str] = []
    logits = _marked_logits(graph) if last else None
    for node in list(graph.nodes):
        call = _Call.of(node)
        if call is None:
            continue
        changes = _switch_off_training(call)
        if changes and _returns_input(call):
            node.replace_all_uses_with(call.args[0])
            graph.erase_node(node)
            logits = call.args[0] if node is logits else logits
            notes.append(f"{call.label}: removed (the identity when not training)")
        elif changes:
            node.target, node.args, node.kwargs = call.op, tuple(call.args), call.kwargs
            notes.append(f"{call.label}: {', '.join(changes)}")
        elif _random_in_eval(call):
            notes.append(f"{call.label}: random, draws in evaluation too (no training argument switches it)")
    if logits is not None:
        _return_logits(graph, logits)
    out = fx.GraphModule(gm, graph)  # its code generated once, from the finished graph
    notes += _regions_in_eval(out)
    out.graph.lint()
    return EvalGraph(out, tuple(notes))


def _regions_in_eval(gm: fx.GraphModule) -> list[str]:
    """The sub-graphs higher-order ops run (``no_grad`` and ``autocast`` regions, kept as ``get_attr``
    sub-modules) in their evaluation form too: each replaced in ``gm`` by its own evaluation copy,
    the training graph's sub-module left as it is."""
    notes = []
    for node in gm.graph.nodes:
        sub = getattr(gm, node.target, None) if node.op == "get_attr" else None
        if isinstance(sub, fx.GraphModule):
            region = eval_graph(sub)
            setattr(gm, node.target, region.gm)
            notes += [f"{node.target}: {note}" for note in region.notes]
    return notes


def _marked_logits(graph: fx.Graph) -> fx.Node | None:
    """The one node that carries tracing's logits mark (``LOGITS_META``); None when none does
    (``output_fn`` returned no tensor, a pass replaced the value by a new node) or several do."""
    marked = [n for n in graph.nodes if n.meta.get(LOGITS_META) and n.op != "output"]
    return marked[0] if len(marked) == 1 and isinstance(marked[0].meta.get("val"), torch.Tensor) else None


def _return_logits(graph: fx.Graph, logits: fx.Node) -> None:
    """The graph's output ``(loss,)`` becomes ``(loss, logits)``."""
    output = next(n for n in reversed(graph.nodes) if n.op == "output")
    (loss,) = output.args[0]
    output.args = ((loss, logits),)


def _switch_off_training(call: _Call) -> list[str]:
    """Set ``call``'s training arguments to their evaluation values; what changed, as text."""
    names = call.names
    changes = []
    keeps_batch_stats = any(s in names and call.get(s) is None for s in _RUNNING_STATS)
    for flag in TRAIN_FLAGS:
        if flag in names and call.get(flag) is True and not keeps_batch_stats:
            call.set(flag, False)
            changes.append(f"{flag}=False")
    if _DROPOUT_P in names and call.get(_DROPOUT_P):
        changes.append(f"{_DROPOUT_P}={call.get(_DROPOUT_P)} -> 0")
        call.set(_DROPOUT_P, 0.0)
    return changes


def _returns_input(call: _Call) -> bool:
    """A dropout-family op (``dropout``, ``alpha_dropout``, ``feature_dropout``, ...) with one
    tensor out: when not training it returns its input."""
    schema = call.op._schema
    return schema.name.split("::")[-1].endswith("dropout") and len(schema.returns) == 1 and bool(call.args)


def _random_in_eval(call: _Call) -> bool:
    """A random op with no argument that switches its randomness off in evaluation."""
    seeded = torch.Tag.nondeterministic_seeded in call.op.tags
    return seeded and not call.names & {*TRAIN_FLAGS, _DROPOUT_P}
