"""Tensor-parallel collectives as autograd functions, in conjugate pairs.

Megatron's two operators, for a group of t ranks:

- ``copy_to_tp``     (f)  forward identity,    backward all-reduce
- ``reduce_from_tp`` (g)  forward all-reduce,  backward identity
- ``gather_from_tp``      forward all-gather,  backward take the local slice
- ``scatter_to_tp``       forward take the local slice, backward all-gather
- ``reduce_scatter_to_sp``  g under sequence parallelism: forward reduce-scatter
                            along the token dim, backward all-gather
- ``gather_from_sp``        f under sequence parallelism: forward all-gather
                            along the token dim, backward reduce-scatter

plus the vocabulary-parallel embedding, losses and softmax family. Each
short-circuits when the group has one rank. Each is registered once with
``@collective``: its label, direction, kinds and bytes per call
(``autopar.core.collectives``, which the plan summary and the cost figures read). They take the group as an explicit argument (a
``TPGroup``), which the rewritten graphs receive as their first placeholder
``tp``: ``print(program.code(rank=1))`` shows every collective by name.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass

import weakref

import torch
import torch.distributed as dist
from torch.utils.weak import WeakIdKeyDictionary

from autopar.core.collectives import (ALL_GATHER, ALL_REDUCE, REDUCE_SCATTER, collective, fp32_per_reduced, fp32_per_row,
                                      input_bytes, output_bytes, twice)
from autopar.core.graph import local_val

__all__ = [
    "TPGroup",
    "copy_to_tp",
    "reduce_from_tp",
    "gather_from_tp",
    "scatter_to_tp",
    "reduce_scatter_to_sp",
    "gather_from_sp",
    "vocab_parallel_embedding",
    "vocab_parallel_embedding_sp",
    "vocab_parallel_cross_entropy",
    "vocab_parallel_logsumexp",
    "vocab_parallel_softmax",
    "vocab_parallel_log_softmax",
    "vocab_parallel_gather",
    "vocab_parallel_nll_loss",
    "vocab_parallel_soft_cross_entropy",
    "local_slice",
    "tp_rng_call",
    "keeping_gathered_slices",
]


@dataclass(frozen=True)
class TPGroup:
    """A tensor-parallel group: this rank's index, the size, and the process group.

    ``pg`` is None for a group of one rank (or an inspection-only program).
    """

    rank: int = 0
    size: int = 1
    pg: object | None = None
    members: tuple[int, ...] = ()
    """Global ranks of the group, in group-rank order (for pairwise exchanges)."""
    pairwise: bool = False
    """All-reduce small tensors by recursive doubling over point-to-point exchanges."""

    def __repr__(self) -> str:
        return f"TPGroup(rank={self.rank}, size={self.size})"

    @staticmethod
    def of(pg, members: tuple[int, ...]) -> "TPGroup":
        """The group of this rank in ``pg``; pairwise all-reduce on gloo with a power-of-two size."""
        if pg is None:
            return TPGroup(0, 1, None, members)
        size = dist.get_world_size(pg)
        pairwise = dist.get_backend(pg) == "gloo" and size & (size - 1) == 0
        return TPGroup(dist.get_rank(pg), size, pg, members, pairwise)


# Above this size the ring all-reduce's bandwidth wins over recursive doubling (t > 2).
PAIRWISE_MAX_BYTES = 1 << 20


def _all_reduce(x: torch.Tensor, group: TPGroup, op=dist.ReduceOp.SUM) -> torch.Tensor:
    x = x.contiguous().clone()
    if group.pg is None:  # an inspection group: shapes only, no communication
        return x
    if group.pairwise and (group.size == 2 or x.numel() * x.element_size() <= PAIRWISE_MAX_BYTES):
        return _recursive_doubling(x, group, op)
    dist.all_reduce(x, op=op, group=group.pg)
    return x


def _recursive_doubling(x: torch.Tensor, group: TPGroup, op) -> torch.Tensor:
    """All-reduce in log2(t) rounds: exchange with rank ^ 2^k and combine.

    On gloo a point-to-point exchange takes a fraction of an all_reduce's
    latency (measured on 2 CPU ranks: 0.25 ms against 1.4 ms). Every rank
    ends with the bitwise same result: each round combines the same two
    operands (a + b == b + a exactly in floating point).
    """
    buf = torch.empty_like(x)
    step = 1
    while step < group.size:
        peer = group.members[group.rank ^ step]
        ops = [dist.P2POp(dist.isend, x, peer, group=group.pg), dist.P2POp(dist.irecv, buf, peer, group=group.pg)]
        for work in dist.batch_isend_irecv(ops):
            work.wait()
        if op == dist.ReduceOp.SUM:
            x = x + buf
        elif op == dist.ReduceOp.MAX:
            x = torch.maximum(x, buf)
        else:
            raise ValueError(f"pairwise all-reduce supports SUM and MAX, not {op}")
        step *= 2
    return x


def _segments_local(size_local: int, segments: tuple[int, ...] | None, t: int) -> list[int]:
    return [size_local] if segments is None else [s // t for s in segments]


def _all_gather(x: torch.Tensor, group: TPGroup, dim: int, segments: tuple[int, ...] | None) -> torch.Tensor:
    """Concatenate every rank's piece along ``dim``, segment by segment."""
    x = x.contiguous()
    parts = [torch.empty_like(x) for _ in range(group.size)]
    if group.pg is None:  # inspection group: shapes only
        parts = [x for _ in range(group.size)]
    else:
        dist.all_gather(parts, x, group=group.pg)
    sizes = _segments_local(x.shape[dim], segments, group.size)
    pieces = [p.split(sizes, dim=dim) for p in parts]  # [rank][segment]
    return torch.cat([pieces[r][s] for s in range(len(sizes)) for r in range(group.size)], dim=dim)


