"""Ring attention: exact softmax attention over a sequence split across context-parallel ranks.

Under context parallelism each of cp ranks holds S/cp tokens of every sequence
(``cp_layout``: ``load_balanced`` for causal attention, ``contiguous`` for
bidirectional). Everything but attention is token-wise; attention needs every
key and value. ``ring_attention(q, k, v, group, causal=..., balanced=...)``
computes it without ever gathering the sequence: the key/value blocks travel
around the ring of ranks, one hop per step, and each rank folds each block
into its queries' result as it arrives. The result equals
``F.scaled_dot_product_attention`` over the whole sequence (``is_causal``,
``enable_gqa``), rows of this rank's queries, up to fp32 rounding.

Shapes: q (B, Hq, Sl, D), k and v (B, Hkv, Sl, D), Sl = S/cp, Hq a multiple
of Hkv (grouped-query attention: query head h reads key/value head
h // (Hq/Hkv)). The ring carries the Hkv heads; they are repeated to Hq only
inside a block's computation.

Forward (step i = 0 .. cp-1; rank r holds the block of owner (r - i) mod cp)::

    send the block held to rank r+1, receive the next from rank r-1   (in flight)
    O_i, L_i = block attention of q with that block                    (meanwhile)
    wait for the next block

cp-1 exchanges; each block's K and V go as one message (stacked). A block's
partial attention over its keys j (scores s_ij = scale * q_i . k_j)::

    L_i = log sum_j exp(s_ij)                 (its log-sum-exp, fp32)
    O_i = sum_j exp(s_ij - L_i) v_j           (its normalised output, fp32)

and two partial results over disjoint keys merge exactly (online softmax)::

    L = logaddexp(L_a, L_b)
    O = exp(L_a - L) O_a + exp(L_b - L) O_b

which is softmax attention over the union of the keys: after the last block,
O is the attention over the whole sequence and L its log-sum-exp.

Causal masks come from global positions (``cp_positions``): for queries at
positions p_q and keys at p_k, query i sees key j iff p_q[i] >= p_k[j].
Positions are sorted within a rank, so the queries that see any key of a
block are a suffix of the rows and the keys seen by any query a prefix of the
columns: ``block_plan`` names that rectangle and whether it needs the mask.
With the load-balanced layout (rank r: chunks r and 2cp-1-r), for the block of
owner o on rank r:

- o == r: every row and column, masked (causal within the diagonal chunks);
- o <  r: every row, the first half of the columns (chunk o), no mask;
- o >  r: the second half of the rows (chunk 2cp-1-r), every column, no mask.

So each rank computes the same number of score entries, and fully masked work
(a quarter of each off-diagonal pair, or all of it, contiguous) is never computed.

Backward (FlashAttention's, per block, from the saved q, k, v, O and L; nothing
per block is kept from the forward): with dO the output gradient and
Delta_i = sum_d dO_id O_id,

    P_ij = exp(s_ij - L_i) (0 where masked)    dV_j = sum_i P_ij dO_i
    dS_ij = P_ij (dO_i . v_j - Delta_i)         dQ_i = scale sum_j dS_ij k_j
                                                dK_j = scale sum_i dS_ij q_i

The key/value blocks travel the ring again (cp-1 hops). A block's dK and dV
are sums over every rank's queries: an fp32 accumulator (stacked dK, dV)
follows each block one rank behind it, each rank adding its part and passing
it right while it computes the next block; the owner keeps its own part from
step 0 and adds the accumulator that arrives after the last step (cp-1 hops).
dQ stays on its rank. Repeated heads' gradients are summed back to the Hkv heads.

Traffic per rank per layer and microbatch (``ring_attention_bytes``):
forward (cp-1) * 2 * B*Hkv*Sl*D elements of the input dtype; backward the same
again plus (cp-1) * 2 * B*Hkv*Sl*D fp32 elements of gradient accumulators.

Blocks compute in fp32 (bf16 and fp16 inputs are upcast per block; fp64 inputs
stay fp64): every merge and accumulation is at least fp32, and outputs and
gradients are rounded to the input dtype once, at the end. On the CPU an fp32
block runs PyTorch's fused attention kernel and its backward (the ring's own
log-sum-exp and output passed to it, as FlashAttention's backward takes them);
fp64 blocks, and blocks on other devices, run plain matmuls, which hold the
block's scores.

Not supported yet: attention dropout (``dropout_p > 0`` is refused, not
ignored), and ``torch.compile`` tracing (Dynamo cannot trace the point-to-point
messages). A group of one rank computes ``scaled_dot_product_attention``
locally; an inspection group (no process group, size > 1) computes local
attention of this rank's block for the shapes, without communicating.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Protocol

import torch
import torch.distributed as dist
import torch.nn.functional as F

from autopar.core.comm.cp_layout import ContextParallelError, cp_positions
from autopar.core.comm.group import TPGroup

__all__ = ["ring_attention", "RingLinks", "P2PRing", "BlockPlan", "block_plan", "block_attention",
           "block_attention_backward", "merge_partial", "ring_forward", "ring_backward", "RingTraffic",
           "ring_attention_bytes"]

_KV_TAG, _KV_BACKWARD_TAG, _GRAD_TAG = 21, 22, 23
"""Message tags: the forward's key/value blocks, the backward's, and the backward's gradient accumulators
(the backward has both in flight at once, to the same peer)."""


# ------------------------------------------------------------------ the ring's links


class RingLinks(Protocol):
    """This rank's links in the ring: pass a tensor to the next rank while receiving the previous rank's."""

    def pass_right(self, x: torch.Tensor, tag: int) -> object:
        """Send ``x`` to rank + 1 and receive rank - 1's tensor of the same shape and tag: a message in flight."""

    def arrived(self, message: object) -> torch.Tensor:
        """The received tensor of ``message``, once its send and receive completed."""


