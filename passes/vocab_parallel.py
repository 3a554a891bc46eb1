"""Vocabulary-parallel embedding, cross-entropy and softmax-family rewrites.

The embedding table E (V, h) is split by rows: rank i holds
E[i*V/t : (i+1)*V/t]. A tied LM head uses the same shard, so its logits are
split by vocabulary, and the cross-entropy is computed from the split logits
with three all-reduces of (N,)-sized tensors: the full (N, V) logits never
exist on any rank. A vocabulary not divisible by t is padded to the next
multiple of t; padded rows are zero, never looked up, and masked to -inf in
the loss (see ``autopar.core.comm``). ``logsumexp``, ``softmax`` and ``log_softmax``
over the split vocabulary (a z-loss, distillation, a hand-written loss) run
on the local columns with two all-reduces of the reduced shape.
"""

from __future__ import annotations

import torch.fx as fx

from autopar.core import comm

__all__ = ["rewrite_embedding", "rewrite_cross_entropy", "rewrite_softmax"]


def _meta(new: fx.Node, like: fx.Node) -> fx.Node:
    for key in ("nn_module_stack", "stack_trace"):
        if key in like.meta:
            new.meta[key] = like.meta[key]
    return new


def rewrite_embedding(graph: fx.Graph, node: fx.Node, tp: fx.Node, padding_idx: int = -1) -> fx.Node:
    """embedding(E, ids) -> vocab_parallel_embedding(E_local, ids, tp[, padding_idx])."""
    weight, ids = node.args[0], node.args[1]
    args = (weight, ids, tp) if padding_idx == -1 else (weight, ids, tp, padding_idx)
    with graph.inserting_after(node):
        new = _meta(graph.call_function(comm.vocab_parallel_embedding, args), node)
    node.replace_all_uses_with(new)
    graph.erase_node(node)
    return new


def rewrite_cross_entropy(graph: fx.Graph, node: fx.Node, tp: fx.Node, extra: dict) -> fx.Node:
    """cross_entropy_loss(z, y) -> vocab_parallel_cross_entropy(z_local, y, tp, V, ignore, reduction, smoothing)."""
    logits, target = node.args[0], node.args[1]
    if extra.get("soft"):  # class probabilities, already sliced like the logits
        fn = comm.vocab_parallel_soft_cross_entropy
        args = (logits, target, tp, extra["vocab_size"], extra["reduction"], extra["label_smoothing"])
    else:
        fn = comm.vocab_parallel_cross_entropy
        args = (logits, target, tp, extra["vocab_size"], extra["ignore_index"], extra["reduction"],
                extra.get("label_smoothing", 0.0))
    with graph.inserting_after(node):
        new = _meta(graph.call_function(fn, args), node)
    node.replace_all_uses_with(new)
    graph.erase_node(node)
    return new


def rewrite_softmax(graph: fx.Graph, node: fx.Node, tp: fx.Node, extra: dict) -> fx.Node:
    """logsumexp / softmax / log_softmax over the split dim -> their vocabulary-parallel forms."""
    x, op, dim, size = node.args[0], extra["op"], extra["dim"], extra["size"]
    if op == "logsumexp":
        fn, args = comm.vocab_parallel_logsumexp, (x, tp, dim, size, extra["keepdim"])
    else:
        fn = comm.vocab_parallel_softmax if op == "softmax" else comm.vocab_parallel_log_softmax
        args = (x, tp, dim, size, node.meta["val"].dtype)
    with graph.inserting_after(node):
        new = _meta(graph.call_function(fn, args), node)
    node.replace_all_uses_with(new)
    graph.erase_node(node)
    return new
