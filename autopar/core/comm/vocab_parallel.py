"""The vocabulary-parallel embedding, losses and softmax family: values split by vocabulary.

The embedding table is split by rows and the logits by columns across the tp
ranks, and nothing here gathers the whole vocabulary: each rank looks up or
reduces its own part, and small all-reduces of per-row statistics (a max, a
sum of exponentials, a target logit) combine them. Columns at or beyond the
real vocabulary size (padding up to a multiple of t) are ignored. Each
communicating function is registered as a collective where it is defined.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from autopar.core.collectives import (ALL_GATHER, ALL_REDUCE, REDUCE_SCATTER, collective, fp32_per_reduced,
                                      fp32_per_row, output_bytes, twice)
from autopar.core.comm.group import TPGroup, all_reduce
from autopar.core.comm.sp_mappings import reduce_scatter_to_sp
from autopar.core.comm.tp_mappings import copy_to_tp, reduce_from_tp
from autopar.core.graph import local_val

__all__ = [
    "vocab_parallel_embedding",
    "vocab_parallel_embedding_sp",
    "vocab_parallel_cross_entropy",
    "vocab_parallel_logsumexp",
    "vocab_parallel_softmax",
    "vocab_parallel_log_softmax",
    "vocab_parallel_gather",
    "vocab_parallel_nll_loss",
    "vocab_parallel_soft_cross_entropy",
]


def _vocab_lookup(weight_local: torch.Tensor, ids: torch.Tensor, tp: TPGroup, padding_idx: int) -> torch.Tensor:
    """This rank's part of the embedding: the rows it holds looked up, zeros for every other id."""
    rows = weight_local.shape[0]
    start, first = tp.rank * rows, tp.first_index(rows)
    outside = (ids < first) | (ids >= first + rows)
    local_ids = (ids - first).masked_fill(outside, 0)
    local_pad = padding_idx - start if start <= padding_idx < start + rows else -1
    out = torch.ops.aten.embedding(weight_local, local_ids, local_pad)
    return out.masked_fill(outside.unsqueeze(-1), 0.0)


@collective("vocab_parallel_embedding", "fwd all-reduce", ALL_REDUCE, output_bytes)
def vocab_parallel_embedding(weight_local: torch.Tensor, ids: torch.Tensor, tp: TPGroup,
                             padding_idx: int = -1) -> torch.Tensor:
    """Embedding with the vocabulary split by rows.

    Rank i holds rows [i*V/t, (i+1)*V/t). Ids outside that range are looked up
    as row 0 and zeroed, then g all-reduces: every id finds its row on exactly
    one rank. The backward is autograd's: only local rows get gradient (and the
    padding row, on the rank that holds it, none).
    """
    if tp.size == 1:
        return torch.ops.aten.embedding(weight_local, ids, padding_idx)
    return reduce_from_tp(_vocab_lookup(weight_local, ids, tp, padding_idx), tp)


def _embedded_bytes(node) -> int:
    """The bytes of the whole embedding of a node's ids (its second argument): what it reduces."""
    ids, out = local_val(node.args[1]), local_val(node)
    return ids.numel() * out.shape[-1] * out.element_size()


@collective("vocab_parallel_embedding_sp", "fwd reduce-scatter; bwd all-gather", (REDUCE_SCATTER, ALL_GATHER),
            twice(_embedded_bytes), forward_nbytes=_embedded_bytes)
def vocab_parallel_embedding_sp(weight_local: torch.Tensor, ids: torch.Tensor, tp: TPGroup, dim: int,
                                segments: tuple[int, ...] | None = None, padding_idx: int = -1) -> torch.Tensor:
    """The vocabulary-parallel embedding feeding sequence-parallel ops: its partial lookups are
    reduce-scattered along the token dim ``dim`` instead of all-reduced, each rank keeping the
    embeddings of its 1/t of the tokens (backward: the gradient all-gathered along it)."""
    if tp.size == 1:
        return torch.ops.aten.embedding(weight_local, ids, padding_idx)
    return reduce_scatter_to_sp(_vocab_lookup(weight_local, ids, tp, padding_idx), tp, dim, segments)