class P2PRing:
    """``RingLinks`` over a process group: one ``batch_isend_irecv`` per exchange."""

    def __init__(self, group: TPGroup) -> None:
        self.group = group

        def global_rank(r: int) -> int:
            return group.members[r] if group.members else dist.get_global_rank(group.pg, r)

        self.right = global_rank((group.rank + 1) % group.size)
        self.left = global_rank((group.rank - 1) % group.size)

    def pass_right(self, x: torch.Tensor, tag: int) -> tuple[list, torch.Tensor]:
        x = x.contiguous()
        buf = torch.empty_like(x)
        ops = [dist.P2POp(dist.isend, x, self.right, group=self.group.pg, tag=tag),
               dist.P2POp(dist.irecv, buf, self.left, group=self.group.pg, tag=tag)]
        return dist.batch_isend_irecv(ops), buf

    def arrived(self, message: tuple[list, torch.Tensor]) -> torch.Tensor:
        works, buf = message
        for work in works:
            work.wait()
        return buf


# ------------------------------------------------------------------ one block


@dataclass(frozen=True)
class BlockPlan:
    """The part of one (query block, key block) pair that causal attention needs: rows ``rows`` of the
    queries against columns ``cols`` of the keys, masked by position or not. Rows outside see none of the
    block's keys; columns outside are seen by none of the queries."""

    rows: tuple[int, int]
    """(start, stop) of the query rows that see at least one key of the block (a suffix)."""
    cols: tuple[int, int]
    """(start, stop) of the key columns seen by at least one of those rows (a prefix)."""
    masked: bool
    """Some (row, column) inside the rectangle is masked: apply the causal mask from positions."""

    @property
    def kind(self) -> str:
        """'skip' (fully masked: nothing to compute), 'diagonal' (masked within) or 'full' (all visible)."""
        if self.rows[0] == self.rows[1]:
            return "skip"
        return "diagonal" if self.masked else "full"


