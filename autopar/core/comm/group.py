"""The tensor-parallel group and the collectives every mapping is built from.

``TPGroup`` names this rank's place in its group (and the process group, None for
one rank or an inspection-only program); ``all_reduce``, ``all_gather``,
``reduce_scatter_dim`` and ``all_gather_dim`` move tensors across it, and
``local_slice``/``whole_from_shards`` cut a global tensor into this rank's piece
and put the pieces back. An inspection group (no process group) only computes
shapes: its collectives return the right sizes without communicating.

Traced by torch.compile (dynamo), the collectives are PyTorch's
functional collectives (``torch.distributed._functional_collectives``), which
trace into the graph: a chunk with tensor- and sequence-parallel collectives
in every layer compiles as one graph, forward and backward, with no break.
Run eagerly they keep their own path (pairwise exchanges for small all-reduces
on gloo, in-place ``*_single`` collectives).
"""

from __future__ import annotations

from collections.abc import Callable, Hashable
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol

from autopar.core.collectives import CollectiveError

__all__ = ["TPGroup", "conjugate_pair", "PAIRWISE_MAX_BYTES", "all_reduce", "all_gather", "reduce_scatter_dim",
           "all_gather_dim", "local_slice", "whole_from_shards", "wholes_from_shards", "in_buckets"]


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
    rank_tensor: torch.Tensor | None = field(default=None, compare=False)
    """``rank`` as a 0-d tensor on the engine's device, set for compiled chunks (``first_index``)."""
    ep: "TPGroup | None" = field(default=None, compare=False)
    """This rank's expert-parallel group (the data-parallel replicas holding different experts), for the
    expert dispatch (``comm.expert_dispatch``); None without expert parallelism or when inspecting."""
    cp: "TPGroup | None" = field(default=None, compare=False)
    """This rank's context-parallel group (the ranks holding the other token blocks of its sequences,
    in ring order), for ring attention (``comm.ring_attention``); None without context parallelism or
    when inspecting."""

    def own_slice(self, x: torch.Tensor, dim: int, segments: tuple[int, ...] | None = None) -> torch.Tensor:
        """This rank's piece of ``x`` along ``dim`` (``local_slice``), contiguous; the same captured
        graph on every rank under ``torch.compile`` (``first_index``)."""
        return local_slice(x, self.rank, self.size, dim, segments, self.rank_tensor).contiguous()

    def first_index(self, n: int):
        """This rank's first index along a dim split into parts of ``n``: ``rank * n``. Inside
        ``torch.compile`` (with ``rank_tensor`` set) it is computed from that tensor, an input of the
        captured graph rather than a constant baked into it, so the tp ranks of a stage capture the
        same graph: compiled once, the others load it from Inductor's cache."""
        if self.rank_tensor is not None and torch.compiler.is_compiling():
            return self.rank_tensor * n
        return self.rank * n

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


_FUNCOL_OP = {dist.ReduceOp.SUM: "sum", dist.ReduceOp.MAX: "max"}
"""The reductions a traced all-reduce names as a functional collective's ``reduceOp``."""

# Above this size the ring all-reduce's bandwidth wins over recursive doubling (t > 2).
PAIRWISE_MAX_BYTES = 1 << 20


def all_reduce(x: torch.Tensor, group: TPGroup, op=dist.ReduceOp.SUM) -> torch.Tensor:
    """``x`` reduced (summed, or ``op``) over the group, in a new tensor; small tensors on a pairwise
    group by recursive doubling."""
    if group.pg is not None and torch.compiler.is_compiling():  # traced into the graph: a functional collective
        return funcol.all_reduce(x.contiguous(), _FUNCOL_OP[op], group.pg)
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
            raise CollectiveError(f"pairwise all-reduce supports SUM and MAX, not {op}")
        step *= 2
    return x