class _VocabParallelCrossEntropy(torch.autograd.Function):
    """Cross-entropy over logits split by vocabulary, never gathering them.

    loss_n = log(sum_j exp(z_nj)) - z_n,y_n, computed with three all-reduces of
    (N,)-sized tensors: the max of the logits, the target logit (found on one
    rank), and the sum of exponentials. Columns at or beyond ``vocab_size``
    (padding) are -inf: they never win the softmax and get zero gradient.

    With label smoothing e (as ``F.cross_entropy(label_smoothing=e)``) the
    target is (1 - e) one-hot + e/V uniform over the V real classes:
    loss_n = (1 - e)(lse_n - z_n,y_n) + e (lse_n - mean_j z_nj); the sum of the
    logits rides in the same all-reduce as the target logit and the sum of
    exponentials. Gradient: softmax - (1 - e) one-hot - e/V.
    """

    @staticmethod
    def forward(ctx, logits, target, group, vocab_size, ignore_index, reduction, smoothing=0.0):
        t, rank = group.size, group.rank
        n_local = logits.shape[-1]
        start = rank * n_local
        z = logits.float()
        real = None
        if start + n_local > vocab_size:  # padded columns on this rank
            col = torch.arange(start, start + n_local, device=z.device)
            real = col < vocab_size
            z = z.masked_fill(~real, float("-inf"))
        zmax = z.max(dim=-1).values
        if t > 1:
            zmax = all_reduce(zmax, group, dist.ReduceOp.MAX)
        z = z - zmax.unsqueeze(-1)
        valid = target != ignore_index
        first = group.first_index(n_local)
        outside = (target < first) | (target >= first + n_local) | ~valid
        local_t = (target - first).masked_fill(outside, 0)
        z_target = z.gather(-1, local_t.unsqueeze(-1)).squeeze(-1).masked_fill(outside, 0.0)
        exp = z.exp()
        sum_exp = exp.sum(dim=-1)
        parts = [z_target, sum_exp]
        if smoothing:
            parts.append((z if real is None else z.masked_fill(~real, 0.0)).sum(dim=-1))
        if t > 1:
            parts = list(all_reduce(torch.stack(parts), group).unbind(0))
        z_target, sum_exp = parts[0], parts[1]
        lse = sum_exp.log()
        loss = lse - z_target
        if smoothing:
            loss = (1.0 - smoothing) * loss + smoothing * (lse - parts[2] / vocab_size)
        loss = loss.masked_fill(~valid, 0.0)  # (N,)
        count = valid.sum()
        softmax = exp / sum_exp.unsqueeze(-1)
        ctx.save_for_backward(softmax, local_t, outside, valid, count)
        ctx.smoothing = smoothing
        ctx.uniform = None if not smoothing else (
            torch.full((n_local,), smoothing / vocab_size, device=z.device) if real is None
            else real.float() * (smoothing / vocab_size))
        ctx.reduction = reduction
        ctx.dtype = logits.dtype
        if reduction == 1:  # mean over non-ignored targets
            return loss.sum() / count
        if reduction == 2:
            return loss.sum()
        return loss

    @staticmethod
    def backward(ctx, grad_out):
        softmax, local_t, outside, valid, count = ctx.saved_tensors
        grad = softmax.clone()
        hit = (~outside).float() * (1.0 - ctx.smoothing)
        grad.scatter_add_(-1, local_t.unsqueeze(-1), -hit.unsqueeze(-1))
        if ctx.smoothing:
            grad = grad - ctx.uniform
        grad = grad * valid.unsqueeze(-1)
        if ctx.reduction == 1:
            grad = grad * (grad_out / count)
        elif ctx.reduction == 2:
            grad = grad * grad_out
        else:
            grad = grad * grad_out.unsqueeze(-1)
        return grad.to(ctx.dtype), None, None, None, None, None, None


@collective("vocab_parallel_cross_entropy", "fwd all-reduces: max, then (target logit, sum exp)", ALL_REDUCE,
            fp32_per_row(3))
def vocab_parallel_cross_entropy(
    logits_local: torch.Tensor,
    target: torch.Tensor,
    tp: TPGroup,
    vocab_size: int,
    ignore_index: int = -100,
    reduction: int = 1,
    label_smoothing: float = 0.0,
) -> torch.Tensor:
    """Cross-entropy of (N, V/t) local logits against (N,) targets; reduction 0 none, 1 mean, 2 sum;
    ``label_smoothing`` as in ``F.cross_entropy``."""
    return _VocabParallelCrossEntropy.apply(logits_local, target, tp, vocab_size, ignore_index, reduction,
                                            label_smoothing)


def _pad_mask(x: torch.Tensor, tp: TPGroup, dim: int, size: int) -> torch.Tensor | None:
    """True on this rank's columns of ``dim`` at or beyond the real ``size`` (vocabulary padding)."""
    n_local = x.shape[dim]
    start = tp.rank * n_local
    if start + n_local <= size:
        return None
    col = torch.arange(start, start + n_local, device=x.device) >= size
    shape = [1] * x.dim()
    shape[dim] = n_local
    return col.view(shape)