def block_plan(q_pos: torch.Tensor, kv_pos: torch.Tensor, causal: bool) -> BlockPlan:
    """The ``BlockPlan`` of queries at global positions ``q_pos`` against keys at ``kv_pos`` (both sorted
    ascending, as ``cp_positions`` gives them)."""
    n_q, n_k = len(q_pos), len(kv_pos)
    if not causal:
        return BlockPlan((0, n_q), (0, n_k), False)
    first_row = int(torch.searchsorted(q_pos, int(kv_pos[0])))  # first query at or after the first key
    stop_col = int(torch.searchsorted(kv_pos, int(q_pos[-1]), right=True))  # keys at or before the last query
    if first_row == n_q:
        return BlockPlan((n_q, n_q), (0, 0), False)
    return BlockPlan((first_row, n_q), (0, stop_col), bool(q_pos[first_row] < kv_pos[stop_col - 1]))


def _causal_mask(plan: BlockPlan, q_pos: torch.Tensor, kv_pos: torch.Tensor, device: torch.device
                 ) -> torch.Tensor | None:
    """The (rows, cols) visibility of the plan's rectangle (True: visible), or None when all is visible."""
    if not plan.masked:
        return None
    q = q_pos[plan.rows[0]:plan.rows[1]].to(device)
    k = kv_pos[plan.cols[0]:plan.cols[1]].to(device)
    return q[:, None] >= k[None, :]


def _wide(x: torch.Tensor) -> torch.Tensor:
    """``x`` in the dtype blocks compute and accumulate in: fp32 for fp32 and narrower inputs (bf16, fp16),
    fp64 for fp64."""
    return x.to(torch.promote_types(x.dtype, torch.float32))


def _repeat_kv(x: torch.Tensor, groups: int) -> torch.Tensor:
    """(B, Hkv, C, D) -> (B, Hkv*groups, C, D), head h reading kv head h // groups (``enable_gqa``)."""
    return x if groups == 1 else x.repeat_interleave(groups, dim=1)