def _segments_local(size_local: int, segments: tuple[int, ...] | None, t: int) -> list[int]:
    return [size_local] if segments is None else [s // t for s in segments]


def all_gather(x: torch.Tensor, group: TPGroup, dim: int, segments: tuple[int, ...] | None) -> torch.Tensor:
    """Concatenate every rank's piece along ``dim``, segment by segment."""
    if group.pg is not None and torch.compiler.is_compiling():  # the same result, as a traceable collective
        return all_gather_dim(x, group, dim, segments)
    x = x.contiguous()
    parts = [torch.empty_like(x) for _ in range(group.size)]
    if group.pg is None:  # inspection group: shapes only
        parts = [x for _ in range(group.size)]
    else:
        dist.all_gather(parts, x, group=group.pg)
    sizes = _segments_local(x.shape[dim], segments, group.size)
    pieces = [p.split(sizes, dim=dim) for p in parts]  # [rank][segment]
    return torch.cat([pieces[r][s] for s in range(len(sizes)) for r in range(group.size)], dim=dim)


def local_slice(x: torch.Tensor, rank: int, t: int, dim: int, segments: tuple[int, ...] | None = None,
                rank_tensor: torch.Tensor | None = None) -> torch.Tensor:
    """Rank ``rank``'s piece of a global tensor along ``dim``: every segment's rank-th 1/t. Inside
    ``torch.compile`` with ``rank_tensor`` (``TPGroup.first_index``'s), the piece is picked by indices
    computed from that tensor, so the captured graph is the same on every rank."""
    segs = list(segments) if segments is not None else [x.shape[dim]]
    if sum(segs) != x.shape[dim]:  # padded dimension: pad the global tensor with zeros first
        pad = list(x.shape)
        pad[dim] = sum(segs) - x.shape[dim]
        x = torch.cat([x, x.new_zeros(pad)], dim=dim)
    out, start = [], 0
    for s in segs:
        n = s // t
        if rank_tensor is not None and torch.compiler.is_compiling():
            out.append(x.index_select(dim, torch.arange(n, device=x.device) + (rank_tensor * n + start)))
        else:
            out.append(x.narrow(dim, start + rank * n, n))
        start += s
    return out[0] if len(out) == 1 else torch.cat(out, dim=dim)


def whole_from_shards(local: torch.Tensor, group: TPGroup, dim: int, segments: tuple[int, ...] | None,
                      size: int) -> torch.Tensor:
    """The inverse of ``local_slice``: every rank's piece gathered along ``dim`` (collective over
    ``group``), padding beyond the full ``size`` dropped."""
    if group.size > 1:
        local = all_gather(local, group, dim, segments)
    return local.narrow(dim, 0, size)


def in_buckets(items: list[tuple[Hashable, int]], limit: int) -> list[tuple[Hashable, list[int]]]:
    """The indices of ``items`` ((key, bytes) each) grouped by key, keys in the order they first
    appear, each key's items cut in order into buckets of at most ``limit`` bytes (an item larger
    than ``limit`` alone): every rank that lists the same items gets the same buckets."""
    buckets: dict[Hashable, list[list[int]]] = {}
    filled: dict[Hashable, int] = {}  # bytes in each key's last bucket
    for i, (key, size) in enumerate(items):
        per_key = buckets.setdefault(key, [[]])
        if per_key[-1] and filled[key] + size > limit:
            per_key.append([])
            filled[key] = 0
        per_key[-1].append(i)
        filled[key] = filled.get(key, 0) + size
    return [(key, bucket) for key, per_key in buckets.items() for bucket in per_key]


def wholes_from_shards(pieces: list[tuple[torch.Tensor, int, tuple[int, ...] | None, int]], group: TPGroup,
                       bucket_bytes: int) -> list[torch.Tensor]:
    """``whole_from_shards`` of many tensors at once: ``pieces`` holds (local shard, dim, segments,
    full size) each; the shards of one dtype are flattened into buckets of at most ``bucket_bytes``
    (gathered), each bucket one all-gather over ``group``. Returns the whole tensors in the order
    of ``pieces``."""
    if group.size <= 1 or group.pg is None:
        return [whole_from_shards(x, group, dim, segs, size) for x, dim, segs, size in pieces]
    t = group.size
    fronts = [x.movedim(dim, 0).contiguous() for x, dim, _, _ in pieces]
    out: list[torch.Tensor | None] = [None] * len(pieces)
    for _, indices in in_buckets([(f.dtype, f.numel() * f.element_size() * t) for f in fronts], bucket_bytes):
        flat = torch.cat([fronts[i].reshape(-1) for i in indices])
        gathered = torch.empty(t * flat.numel(), dtype=flat.dtype, device=flat.device)
        dist.all_gather_single(gathered, flat, group=group.pg)
        by_rank, start = gathered.view(t, -1), 0
        for i in indices:
            front, (_, dim, segs, size) = fronts[i], pieces[i]
            blocks = by_rank[:, start:start + front.numel()].reshape(t * front.shape[0], *front.shape[1:])
            out[i] = _segment_major(blocks, t, segs).movedim(0, dim).narrow(dim, 0, size)
            start += front.numel()
    return out


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


def reduce_scatter_dim(x: torch.Tensor, group: TPGroup, dim: int,
                        segments: tuple[int, ...] | None = None) -> torch.Tensor:
    """Sum over the ranks; this rank keeps its 1/t along ``dim``: one block, or with ``segments``
    its 1/t of each segment (each of several sequences flattened into one token dim).

    One ``reduce_scatter_single`` over the dim moved to the front (NCCL and gloo in torch 2.13
    both have it); an inspection group (no process group) only takes the slice, for shapes."""
    t = group.size
    if any(s % t for s in (segments or (x.shape[dim],))):
        raise CollectiveError(f"reduce-scatter along dim {dim} of size {x.shape[dim]} (segments {segments}) needs "
                         f"multiples of tp={t}")
    if group.pg is None:
        return group.own_slice(x, dim, segments)
    front = _rank_major(x.movedim(dim, 0), t, segments).contiguous()
    if torch.compiler.is_compiling():
        return funcol.reduce_scatter_tensor(front, "sum", 0, group.pg).movedim(0, dim).contiguous()
    out = torch.empty((front.shape[0] // t, *front.shape[1:]), dtype=x.dtype, device=x.device)
    dist.reduce_scatter_single(out, front, group=group.pg)
    return out.movedim(0, dim).contiguous()


def all_gather_dim(x: torch.Tensor, group: TPGroup, dim: int,
                    segments: tuple[int, ...] | None = None) -> torch.Tensor:
    """Every rank's slice put back along ``dim`` (rank order, segment by segment): one
    ``all_gather_single`` over the dim moved to the front; an inspection group repeats this
    rank's slice, for shapes."""
    front = x.movedim(dim, 0).contiguous()
    if group.pg is None:
        out = torch.cat([front] * group.size, dim=0)
    elif torch.compiler.is_compiling():
        out = funcol.all_gather_tensor(front, 0, group.pg)
    else:
        out = torch.empty((front.shape[0] * group.size, *front.shape[1:]), dtype=x.dtype, device=x.device)
        dist.all_gather_single(out, front, group=group.pg)
    return _segment_major(out, group.size, segments).movedim(0, dim).contiguous()


DimCollective = Callable[[torch.Tensor, TPGroup, int, "tuple[int, ...] | None"], torch.Tensor]


def conjugate_pair(name: str, forward: DimCollective, backward: DimCollective) -> type[torch.autograd.Function]:
    """An autograd Function that runs ``forward(x, group, dim, segments)`` and, in the backward,
    ``backward(grad, group, dim, segments)``: a collective and its conjugate (a reduce-scatter and
    an all-gather, a gather and a slice)."""

    def fwd(ctx, x, group, dim, segments):
        ctx.args = (group, dim, segments)
        return forward(x, group, dim, segments)

    def bwd(ctx, grad):
        return backward(grad, *ctx.args), None, None, None

    return type(name, (torch.autograd.Function,), {"forward": staticmethod(fwd), "backward": staticmethod(bwd)})