class _VocabParallelLogSumExp(torch.autograd.Function):
    """log(sum_j exp(x_j)) over a dim split across the tp ranks, with two all-reduces of the
    reduced shape (the max, then the sum of exponentials). The result is replicated; its
    gradient (identical on every rank: replicated consumers, or f before sharded ones) times
    this rank's softmax is the gradient of the local columns."""

    @staticmethod
    def forward(ctx, x, tp, dim, size, keepdim):
        z = x.float()
        pad = _pad_mask(z, tp, dim, size)
        if pad is not None:
            z = z.masked_fill(pad, float("-inf"))
        m = z.amax(dim=dim, keepdim=True)
        if tp.size > 1:
            m = all_reduce(m, tp, dist.ReduceOp.MAX)
        m = m.masked_fill(torch.isneginf(m), 0.0)  # an all -inf row: exp gives 0, the result -inf
        e = (z - m).exp()
        s = e.sum(dim=dim, keepdim=True)
        if tp.size > 1:
            s = all_reduce(s, tp)
        lse = s.log() + m
        ctx.save_for_backward(e / s)
        ctx.dim, ctx.keepdim, ctx.dtype = dim, keepdim, x.dtype
        out = lse if keepdim else lse.squeeze(dim)
        return out.to(x.dtype)

    @staticmethod
    def backward(ctx, grad):
        (softmax,) = ctx.saved_tensors
        g = grad if ctx.keepdim else grad.unsqueeze(ctx.dim)
        return (softmax * g.float()).to(ctx.dtype), None, None, None, None


@collective("vocab_parallel_logsumexp", "fwd all-reduces: max, then sum exp", ALL_REDUCE, fp32_per_reduced(2))
def vocab_parallel_logsumexp(x: torch.Tensor, tp: TPGroup, dim: int, size: int, keepdim: bool = False):
    """``torch.logsumexp(x, dim)`` of a value split along ``dim`` (real size ``size``; padding ignored)."""
    return _VocabParallelLogSumExp.apply(x, tp, dim % x.dim(), size, keepdim)


@collective("vocab_parallel_softmax", "fwd all-reduces: max, sum exp; bwd all-reduce", ALL_REDUCE,
            fp32_per_reduced(3), forward_nbytes=fp32_per_reduced(2))
def vocab_parallel_softmax(x: torch.Tensor, tp: TPGroup, dim: int, size: int,
                           dtype: torch.dtype | None = None) -> torch.Tensor:
    """``softmax(x, dim)`` of a value split along ``dim``: this rank's columns; padding gets 0."""
    dim %= x.dim()
    lse = copy_to_tp(vocab_parallel_logsumexp(x, tp, dim, size, keepdim=True), tp)
    z = x.float() - lse.float()
    pad = _pad_mask(z, tp, dim, size)
    if pad is not None:
        z = z.masked_fill(pad, float("-inf"))
    return z.exp().to(dtype or x.dtype)


@collective("vocab_parallel_log_softmax", "fwd all-reduces: max, sum exp; bwd all-reduce", ALL_REDUCE,
            fp32_per_reduced(3), forward_nbytes=fp32_per_reduced(2))
def vocab_parallel_log_softmax(x: torch.Tensor, tp: TPGroup, dim: int, size: int,
                               dtype: torch.dtype | None = None) -> torch.Tensor:
    """``log_softmax(x, dim)`` of a value split along ``dim`` (no padding: the rule asks for it)."""
    dim %= x.dim()
    lse = copy_to_tp(vocab_parallel_logsumexp(x, tp, dim, size, keepdim=True), tp)
    return (x.float() - lse.float()).to(dtype or x.dtype)


def vocab_parallel_gather(x: torch.Tensor, tp: TPGroup, dim: int, index: torch.Tensor) -> torch.Tensor:
    """This rank's part of ``torch.gather(x_full, dim, index)`` for x split along ``dim``: the
    entries whose index falls in this rank's columns, 0 elsewhere. Summed over the tp ranks
    (g after it) they are the full gather; the gradient reaches only the gathered columns."""
    dim %= x.dim()
    n_local = x.shape[dim]
    first = tp.first_index(n_local)
    inside = (index >= first) & (index < first + n_local)
    local = (index - first).masked_fill(~inside, 0)
    return x.gather(dim, local).masked_fill(~inside, 0)