def local_slice(x: torch.Tensor, rank: int, t: int, dim: int, segments: tuple[int, ...] | None = None) -> torch.Tensor:
    """Rank ``rank``'s piece of a global tensor along ``dim``: every segment's rank-th 1/t."""
    segs = list(segments) if segments is not None else [x.shape[dim]]
    if sum(segs) != x.shape[dim]:  # padded dimension: pad the global tensor with zeros first
        pad = list(x.shape)
        pad[dim] = sum(segs) - x.shape[dim]
        x = torch.cat([x, x.new_zeros(pad)], dim=dim)
    out, start = [], 0
    for s in segs:
        n = s // t
        out.append(x.narrow(dim, start + rank * n, n))
        start += s
    return out[0] if len(out) == 1 else torch.cat(out, dim=dim)


def whole_from_shards(local: torch.Tensor, group: TPGroup, dim: int, segments: tuple[int, ...] | None,
                      size: int) -> torch.Tensor:
    """The inverse of ``local_slice``: every rank's piece gathered along ``dim`` (collective over
    ``group``), padding beyond the full ``size`` dropped."""
    if group.size > 1:
        local = _all_gather(local, group, dim, segments)
    return local.narrow(dim, 0, size)


class _CopyToTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return _all_reduce(grad, ctx.group), None


class _ReduceFromTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        return _all_reduce(x, group)

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class _GatherFromTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, dim, segments):
        ctx.args = (group, dim, segments)
        return _all_gather(x, group, dim, segments)

    @staticmethod
    def backward(ctx, grad):
        group, dim, segments = ctx.args
        return local_slice(grad, group.rank, group.size, dim, segments).contiguous(), None, None, None


class _ScatterToTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, dim, segments):
        ctx.args = (group, dim, segments, x.shape[dim])
        return local_slice(x, group.rank, group.size, dim, segments).contiguous()

    @staticmethod
    def backward(ctx, grad):
        group, dim, segments, size = ctx.args
        full = _all_gather(grad, group, dim, segments)
        return full.narrow(dim, 0, size), None, None, None