def _fold_kv(x: torch.Tensor, groups: int) -> torch.Tensor:
    """(B, Hkv*groups, C, D) -> (B, Hkv, C, D): the gradients of repeated heads summed into their kv head."""
    if groups == 1:
        return x
    b, h, c, d = x.shape
    return x.view(b, h // groups, groups, c, d).sum(dim=2)


def _scores(q: torch.Tensor, k: torch.Tensor, scale: float, mask: torch.Tensor | None) -> torch.Tensor:
    s = torch.matmul(q, k.transpose(-1, -2)) * scale  # (B, Hq, R, C), fp32 or fp64 (``_wide``)
    return s if mask is None else s.masked_fill(~mask, float("-inf"))


_FLASH_CPU = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default
_FLASH_CPU_BACKWARD = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward.default
"""PyTorch's fused CPU attention and its backward: a block's output and log-sum-exp without keeping its
scores, and its gradients from the whole attention's output and log-sum-exp (the ring's: what FlashAttention's
backward takes), 7-14x the plain matmuls' speed on blocks of 256 (one thread)."""


def _fused(q: torch.Tensor) -> bool:
    """Blocks of fp32 or narrower inputs on the CPU run PyTorch's fused kernel; fp64 (the tests' exact
    reference) and other devices the plain matmuls."""
    return q.device.type == "cpu" and torch.promote_types(q.dtype, torch.float32) == torch.float32


def _additive(mask: torch.Tensor | None, device) -> torch.Tensor | None:
    """A visibility mask (True: seen) as the additive fp32 mask the fused kernel takes."""
    if mask is None:
        return None
    return torch.zeros(mask.shape, dtype=torch.float32, device=device).masked_fill_(~mask, float("-inf"))


def block_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
                    mask: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax attention of queries ``q`` (B, Hq, R, D) over one block of keys/values (B, Hkv, C, D) in
    fp32 (fp64 for fp64): (O (B, Hq, R, D), L (B, Hq, R)), the output normalised over this block and its log-sum-exp.
    ``mask`` (R, C), True where visible, must leave each row at least one key."""
    groups = q.shape[1] // k.shape[1]
    k, v = _repeat_kv(_wide(k), groups), _repeat_kv(_wide(v), groups)
    if _fused(q):
        return _FLASH_CPU(_wide(q), k, v, 0.0, False, attn_mask=_additive(mask, q.device), scale=scale)
    s = _scores(_wide(q), k, scale, mask)
    lse = torch.logsumexp(s, dim=-1)  # (B, Hq, R)
    return torch.matmul(torch.exp(s - lse[..., None]), v), lse


def merge_partial(out: torch.Tensor, lse: torch.Tensor, block_out: torch.Tensor, block_lse: torch.Tensor
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """Two partial attentions of the same queries over disjoint keys, merged into the attention over both
    (online softmax): L = logaddexp(L_a, L_b), O = exp(L_a - L) O_a + exp(L_b - L) O_b. Each row of either
    side may be empty (L = -inf) as long as the other is not."""
    merged = torch.logaddexp(lse, block_lse)
    out = out * torch.exp(lse - merged)[..., None] + block_out * torch.exp(block_lse - merged)[..., None]
    return out, merged


def block_attention_backward(grad_out: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                             lse: torch.Tensor, delta: torch.Tensor, scale: float, mask: torch.Tensor | None = None,
                             out: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One block's part of the attention gradients, fp32 (fp64 for fp64): (dQ (B, Hq, R, D), dK, dV
    (B, Hkv, C, D)), given the output gradient ``grad_out`` and the whole attention's log-sum-exp ``lse`` and
    ``delta`` = sum(dO * O, -1) (B, Hq, R) of these rows. With the whole attention's output ``out`` of
    these rows, a fused kernel may compute it (it derives delta from ``out``)."""
    groups = q.shape[1] // k.shape[1]
    q, grad_out = _wide(q), _wide(grad_out)
    k, v = _repeat_kv(_wide(k), groups), _repeat_kv(_wide(v), groups)
    if out is not None and _fused(q):
        dq, dk, dv = _FLASH_CPU_BACKWARD(grad_out, q, k, v, _wide(out), lse, 0.0, False,
                                         attn_mask=_additive(mask, q.device), scale=scale)
        return dq, _fold_kv(dk, groups), _fold_kv(dv, groups)
    p = torch.exp(_scores(q, k, scale, mask) - lse[..., None])  # (B, Hq, R, C); masked -> 0
    dv = torch.matmul(p.transpose(-1, -2), grad_out)
    ds = p * (torch.matmul(grad_out, v.transpose(-1, -2)) - delta[..., None])
    dq = torch.matmul(ds, k) * scale
    dk = torch.matmul(ds.transpose(-1, -2), q) * scale
    return dq, _fold_kv(dk, groups), _fold_kv(dv, groups)


# ------------------------------------------------------------------ the ring


def _all_positions(cp: int, local_seq: int, balanced: bool) -> list[torch.Tensor]:
    return [cp_positions(r, cp, local_seq * cp, balanced) for r in range(cp)]


def ring_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, links: RingLinks, rank: int, cp: int, *,
                 causal: bool, balanced: bool, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's attention over the whole ring: (O (B, Hq, Sl, D), L (B, Hq, Sl)), both fp32 (fp64 for
    fp64 inputs). Passes the key/value blocks around the ring (cp-1 exchanges over ``links``), each block's
    transfer in flight while the block before it is computed."""
    positions = _all_positions(cp, q.shape[2], balanced)
    kv = torch.stack((k, v))  # (2, B, Hkv, Sl, D): one message per hop
    out = lse = None
    for step in range(cp):
        owner = (rank - step) % cp
        message = links.pass_right(kv, _KV_TAG) if step < cp - 1 else None
        plan = block_plan(positions[rank], positions[owner], causal)
        if plan.kind != "skip":
            (r0, r1), (c0, c1) = plan.rows, plan.cols
            mask = _causal_mask(plan, positions[rank], positions[owner], q.device)
            block_out, block_lse = block_attention(q[:, :, r0:r1], kv[0][:, :, c0:c1], kv[1][:, :, c0:c1], scale,
                                                   mask)
            if out is None:  # step 0, this rank's own block: every query sees at least itself
                assert plan.rows == (0, q.shape[2]), plan
                out, lse = block_out, block_lse
            else:
                out[:, :, r0:r1], lse[:, :, r0:r1] = merge_partial(out[:, :, r0:r1], lse[:, :, r0:r1], block_out,
                                                                   block_lse)
        if message is not None:
            kv = links.arrived(message)
    return out, lse


def ring_backward(grad_out: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                  lse: torch.Tensor, links: RingLinks, rank: int, cp: int, *, causal: bool, balanced: bool,
                  scale: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The gradients (dQ, dK, dV) of this rank's blocks, fp32 (fp64 for fp64 inputs), from the forward's
    output ``out`` and log-sum-exp ``lse``. The key/value blocks travel the ring again; each block's dK/dV
    accumulator follows it one rank behind and ends at its owner (cp-1 hops each)."""
    positions = _all_positions(cp, q.shape[2], balanced)
    delta = (_wide(grad_out) * _wide(out)).sum(dim=-1)  # (B, Hq, Sl)
    wide = delta.dtype
    dq = torch.zeros(q.shape, dtype=wide, device=q.device)
    kv = torch.stack((k, v))
    own = accumulated = None  # this rank's part of its own block's dK/dV; the message carrying an accumulator
    for step in range(cp):
        owner = (rank - step) % cp
        message = links.pass_right(kv, _KV_BACKWARD_TAG) if step < cp - 1 else None
        plan = block_plan(positions[rank], positions[owner], causal)
        part = torch.zeros((2, *k.shape), dtype=wide, device=k.device)  # (dK, dV) of this block
        if plan.kind != "skip":
            (r0, r1), (c0, c1) = plan.rows, plan.cols
            mask = _causal_mask(plan, positions[rank], positions[owner], q.device)
            block_dq, part[0][:, :, c0:c1], part[1][:, :, c0:c1] = block_attention_backward(
                grad_out[:, :, r0:r1], q[:, :, r0:r1], kv[0][:, :, c0:c1], kv[1][:, :, c0:c1], lse[:, :, r0:r1],
                delta[:, :, r0:r1], scale, mask, out[:, :, r0:r1])
            dq[:, :, r0:r1] += block_dq
        if step == 0:
            own = part
        else:  # add the ranks before this one, pass the sum on towards the owner
            if accumulated is not None:
                part += links.arrived(accumulated)
            accumulated = links.pass_right(part, _GRAD_TAG)
        if message is not None:
            kv = links.arrived(message)
    if accumulated is not None:  # every other rank's part of this rank's own block
        own = own + links.arrived(accumulated)
    return dq, own[0], own[1]