class _VocabParallelNLL(torch.autograd.Function):
    """``F.nll_loss(logp, target)`` with the class dim of logp (N, C) split across the tp ranks:
    each rank picks the targets in its columns, one all-reduce of (N,) sums them."""

    @staticmethod
    def forward(ctx, logp, target, tp, reduction, ignore_index):
        n_local = logp.shape[1]
        first = tp.first_index(n_local)
        valid = target != ignore_index
        inside = (target >= first) & (target < first + n_local) & valid
        local = (target - first).masked_fill(~inside, 0)
        picked = logp.float().gather(1, local.unsqueeze(1)).squeeze(1).masked_fill(~inside, 0.0)
        if tp.size > 1:
            picked = all_reduce(picked, tp)
        loss = -picked
        count = valid.sum()
        ctx.save_for_backward(local, inside, count)
        ctx.reduction, ctx.shape, ctx.dtype = reduction, logp.shape, logp.dtype
        if reduction == 1:
            return (loss.sum() / count).to(logp.dtype)
        if reduction == 2:
            return loss.sum().to(logp.dtype)
        return loss.to(logp.dtype)

    @staticmethod
    def backward(ctx, grad):
        local, inside, count = ctx.saved_tensors
        g = grad.float()
        if ctx.reduction == 1:
            g = (g / count).expand(local.shape)
        elif ctx.reduction == 2:
            g = g.expand(local.shape)
        out = torch.zeros(ctx.shape, dtype=torch.float32, device=local.device)
        out.scatter_(1, local.unsqueeze(1), (-g * inside).unsqueeze(1))
        return out.to(ctx.dtype), None, None, None, None


@collective("vocab_parallel_nll_loss", "fwd all-reduce of the picked log-probabilities", ALL_REDUCE,
            fp32_per_row(1))
def vocab_parallel_nll_loss(logp: torch.Tensor, target: torch.Tensor, tp: TPGroup, reduction: int = 1,
                            ignore_index: int = -100) -> torch.Tensor:
    """Negative log-likelihood of (N, C/t) local log-probabilities; reduction 0 none, 1 mean, 2 sum."""
    return _VocabParallelNLL.apply(logp, target, tp, reduction, ignore_index)


class _VocabParallelSoftCrossEntropy(torch.autograd.Function):
    """Cross-entropy against class probabilities p (N, C), both split by class across the tp
    ranks (no padding): loss_n = lse_n * sum_j p_nj - sum_j p_nj z_nj, with the max, then
    (sum of exponentials, sum_j p z, sum_j p) all-reduced. With label smoothing e the target
    is (1 - e) p + e / C, as in ``F.cross_entropy``. Gradients: softmax * sum p - p for the
    logits, lse - z = -log_softmax for the probabilities."""

    @staticmethod
    def forward(ctx, logits, probs, tp, n_classes, reduction, smoothing):
        z = logits.float()
        p = probs.float()
        if smoothing:
            p = (1.0 - smoothing) * p + smoothing / n_classes
        zmax = z.max(dim=-1).values
        if tp.size > 1:
            zmax = all_reduce(zmax, tp, dist.ReduceOp.MAX)
        z = z - zmax.unsqueeze(-1)
        exp = z.exp()
        parts = torch.stack([exp.sum(-1), (p * z).sum(-1), p.sum(-1)])
        if tp.size > 1:
            parts = all_reduce(parts, tp)
        sum_exp, pz, psum = parts.unbind(0)
        lse = sum_exp.log()
        loss = lse * psum - pz
        ctx.save_for_backward(exp / sum_exp.unsqueeze(-1), p, psum, lse.unsqueeze(-1) - z)
        ctx.reduction, ctx.smoothing, ctx.dtypes, ctx.n = reduction, smoothing, (logits.dtype, probs.dtype), z.shape[0]
        if reduction == 1:
            return (loss.sum() / ctx.n).to(logits.dtype)
        if reduction == 2:
            return loss.sum().to(logits.dtype)
        return loss.to(logits.dtype)

    @staticmethod
    def backward(ctx, grad):
        softmax, p, psum, neg_logp = ctx.saved_tensors
        g = grad.float()
        g = (g / ctx.n).expand(p.shape[0]) if ctx.reduction == 1 else (g.expand(p.shape[0]) if ctx.reduction == 2
                                                                             else g)
        g = g.unsqueeze(-1)
        grad_z = (softmax * psum.unsqueeze(-1) - p) * g
        grad_p = None
        if ctx.needs_input_grad[1]:
            grad_p = (neg_logp * g * (1.0 - ctx.smoothing)).to(ctx.dtypes[1])
        return grad_z.to(ctx.dtypes[0]), grad_p, None, None, None, None


@collective("vocab_parallel_soft_cross_entropy", "fwd all-reduces: max, then (sum exp, sum p z, sum p)",
            ALL_REDUCE, fp32_per_row(4))
def vocab_parallel_soft_cross_entropy(logits_local: torch.Tensor, probs_local: torch.Tensor, tp: TPGroup,
                                      n_classes: int, reduction: int = 1,
                                      label_smoothing: float = 0.0) -> torch.Tensor:
    """``F.cross_entropy(logits, probs)`` with (N, C/t) local logits and class probabilities."""
    return _VocabParallelSoftCrossEntropy.apply(logits_local, probs_local, tp, n_classes, reduction,
                                                label_smoothing)
