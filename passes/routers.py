"""Mixture-of-experts routers found from the graph: the linears whose output features a top-k chooses among.

A router's few logits are the scores its top-k picks experts from; split by
tensor parallelism they would only be gathered back, so the sharding analysis
(``passes/sharding.py``) keeps every router whole, as Megatron does.
"""

from __future__ import annotations

import torch
import torch.fx as fx

from passes.rules import Ctx, linear_parts, out_features
from passes.rules.context import arg, ndim, shape

aten = torch.ops.aten

__all__ = ["find_routers"]


_SCORE_OPS = frozenset({aten.softmax.int, aten._softmax.default, aten.log_softmax.int, aten._log_softmax.default,
                        aten.sigmoid.default, aten.to.dtype, aten._to_copy.default, aten.add.Tensor, aten.sub.Tensor,
                        aten.mul.Tensor, aten.div.Tensor, aten.view.default, aten.reshape.default,
                        aten.clone.default, aten.alias.default})
"""Ops between a router's linear and its top-k (a softmax or sigmoid in fp32, a correction bias, a
scale) that keep the scores one per output feature."""


def find_routers(nodes: list[fx.Node], ctx: Ctx) -> dict[fx.Node, fx.Node]:
    """Linear -> the top-k it feeds: a linear whose output features, through ``_SCORE_OPS`` that keep
    them, are the last dim a ``topk`` chooses among (a mixture of experts' router)."""
    found: dict[fx.Node, fx.Node] = {}
    for node in nodes:
        if linear_parts(ctx, node) is None:
            continue
        width, seen, todo = out_features(ctx, node), set(), [node]
        while todo and node not in found:
            n = todo.pop()
            for u in n.users:
                if u in seen or not isinstance(u.meta.get("val"), torch.Tensor) and u.target != aten.topk.default:
                    continue
                seen.add(u)
                x = u.args[0] if u.args else None
                if (u.target == aten.topk.default and x is n and shape(n)[-1] == width
                        and arg(u, 2, "dim", -1) % ndim(n) == ndim(n) - 1):
                    found[node] = u
                    break
                if u.target in _SCORE_OPS and shape(u) and shape(u)[-1] == width:
                    todo.append(u)
    return found