@collective("f (copy_to_tp)", "bwd all-reduce", ALL_REDUCE, output_bytes)
def copy_to_tp(x: torch.Tensor, tp: TPGroup) -> torch.Tensor:
    """f: identity forward; all-reduce of the gradient backward."""
    if tp.size == 1 or not x.requires_grad:
        return x
    return _CopyToTP.apply(x, tp)


@collective("g (reduce_from_tp)", "fwd all-reduce", ALL_REDUCE, output_bytes)
def reduce_from_tp(x: torch.Tensor, tp: TPGroup) -> torch.Tensor:
    """g: all-reduce (sum of partial results) forward; identity backward."""
    if tp.size == 1:
        return x
    return _ReduceFromTP.apply(x, tp)


@collective("gather_from_tp", "fwd all-gather (fallback)", ALL_GATHER, output_bytes)
def gather_from_tp(x: torch.Tensor, tp: TPGroup, dim: int, segments: tuple[int, ...] | None = None,
                   size: int | None = None) -> torch.Tensor:
    """All-gather a sharded tensor to its full (unpadded ``size``) form; backward keeps the local slice."""
    if tp.size == 1:
        full = x
    else:
        full = _GatherFromTP.apply(x, tp, dim, segments)
    if size is not None and full.shape[dim] != size:
        full = full.narrow(dim, 0, size)
    return full


@collective("scatter_to_tp", "bwd all-gather", ALL_GATHER, output_bytes)
def scatter_to_tp(x: torch.Tensor, tp: TPGroup, dim: int, segments: tuple[int, ...] | None = None) -> torch.Tensor:
    """Keep this rank's slice of a replicated tensor; backward all-gathers the gradient."""
    if tp.size == 1:
        return x
    return _ScatterToTP.apply(x, tp, dim, segments)


