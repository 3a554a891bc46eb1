"""Vocabulary-parallel ops: an embedding table split by rows, and the losses and softmax family
over logits split by vocabulary. Each decision names the kernel of ``autopar.core.comm`` that
replaces the op (``Decision.rewrite``); the kernel does its own all-reduces, registered with
their bytes and direction in ``autopar.core.collectives``.

Adding one: a rule here returning a ``Decision`` with ``rewrite=Rewrite(comm.kernel, args)``
(and ``closes_region=True`` if its result is replicated), and the kernel in ``comm/vocab_parallel.py`` with its
``@collective(...)`` registration. See ``docs/adding-an-op.md``.
"""

from __future__ import annotations

import torch
import torch.fx as fx

from autopar.core import comm
from autopar.core.tensor_placement import Replicate, Shard
from passes.rules.context import Ctx, arg, contiguous, is_param, ndim, norm_dims, padded, shape
from passes.rules.decision import TP, R, Decision, Operand, Rewrite, fallback, is_split
from passes.rules.registry import Placements, register_rule
from passes.rules.views import DimMap, map_dims, reduction_map

aten = torch.ops.aten

X, Y = Operand(("a", 0)), Operand(("a", 1))
"""The first two arguments of the op (logits and targets, or a table and ids)."""


@register_rule(aten.embedding.default, replicated_inputs=True)
def embedding(ctx: Ctx, node: fx.Node, pl: Placements) -> Decision:
    """A table looked up by input ids: split by rows (padded to a multiple of t)."""
    table, ids = node.args[0], node.args[1]
    if is_split(pl[ids]):
        return fallback([(("a", 1), pl[ids])], "sharded embedding indices")
    if node.name in ctx.vocab_embeddings:
        rows = shape(table)[0]
        segs = None if rows % ctx.tp == 0 else (-(-rows // ctx.tp) * ctx.tp,)
        padding_idx = arg(node, 2, "padding_idx", -1)
        args = (X, Y, TP) if padding_idx == -1 else (X, Y, TP, padding_idx)
        return Decision(R, kind="vocab_embedding", param_demand={table.name: Shard(0, segs)},
                        rewrite=Rewrite(comm.vocab_parallel_embedding, args))
    if is_param(ctx, table):
        return Decision(R, param_demand={table.name: R})
    if isinstance(pl[table], Shard):
        return fallback([(("a", 0), pl[table])], "embedding of a sharded table")
    return Decision(R)


@register_rule(aten.cross_entropy_loss.default)
def cross_entropy(ctx: Ctx, node: fx.Node, pl: Placements) -> Decision:
    """Cross-entropy of (N, V) logits split by vocabulary: against class indices (the vocabulary
    may be padded) or against class probabilities sliced like the logits (no padding)."""
    x, target = node.args[0], node.args[1]
    px, pt = pl[x], pl[target]
    if not isinstance(px, Shard):
        return Decision(R) if not isinstance(pt, Shard) else fallback([(("a", 1), pt)], "sharded targets")
    weight = arg(node, 2, "weight")
    reduction = arg(node, 3, "reduction", 1)
    ignore_index = arg(node, 4, "ignore_index", -100)
    smoothing = float(arg(node, 5, "label_smoothing", 0.0))
    plain = px.dim == 1 and ndim(x) == 2 and weight is None and contiguous(px)
    vocab = shape(x)[1]
    if target.meta["val"].is_floating_point():  # class probabilities, not indices: sliced like the logits
        if plain and not padded(x, px) and isinstance(pt, Replicate) and shape(target) == shape(x):
            kernel = Rewrite(comm.vocab_parallel_soft_cross_entropy, (X, Y, TP, vocab, reduction, smoothing))
            return Decision(R, kind="vocab_cross_entropy", scatter_in=((("a", 1), Shard(1, px.segments)),),
                            rewrite=kernel, closes_region=True)
        return fallback([(("a", 0), px)], "cross-entropy against class probabilities over a padded "
                                          "or non-contiguous split")
    if plain and not isinstance(pt, Shard):
        kernel = Rewrite(comm.vocab_parallel_cross_entropy, (X, Y, TP, vocab, ignore_index, reduction, smoothing))
        return Decision(R, kind="vocab_cross_entropy", rewrite=kernel, closes_region=True)
    return fallback([(("a", 0), px)], "cross-entropy with class weights or N-d input")


@register_rule(aten.nll_loss_nd.default, aten.nll_loss.default)
def nll_loss(ctx: Ctx, node: fx.Node, pl: Placements) -> Decision:
    """Negative log-likelihood of (N, C) log-probabilities split by class."""
    x, target = node.args[0], node.args[1]
    px = pl[x]
    reduction = arg(node, 3, "reduction", 1)
    ignore_index = arg(node, 4, "ignore_index", -100)
    if isinstance(px, Shard) and px.dim == 1 and ndim(x) == 2 and arg(node, 2, "weight") is None \
            and contiguous(px) and not is_split(pl[target]):
        kernel = Rewrite(comm.vocab_parallel_nll_loss, (X, Y, TP, reduction, ignore_index), in_place=True)
        return Decision(R, kind="vocab_nll", rewrite=kernel, closes_region=True)
    return fallback([(("a", 0), px)] if isinstance(px, Shard) else [], "nll_loss with class weights or N-d input")


@register_rule(aten.gather.default)
def gather(ctx: Ctx, node: fx.Node, pl: Placements) -> Decision:
    """torch.gather along the sharded dim with a replicated index: each rank picks what falls in
    its columns (0 elsewhere) and g sums the picks (the log-probability of a label, say)."""
    x, index = node.args[0], node.args[2]
    px, pi = pl[x], pl[index]
    dim = node.args[1] % ndim(x)
    if isinstance(px, Shard) and px.dim == dim and contiguous(px) and not is_split(pi):
        kernel = Rewrite(comm.vocab_parallel_gather, (X, TP, dim, Operand(("a", 2))), in_place=True)
        return Decision(R, kind="vocab_gather", rewrite=kernel, reduce_out=True)
    if isinstance(px, Shard) and px.dim != dim and isinstance(pi, Replicate):
        return fallback([(("a", 0), px)], "gather with a replicated index over another dim")
    if isinstance(px, Shard) and isinstance(pi, Shard) and px.dim == pi.dim != dim and px.segments == pi.segments:
        return Decision(Shard(px.dim, px.segments, px.origin), kind="sharded")
    shards = [(path, q) for path, q in ((("a", 0), px), (("a", 2), pi)) if isinstance(q, Shard)]
    return fallback(shards, "gather over the sharded dim")


@register_rule(aten.softmax.int, aten._softmax.default, aten.log_softmax.int, aten._log_softmax.default)
def softmax(ctx: Ctx, node: fx.Node, pl: Placements) -> Decision:
    """softmax / log_softmax over the split dim: this rank's columns, from the global logsumexp."""
    x = node.args[0]
    dim = node.args[1] % ndim(x)
    p = pl[x]
    log = node.target in (aten.log_softmax.int, aten._log_softmax.default)
    if isinstance(p, Shard) and p.dim == dim and contiguous(p) and not (log and padded(x, p)):
        fn = comm.vocab_parallel_log_softmax if log else comm.vocab_parallel_softmax
        kernel = Rewrite(fn, (X, TP, dim, shape(x)[dim], node.meta["val"].dtype))
        return Decision(Shard(dim, p.segments, p.origin), kind="vocab_softmax", rewrite=kernel)
    return map_dims(node, pl, DimMap(lambda d: None if d == dim else d, "softmax over the sharded dim"))


@register_rule(aten.logsumexp.default)
def logsumexp(ctx: Ctx, node: fx.Node, pl: Placements) -> Decision:
    """logsumexp over exactly the split dim: two all-reduces of the reduced shape, replicated result."""
    x = node.args[0]
    p = pl[x]
    dims = norm_dims(node.args[1] if len(node.args) > 1 else node.kwargs.get("dim"), ndim(x))
    if isinstance(p, Shard) and dims == [p.dim] and contiguous(p):
        keep = arg(node, 2, "keepdim", False)
        kernel = Rewrite(comm.vocab_parallel_logsumexp, (X, TP, p.dim, shape(x)[p.dim], keep))
        return Decision(R, kind="vocab_softmax", rewrite=kernel, closes_region=True)
    return map_dims(node, pl, reduction_map(2)(node))
