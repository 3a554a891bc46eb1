"""Static shapes: a value whose size depends on tensor values is refused, with its op and line.

Every pass after tracing assumes that the example microbatch fixes all
shapes, as in Megatron: the pipeline cut, the shards and the buffers are
sized before training. torch.export traces ``torch.nonzero``,
``x[mask]``, ``torch.unique``, ``.item()`` and the like with an unbacked
symbol (``u0``) for the size it cannot know. Right after the export
(``trace.py``), before any pass, ``check_static_shapes`` refuses the first op
that makes such a symbol, naming the op, the user's line, the module and what
to write instead (mask instead of select, count with a fixed size, keep the
value a tensor).

A tensor value read only to be asserted on (``assert lengths.max().item() <=
n``, as in XLM) makes a scalar no tensor reads: the assertion, and the ops
that computed only it, are dropped instead (not checked during training).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.fx as fx
import torch.nn as nn

from autopar.compiler.trace_error import TraceError
from autopar.core.graph import module_path, source_line

__all__ = ["check_static_shapes", "holds_tensor"]


def check_static_shapes(model: nn.Module, gm: fx.GraphModule) -> None:
    """Refuse a graph with a value whose shape (or a scalar) depends on tensor values.

    torch.export traces ``torch.nonzero``, ``x[mask]``, ``torch.unique``, ``.item()`` and the
    like with an unbacked symbol (``u0``) for the size it cannot know; every pass after this one
    assumes the example microbatch fixes all shapes. The first node with such a symbol is the op
    that made it; the ops after it only carry it on.
    """
    _drop_value_assertions(gm)
    made = [n for n in gm.graph.nodes if n.op == "call_function" and _symbolic(n.meta.get("val"))]
    if not made:
        return
    node = made[0]
    line = source_line(node) or "(no line of the model's code)"
    path = module_path(node)
    raise TraceError(
        f"cannot trace {type(model).__name__}: {_op_label(node)} makes a value whose size depends on tensor "
        f"values ({_shape_text(node.meta.get('val'))})\n"
        f"  at {line}" + (f" (in {path})" if path else "") + "\n"
        f"  {_carried(made[1:])} later tensor(s) carry that size. autopar needs static shapes: every shape must follow "
        "from the example microbatch's shapes, so the pipeline cut, the shards and the buffers can be sized "
        "before training.\n"
        f"  try: {_static_alternative(node)}"
    )


def _drop_value_assertions(gm: fx.GraphModule) -> None:
    """Remove the tensor values read only to be asserted on (``assert lengths.max().item() <= n``).

    Export turns such an assertion into ``item -> le -> _assert_scalar``: a scalar no tensor of the
    graph reads, checked at run time. The scalar (``aten.item`` or ``_local_scalar_dense``), the
    comparisons on it and the assertion go, and with them the ops left without users that computed
    only them; the assertion is not checked during training. A scalar that any tensor reads (a size,
    a fill value) stays, and ``check_static_shapes`` refuses it.
    """
    scalars = (torch.ops.aten.item.default, torch.ops.aten._local_scalar_dense.default)
    for node in [n for n in gm.graph.nodes if n.op == "call_function" and n.target in scalars]:
        reached, todo = [], [node]
        while todo:
            n = todo.pop()
            if n in reached:
                continue
            reached.append(n)
            todo.extend(n.users)
        if any(n.op != "call_function" or holds_tensor(n.meta.get("val")) for n in reached):
            continue
        producers = list(node.all_input_nodes)
        for n in sorted(reached, key=_position(gm), reverse=True):
            gm.graph.erase_node(n)
        while producers:
            n = producers.pop()
            if n.op == "call_function" and not n.users and isinstance(n.target, torch._ops.OpOverload) \
                    and not n.target._schema.is_mutable:
                producers.extend(n.all_input_nodes)
                gm.graph.erase_node(n)
    gm.recompile()


def _position(gm: fx.GraphModule) -> Callable[[fx.Node], int]:
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    return order.__getitem__


def holds_tensor(val: Any) -> bool:
    """A tensor, or a tuple, list or dict holding one."""
    if isinstance(val, dict):
        val = list(val.values())
    return isinstance(val, torch.Tensor) or (isinstance(val, (tuple, list)) and any(holds_tensor(v) for v in val))


def _carried(nodes: list[fx.Node]) -> int:
    """How many of ``nodes`` hold a tensor (not a size or a check on one)."""
    return sum(holds_tensor(n.meta.get("val")) for n in nodes)


def _symbolic(val: Any) -> bool:
    """Whether a node's value (a tensor, a Python scalar, or a tuple or list of them) has a symbolic size."""
    if isinstance(val, (tuple, list)):
        return any(_symbolic(v) for v in val)
    if isinstance(val, torch.Tensor):
        return any(not isinstance(s, int) for s in val.shape)
    return isinstance(val, (torch.SymInt, torch.SymFloat, torch.SymBool))


def _shape_text(val: Any) -> str:
    if isinstance(val, (tuple, list)):
        return ", ".join(_shape_text(v) for v in val if _symbolic(v))
    if isinstance(val, torch.Tensor):
        return f"shape ({', '.join(str(s) for s in val.shape)})"
    return f"the scalar {val}"


def _python_name(node: fx.Node) -> str:
    """The Python call the user wrote (``nonzero``, ``__getitem__``, ``unique``), from export's meta."""
    fn = node.meta.get("torch_fn")
    return fn[1].rsplit(".", 1)[-1] if fn else ""


def _op_label(node: fx.Node) -> str:
    """``aten.nonzero.default (torch.nonzero)``: the graph's op and the call it came from."""
    op = str(node.target)
    name = _python_name(node)
    if name == "__getitem__":
        return f"{op} (indexing x[...] with a boolean mask or computed indices)"
    return f"{op} ({name})" if name and name not in op else op


def _static_alternative(node: fx.Node) -> str:
    """What to write instead, by the kind of op that made the size."""
    op = getattr(node.target, "__name__", str(node.target))
    if any(k in op for k in ("item", "_local_scalar_dense")):
        return ("keep the value a tensor (no .item(), int(t), float(t), .tolist()) and use it in tensor ops, "
                "or compute it outside forward from the batch and pass a fixed number")
    if any(k in op for k in ("unique", "bincount", "histc")):
        return ("count with a fixed size instead: F.one_hot(x, num_classes).sum(dim) or "
                "torch.zeros(n).scatter_add_(0, x, ones), n known from the model's configuration")
    return ("keep the full shape and mask instead of selecting: torch.where(mask, x, 0), x * mask, "
            "x.masked_fill(~mask, value); for a mixture of experts, route densely (every expert on every "
            "token, weighted by a gate that is zero where the token is not routed, as with stacked expert "
            "weights and a grouped matmul) instead of gathering the routed tokens by a computed index "
            "(nonzero, where(mask), x[mask]) and index_add-ing them back")