class _RingAttention(torch.autograd.Function):
    """``ring_forward`` in the forward, ``ring_backward`` in the backward, over the group's process group."""

    @staticmethod
    def forward(ctx, q, k, v, group: TPGroup, causal: bool, balanced: bool, scale: float):
        links = P2PRing(group)
        out, lse = ring_forward(q, k, v, links, group.rank, group.size, causal=causal, balanced=balanced,
                                scale=scale)
        out = out.to(q.dtype)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.ring = (links, group.rank, group.size, causal, balanced, scale)
        return out

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v, out, lse = ctx.saved_tensors
        links, rank, cp, causal, balanced, scale = ctx.ring
        dq, dk, dv = ring_backward(grad_out, q, k, v, out, lse, links, rank, cp, causal=causal, balanced=balanced,
                                   scale=scale)
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None, None, None, None


def _check_inputs(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, balanced: bool, dropout_p: float) -> None:
    if dropout_p > 0.0:
        raise ContextParallelError(
            f"ring_attention does not implement attention dropout (dropout_p={dropout_p}): each block would need "
            "the random mask of its (query, key) pair, drawn alike in the forward and the backward; train with "
            "attention dropout 0 under context parallelism, or with cp=1")
    if q.dim() != 4 or k.shape != v.shape or k.dim() != 4:
        raise ContextParallelError(f"ring_attention takes q (B, Hq, Sl, D) and k, v (B, Hkv, Sl, D) of one shape; "
                                   f"got q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}")
    (b, hq, sl, d), (bk, hkv, slk, dk) = q.shape, k.shape
    if (b, sl, d) != (bk, slk, dk) or hq % hkv:
        raise ContextParallelError(
            f"ring_attention needs q and k/v with the same batch, local sequence and head size, and Hq a multiple "
            f"of Hkv (grouped-query attention); got q {tuple(q.shape)}, k/v {tuple(k.shape)}")
    if balanced and sl % 2:
        raise ContextParallelError(f"the load-balanced layout gives each rank two equal chunks, but the local "
                                   f"sequence has {sl} tokens (odd): shard the sequence with cp_shard(..., "
                                   f"balanced=True) from a length divisible by 2*cp")


