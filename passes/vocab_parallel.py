"""Replace an op by the call its rule names (``Decision.rewrite``).

The vocabulary-parallel ops are replaced so: the embedding over a table split
by rows by ``vocab_parallel_embedding``, the cross-entropy, nll_loss and
gather over logits split by vocabulary by their kernels, logsumexp, softmax
and log_softmax over the split dim by theirs (all in ``autopar.core.comm``,
where each registers its collectives). The table E (V, h) is split by rows:
rank i holds E[i*V/t : (i+1)*V/t]; a tied LM head uses the same shard, so its
logits are split by vocabulary, and the losses are computed from the split
logits with a few all-reduces of (N,)-sized tensors: the full (N, V) logits
never exist on any rank. A vocabulary not divisible by t is padded to the
next multiple of t; padded rows are zero, never looked up, and masked to -inf
in the loss.

A row-parallel linear with a bias is rewritten the same way (to the linear
without it; the bias is added after g).
"""

from __future__ import annotations

import torch.fx as fx

from passes.rules.context import operand
from passes.rules.decision import TP, Operand, Rewrite

__all__ = ["apply_rewrite", "copy_meta"]


def copy_meta(new: fx.Node, like: fx.Node) -> fx.Node:
    """Mark ``new`` as inserted by the rewrite, at the place of the user's source of ``like``."""
    for key in ("nn_module_stack", "stack_trace"):
        if key in like.meta:
            new.meta[key] = like.meta[key]
    new.meta["autopar"] = "inserted"
    return new


def apply_rewrite(graph: fx.Graph, node: fx.Node, rewrite: Rewrite, tp: fx.Node) -> fx.Node:
    """``node`` replaced by ``rewrite.fn(*args)``: retargeted in place, or a new node; returns it."""
    args = tuple(tp if a is TP else operand(node, a.path) if isinstance(a, Operand) else a for a in rewrite.args)
    if rewrite.in_place:
        node.target, node.args, node.kwargs = rewrite.fn, args, {}
        return node
    with graph.inserting_after(node):
        new = graph.call_function(rewrite.fn, args)
    for key in ("nn_module_stack", "stack_trace", "val"):  # the same value as the node it replaces
        if key in node.meta:
            new.meta[key] = node.meta[key]
    node.replace_all_uses_with(new)
    graph.erase_node(node)
    return new