def _rank_major(front: torch.Tensor, t: int, segments: tuple[int, ...] | None) -> torch.Tensor:
    """``front`` (the split dim first) reordered so that rank r's pieces (its 1/t of every
    segment, in order) form the r-th contiguous block of dim 0."""
    if segments is None:
        return front
    pieces = [seg.reshape(t, seg.shape[0] // t, *seg.shape[1:]) for seg in front.split(list(segments))]
    return torch.cat(pieces, dim=1).reshape(front.shape)


def _segment_major(blocks: torch.Tensor, t: int, segments: tuple[int, ...] | None) -> torch.Tensor:
    """The inverse of ``_rank_major``: rank blocks along dim 0 back to the global order."""
    if segments is None:
        return blocks
    by_rank = blocks.reshape(t, blocks.shape[0] // t, *blocks.shape[1:])
    parts = by_rank.split([s // t for s in segments], dim=1)
    return torch.cat([p.reshape(p.shape[0] * p.shape[1], *p.shape[2:]) for p in parts], dim=0)


def _reduce_scatter_dim(x: torch.Tensor, group: TPGroup, dim: int,
                        segments: tuple[int, ...] | None = None) -> torch.Tensor:
    """Sum over the ranks; this rank keeps its 1/t along ``dim``: one block, or with ``segments``
    its 1/t of each segment (each of several sequences flattened into one token dim).

    One ``reduce_scatter_single`` over the dim moved to the front (NCCL and gloo in torch 2.13
    both have it); an inspection group (no process group) only takes the slice, for shapes."""
    t = group.size
    if any(s % t for s in (segments or (x.shape[dim],))):
        raise ValueError(f"reduce-scatter along dim {dim} of size {x.shape[dim]} (segments {segments}) needs "
                         f"multiples of tp={t}")
    if group.pg is None:
        return local_slice(x, group.rank, t, dim, segments).contiguous()
    front = _rank_major(x.movedim(dim, 0), t, segments).contiguous()
    out = torch.empty((front.shape[0] // t, *front.shape[1:]), dtype=x.dtype, device=x.device)
    dist.reduce_scatter_single(out, front, group=group.pg)
    return out.movedim(0, dim).contiguous()


def _all_gather_dim(x: torch.Tensor, group: TPGroup, dim: int,
                    segments: tuple[int, ...] | None = None) -> torch.Tensor:
    """Every rank's slice put back along ``dim`` (rank order, segment by segment): one
    ``all_gather_single`` over the dim moved to the front; an inspection group repeats this
    rank's slice, for shapes."""
    front = x.movedim(dim, 0).contiguous()
    if group.pg is None:
        out = torch.cat([front] * group.size, dim=0)
    else:
        out = torch.empty((front.shape[0] * group.size, *front.shape[1:]), dtype=x.dtype, device=x.device)
        dist.all_gather_single(out, front, group=group.pg)
    return _segment_major(out, group.size, segments).movedim(0, dim).contiguous()


class _ReduceScatterToSP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, dim, segments):
        ctx.args = (group, dim, segments)
        return _reduce_scatter_dim(x, group, dim, segments)

    @staticmethod
    def backward(ctx, grad):
        return _all_gather_dim(grad, *ctx.args), None, None, None


class _GatherFromSP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, dim, segments):
        ctx.args = (group, dim, segments)
        return _all_gather_dim(x, group, dim, segments)

    @staticmethod
    def backward(ctx, grad):
        return _reduce_scatter_dim(grad, *ctx.args), None, None, None


@collective("g (reduce_scatter_to_sp)", "fwd reduce-scatter; bwd all-gather", (REDUCE_SCATTER, ALL_GATHER),
            twice(input_bytes), forward_nbytes=input_bytes)
def reduce_scatter_to_sp(x: torch.Tensor, tp: TPGroup, dim: int, segments: tuple[int, ...] | None = None
                         ) -> torch.Tensor:
    """g of sequence parallelism: the partial sums reduce-scattered along the token dim ``dim``, each
    rank keeping its 1/t of the tokens; backward all-gathers the gradient. A ring all-reduce is
    exactly a reduce-scatter then an all-gather: the same bytes, split across g and the next f.
    ``segments``: the token dim holds several sequences (flattened (B*T, C)); each rank keeps its
    1/t of every one, so viewing the tokens back as (B, T, C) keeps a split of T."""
    if tp.size == 1:
        return x
    return _ReduceScatterToSP.apply(x, tp, dim, segments)


def _gathered_thrice(node) -> int:
    return 3 * output_bytes(node)


@collective("f (gather_from_sp)", "fwd all-gather; bwd reduce-scatter, all-gather of the kept slice",
            (ALL_GATHER, REDUCE_SCATTER, ALL_GATHER), _gathered_thrice, forward_nbytes=output_bytes)
def gather_from_sp(x: torch.Tensor, tp: TPGroup, dim: int, segments: tuple[int, ...] | None = None
                   ) -> torch.Tensor:
    """f of sequence parallelism: the tokens split along ``dim`` all-gathered before a column-parallel
    region; backward reduce-scatters the region's partial gradients (the sum f's all-reduce made).

    Inside ``keeping_gathered_slices`` (the engine runs every chunk so) the ops reading the gathered
    value save this rank's slice ``x`` instead, and the backward all-gathers it again once for them
    all: 1/t of the bytes kept, one more all-gather of the value moved (counted in its bytes)."""
    if tp.size == 1:
        return x
    full = _GatherFromSP.apply(x, tp, dim, segments)
    if torch.is_grad_enabled() and x.requires_grad:
        _GATHERED[_root(full)] = (x.detach(), _Regather(tp, dim, segments))
    return full


# ------------------------------------------------------------------ kept slices of gathered values


class _Regather:
    """One all-gathered value whose consumers kept this rank's slice: gathered again at most once in
    the backward, however many consumers (a layer's q, k and v projections) read it."""

    __slots__ = ("tp", "dim", "segments", "full", "__weakref__")

    def __init__(self, tp: TPGroup, dim: int, segments: tuple[int, ...] | None) -> None:
        self.tp, self.dim, self.segments = tp, dim, segments
        self.full: torch.Tensor | None = None
        _REGATHERS.add(self)

    def whole(self, local: torch.Tensor) -> torch.Tensor:
        if self.full is None:
            self.full = _all_gather_dim(local, self.tp, self.dim, self.segments)
        return self.full


class _KeptSlice:
    """What a consumer saves instead of (a view of) a gathered value: the outer hooks' packing of
    this rank's slice, the shared re-gather, and the view's size, strides and offset."""

    __slots__ = ("packed", "regather", "geometry")

    def __init__(self, packed, regather: _Regather, geometry: tuple) -> None:
        self.packed, self.regather, self.geometry = packed, regather, geometry


_GATHERED: WeakIdKeyDictionary = WeakIdKeyDictionary()
_REGATHERS: weakref.WeakSet = weakref.WeakSet()
"""Every live ``_Regather``: ``release_regathered`` drops their whole values."""


def release_regathered() -> None:
    """Drop the whole values re-gathered so far: a split backward calls it after B, whose autograd
    nodes unpack every saved tensor (the linears' inputs too, re-gathering them) although only the
    input gradients are wanted; W then gathers again what its weight gradients read, so between B
    and W a microbatch keeps only the 1/t slices, as between F and B."""
    for regather in list(_REGATHERS):
        regather.full = None
"""Memory of a value ``gather_from_sp`` made (its root tensor, while alive) -> (this rank's slice,
its re-gather)."""


def _identity(t):
    return t


def _root(t: torch.Tensor) -> torch.Tensor:
    """The tensor owning ``t``'s memory: ``t`` itself, or the base it is a view of (the gathered
    value may itself be a view of the buffer the all-gather filled)."""
    return t if t._base is None else t._base


@contextlib.contextmanager
def keeping_gathered_slices() -> Iterator[None]:
    """Inside this block, an op that saves for its backward a value ``gather_from_sp`` made (or a
    view of it: the column-parallel linears after sequence parallelism's all-gather) saves this
    rank's 1/t slice instead, and the backward all-gathers it again when it reads it, as Megatron
    does: the whole-sequence input is not kept from the forward to the backward on every rank.

    The hooks compose with those already set (the engine's byte count, a saved-tensor store of a
    split backward): the slice goes through them, so they see and count 1/t of the bytes, and every
    other saved tensor passes through them unchanged. A checkpointed region sets its own hooks and
    keeps only its inputs, so this block does not reach inside it. The re-gather is a collective:
    every rank of the group unpacks in the same order (the same autograd graph on each)."""
    if not torch._C._autograd._saved_tensors_hooks_is_enabled():
        yield
        return
    # private: the pair of hooks set now, to compose with (torch has no public accessor)
    outer = torch._C._autograd._top_saved_tensors_default_hooks(False)
    outer_pack, outer_unpack = outer if outer is not None else (_identity, _identity)

    def pack(t: torch.Tensor):
        source = _GATHERED.get(_root(t))
        if source is None:
            return outer_pack(t)
        local, regather = source
        return _KeptSlice(outer_pack(local), regather, (t.size(), t.stride(), t.storage_offset()))

    def unpack(packed) -> torch.Tensor:
        if isinstance(packed, _KeptSlice):
            return packed.regather.whole(outer_unpack(packed.packed)).as_strided(*packed.geometry)
        return outer_unpack(packed)

    with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
        yield


def _vocab_lookup(weight_local: torch.Tensor, ids: torch.Tensor, tp: TPGroup, padding_idx: int) -> torch.Tensor:
    """This rank's part of the embedding: the rows it holds looked up, zeros for every other id."""
    rows = weight_local.shape[0]
    start = tp.rank * rows
    outside = (ids < start) | (ids >= start + rows)
    local_ids = (ids - start).masked_fill(outside, 0)
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
            zmax = _all_reduce(zmax, group, dist.ReduceOp.MAX)
        z = z - zmax.unsqueeze(-1)
        valid = target != ignore_index
        outside = (target < start) | (target >= start + n_local) | ~valid
        local_t = (target - start).masked_fill(outside, 0)
        z_target = z.gather(-1, local_t.unsqueeze(-1)).squeeze(-1).masked_fill(outside, 0.0)
        exp = z.exp()
        sum_exp = exp.sum(dim=-1)
        parts = [z_target, sum_exp]
        if smoothing:
            parts.append((z if real is None else z.masked_fill(~real, 0.0)).sum(dim=-1))
        if t > 1:
            parts = list(_all_reduce(torch.stack(parts), group).unbind(0))
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
            m = _all_reduce(m, tp, dist.ReduceOp.MAX)
        m = m.masked_fill(torch.isneginf(m), 0.0)  # an all -inf row: exp gives 0, the result -inf
        e = (z - m).exp()
        s = e.sum(dim=dim, keepdim=True)
        if tp.size > 1:
            s = _all_reduce(s, tp)
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
    start = tp.rank * n_local
    inside = (index >= start) & (index < start + n_local)
    local = (index - start).masked_fill(~inside, 0)
    return x.gather(dim, local).masked_fill(~inside, 0)


class _VocabParallelNLL(torch.autograd.Function):
    """``F.nll_loss(logp, target)`` with the class dim of logp (N, C) split across the tp ranks:
    each rank picks the targets in its columns, one all-reduce of (N,) sums them."""

    @staticmethod
    def forward(ctx, logp, target, tp, reduction, ignore_index):
        n_local = logp.shape[1]
        start = tp.rank * n_local
        valid = target != ignore_index
        inside = (target >= start) & (target < start + n_local) & valid
        local = (target - start).masked_fill(~inside, 0)
        picked = logp.float().gather(1, local.unsqueeze(1)).squeeze(1).masked_fill(~inside, 0.0)
        if tp.size > 1:
            picked = _all_reduce(picked, tp)
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
            zmax = _all_reduce(zmax, tp, dist.ReduceOp.MAX)
        z = z - zmax.unsqueeze(-1)
        exp = z.exp()
        parts = torch.stack([exp.sum(-1), (p * z).sum(-1), p.sum(-1)])
        if tp.size > 1:
            parts = _all_reduce(parts, tp)
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


def seed_forked(seed: int, devices: list[int]) -> None:
    """Seed the CPU generator and those of ``devices`` only: inside ``fork_rng(devices)`` those
    are the ones restored afterwards (``torch.manual_seed`` would reseed every GPU's)."""
    torch.random.default_generator.manual_seed(seed)
    for d in devices:
        torch.cuda.default_generators[d].manual_seed(seed)


def tp_rng_call(op, tp: TPGroup, *args, **kwargs):
    """Run a random op on a tensor-parallel shard with this rank's own random stream.

    Dropout on a sharded value (attention probabilities split by heads) must
    draw different masks on each tp rank, while everything replicated must
    draw the same. One seed is drawn from the shared default generator (so it
    advances identically on every rank, and a checkpoint's recomputation,
    which restores that generator, draws it again); the op then runs under a
    forked generator seeded with it and the tp rank.
    """
    if tp.size == 1 or torch._guards.detect_fake_mode(args) is not None:  # fake tensors: shapes only
        return op(*args, **kwargs)
    seed = int(torch.randint(0, 2**62, (), dtype=torch.int64))
    devices = [torch.cuda.current_device()] if torch.cuda.is_available() and torch.cuda.is_initialized() else []
    with torch.random.fork_rng(devices=devices):
        seed_forked(seed + 7919 * tp.rank, devices)
        return op(*args, **kwargs)