def ring_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, group: TPGroup, *, causal: bool,
                   balanced: bool, scale: float | None = None, dropout_p: float = 0.0) -> torch.Tensor:
    """Attention of this rank's queries over the whole sequence, split over the context-parallel ``group``:
    q (B, Hq, Sl, D), k and v (B, Hkv, Sl, D), this rank's tokens in the ``balanced`` (load-balanced) or
    contiguous layout (``cp_layout``). Returns (B, Hq, Sl, D) in q's dtype: this rank's rows of
    ``scaled_dot_product_attention(Q, K, V, is_causal=causal, scale=scale, enable_gqa=True)`` over the
    whole sequence. Differentiable (dq, dk, dv of this rank's blocks). ``dropout_p`` > 0 is refused."""
    _check_inputs(q, k, v, balanced, dropout_p)
    if group.size == 1 or group.pg is None:  # one rank, or an inspection group: local attention, no messages
        return F.scaled_dot_product_attention(q, k, v, is_causal=causal, scale=scale, enable_gqa=True)
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    return _RingAttention.apply(q, k, v, group, causal, balanced, scale)


# ------------------------------------------------------------------ traffic


@dataclass(frozen=True)
class RingTraffic:
    """Bytes one rank sends for one ring attention (one layer, one microbatch)."""

    forward: int
    """The key/value blocks: (cp-1) messages of 2*B*Hkv*Sl*D elements of the input dtype."""
    backward: int
    """The key/value blocks again, and (cp-1) dK/dV accumulators of 2*B*Hkv*Sl*D elements, fp32 (fp64
    for fp64 inputs)."""

    @property
    def total(self) -> int:
        return self.forward + self.backward


def ring_attention_bytes(batch: int, kv_heads: int, local_seq: int, head_dim: int, dtype: torch.dtype,
                         cp: int) -> RingTraffic:
    """What each rank sends for one ring attention with k, v of shape (batch, kv_heads, local_seq, head_dim)
    in ``dtype`` over ``cp`` ranks (each rank receives as much). Nothing for cp = 1."""
    block = 2 * batch * kv_heads * local_seq * head_dim  # K and V
    hops = cp - 1
    kv_bytes = hops * block * dtype.itemsize
    accumulator = torch.promote_types(dtype, torch.float32)  # the dtype blocks accumulate in
    return RingTraffic(forward=kv_bytes, backward=kv_bytes + hops * block * accumulator.itemsize)
