"""Async tensor parallelism: sequence parallelism's collectives decomposed under the GEMMs next to them.

Under sequence parallelism each column-parallel region starts with an
all-gather of the tokens (f, ``gather_from_sp``) and each row-parallel GEMM
ends in a reduce-scatter of them (g, ``reduce_scatter_to_sp``). Run whole,
each collective waits for the GEMM before it (or holds up the GEMM after it).
Decomposed into t ring steps over this rank's neighbours, one chunk of tokens
is multiplied while the next travels (Wang et al. 2022; PyTorch's async TP):

- ``all_gather_matmul``: the GEMMs reading one gathered value (a layer's q,
  k and v, or one MLP input), computed on each rank's chunk of tokens as it
  arrives: the own chunk first, then each chunk passed on around the ring
  while the one received before is multiplied. Backward: the input gradient
  is a reduce-scatter of ``sum_j dY_j W_j``, computed chunk by chunk, the
  chunk bound for the next rank multiplied while the partial sum before it
  travels; the weights' gradients read the whole input, which is gathered
  again around the same ring (this rank keeps only its own 1/t slice from the
  forward, as ``kept_slices`` does for the unfused path: the bytes of one more
  all-gather of the input per microbatch, in the backward).
- ``matmul_reduce_scatter``: a row-parallel GEMM whose output is
  reduce-scattered along the tokens, its partial product computed chunk by
  chunk, the chunk bound for the next rank multiplied while the sum before it
  travels. Backward: the output gradient all-gathered around the ring, each
  chunk's input gradient computed as it arrives; the weight's gradient reads
  the gathered output gradient.

A GEMM is one of the forms the graph has: ``linear(x, W, b)``, or
``x @ W`` as ``mm``, ``matmul`` (W 2-D) or ``addmm(b, x, W)`` (HuggingFace's
Conv1D). Each runs as the unfused op on a slice of the rows, so the values are
the unfused path's: bitwise where the sum over the t ranks runs in the same
order (t = 2: one addition, which commutes exactly; tested), within fp32
rounding otherwise, where the ring adds the partial sums in ring order and the
collective in its own. Each weight gradient is one GEMM over every token, as
unfused. Under autocast the backward's GEMMs run under the forward's autocast
and the input gradient's partial sums are added in the input's dtype, as
autograd adds the gradients of the casts.

Messages go point to point over the tensor-parallel group (``batch_isend_irecv``,
tags apart per direction). A group of one rank or an inspection group (no
process group: shapes only) computes the unfused form. Compiled chunks never
hold these ops: Dynamo cannot trace point-to-point messages, so the pass
(``passes/async_tp.py``) leaves the collectives whole under ``compile``.
"""

from __future__ import annotations

import contextlib
import math

import torch
import torch.distributed as dist
import torch.fx as fx
import torch.nn.functional as F

from autopar.core.collectives import ALL_GATHER, REDUCE_SCATTER, collective
from autopar.core.comm.group import TPGroup, local_slice
from autopar.core.comm.sp_mappings import gather_from_sp, reduce_scatter_to_sp
from autopar.core.flops import matmul_flops
from autopar.core.graph import local_val

__all__ = ["all_gather_matmul", "matmul_reduce_scatter"]

_GATHER_TAG, _REDUCE_TAG = 1, 2
"""Message tags of the chunks passed to the next rank and of the partial sums passed to the previous
one: a backward sends both at once, and with t = 2 to the same peer."""

def _product(form: str, x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
    """The GEMM ``form`` of ``x`` (rows of tokens) with ``w`` and the bias ``b``, as the op of that name:
    'linear' (W: out x in), or 'addmm', 'mm', 'matmul' (W: in x out)."""
    if form == "linear":
        return F.linear(x, w, b)
    if form == "addmm":
        return torch.addmm(b, x, w)
    return torch.mm(x, w) if form == "mm" else torch.matmul(x, w)


def _input_grad(form: str, grad_rows: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """``dY`` (rows) times the weight, back to the input's features."""
    return grad_rows.mm(w) if form == "linear" else grad_rows.mm(w.t())


def _weight_grad(form: str, grad_rows: torch.Tensor, x_rows: torch.Tensor) -> torch.Tensor:
    """The weight's gradient over every token's rows."""
    return grad_rows.t().mm(x_rows) if form == "linear" else x_rows.t().mm(grad_rows)


# ------------------------------------------------------------------ the ring


class _Ring:
    """This rank's neighbours in the tensor-parallel group, and the chunks of a token dim.

    Messages go rightwards (to rank + 1) for gathered chunks and leftwards (to rank - 1) for
    partial sums; ``chunk`` cuts a tensor into rank ``r``'s tokens as ``local_slice`` does
    (its 1/t of every segment), ``whole`` puts the t chunks back in the gathered order."""

    def __init__(self, tp: TPGroup, dim: int, segments: tuple[int, ...] | None) -> None:
        self.tp, self.dim, self.segments = tp, dim, segments
        self.t, self.rank = tp.size, tp.rank
        self.right = tp.members[(tp.rank + 1) % tp.size]
        self.left = tp.members[(tp.rank - 1) % tp.size]

    def pass_right(self, x: torch.Tensor) -> tuple[list, torch.Tensor]:
        """Send ``x`` to the next rank and receive the previous rank's, in flight: (works, buffer)."""
        return self._exchange(x, self.right, self.left, _GATHER_TAG)

    def pass_left(self, x: torch.Tensor) -> tuple[list, torch.Tensor]:
        """Send ``x`` to the previous rank and receive the next rank's, in flight: (works, buffer)."""
        return self._exchange(x, self.left, self.right, _REDUCE_TAG)

    def _exchange(self, x: torch.Tensor, to: int, frm: int, tag: int) -> tuple[list, torch.Tensor]:
        x = x.contiguous()
        buf = torch.empty_like(x)
        ops = [dist.P2POp(dist.isend, x, to, group=self.tp.pg, tag=tag),
               dist.P2POp(dist.irecv, buf, frm, group=self.tp.pg, tag=tag)]
        return dist.batch_isend_irecv(ops), buf

    @staticmethod
    def arrived(message: tuple[list, torch.Tensor]) -> torch.Tensor:
        """The buffer of an exchange, once its send and receive completed."""
        works, buf = message
        for work in works:
            work.wait()
        return buf

    def chunk(self, x: torch.Tensor, r: int) -> torch.Tensor:
        """Rank ``r``'s tokens of ``x`` (whole along the token dim), contiguous."""
        return local_slice(x, r, self.t, self.dim, self.segments).contiguous()

    def whole(self, pieces: list[torch.Tensor]) -> torch.Tensor:
        """Every rank's piece (in rank order) put back along the token dim, segment by segment."""
        if self.segments is None:
            return torch.cat(pieces, dim=self.dim)
        sizes = [s // self.t for s in self.segments]
        split = [p.split(sizes, dim=self.dim) for p in pieces]
        return torch.cat([split[r][s] for s in range(len(sizes)) for r in range(self.t)], dim=self.dim)


def _autocast_state(x: torch.Tensor) -> tuple[str, torch.dtype] | None:
    """The autocast the forward ran under on ``x``'s device (the backward runs its GEMMs under it too)."""
    device = x.device.type
    return (device, torch.get_autocast_dtype(device)) if torch.is_autocast_enabled(device) else None


def _autocast(state: tuple[str, torch.dtype] | None):
    return torch.autocast(state[0], dtype=state[1]) if state is not None else contextlib.nullcontext()


def _rows(x: torch.Tensor) -> torch.Tensor:
    return x.reshape(-1, x.shape[-1])


# ------------------------------------------------------------------ all-gather, then GEMMs


class _AllGatherMatmul(torch.autograd.Function):
    """``[form_j(all_gather(x), W_j, b_j) for j]`` in t ring steps; ``params`` = W_0, b_0, W_1, b_1, ..."""

    @staticmethod
    def forward(ctx, x, tp, dim, segments, forms, *params):
        ring = _Ring(tp, dim, segments)
        weights, biases = params[0::2], params[1::2]
        pieces: list[list[torch.Tensor | None]] = [[None] * ring.t for _ in weights]
        current = x
        for step in range(ring.t):
            message = ring.pass_right(current) if step < ring.t - 1 else None
            src = (ring.rank - step) % ring.t  # whose tokens ``current`` holds
            for j, (form, w, b) in enumerate(zip(forms, weights, biases)):
                pieces[j][src] = _product(form, current, w, b)
            if message is not None:
                current = ring.arrived(message)
        ctx.ring, ctx.forms, ctx.autocast = ring, forms, _autocast_state(x)
        ctx.has_bias = [b is not None for b in biases]
        ctx.save_for_backward(x, *weights)
        return tuple(ring.whole(p) for p in pieces)

    @staticmethod
    def backward(ctx, *grads):
        ring, forms, need_x = ctx.ring, ctx.forms, ctx.needs_input_grad[0]
        x, *weights = ctx.saved_tensors
        with _autocast(ctx.autocast):
            gathered: list[torch.Tensor | None] = [None] * ring.t
            gathered[ring.rank] = current = x
            incoming, last = None, None
            for step in range(ring.t):
                message = ring.pass_right(current) if step < ring.t - 1 else None
                if need_x:  # the partial input gradient of rank ``dest``'s tokens
                    part = _input_grad_part(forms, grads, weights, ring, (ring.rank + step + 1) % ring.t, x)
                    if step < ring.t - 1:
                        incoming = ring.pass_left(part if incoming is None else ring.arrived(incoming) + part)
                    else:
                        last = part  # this rank's own tokens: added to the sum once the weights' GEMMs ran
                if message is not None:
                    current = ring.arrived(message)
                    gathered[(ring.rank - step - 1) % ring.t] = current
            whole_x = _rows(ring.whole(gathered))
            params = []
            for j, (form, g) in enumerate(zip(forms, grads)):
                rows = _rows(g)
                params.append(_weight_grad(form, rows, whole_x) if ctx.needs_input_grad[5 + 2 * j] else None)
                params.append(rows.sum(0) if ctx.has_bias[j] and ctx.needs_input_grad[6 + 2 * j] else None)
            grad_x = (ring.arrived(incoming) + last) if need_x else None
        return (grad_x, None, None, None, None, *params)


def _input_grad_part(forms, grads, weights, ring: _Ring, dest: int, x: torch.Tensor) -> torch.Tensor:
    """``sum_j dY_j W_j`` on rank ``dest``'s tokens, in the input's dtype, the consumers added last to
    first as autograd adds the gradients of a value several GEMMs read (the latest one's first)."""
    total = None
    for form, g, w in reversed(list(zip(forms, grads, weights))):
        chunk = ring.chunk(g, dest)
        part = _input_grad(form, _rows(chunk), w).view(*chunk.shape[:-1], x.shape[-1]).to(x.dtype)
        total = part if total is None else total + part
    return total


# ------------------------------------------------------------------ GEMM, then reduce-scatter


class _MatmulReduceScatter(torch.autograd.Function):
    """``reduce_scatter(form(h, W))`` along the token dim in t ring steps."""

    @staticmethod
    def forward(ctx, h, w, tp, dim, segments, form):
        ring = _Ring(tp, dim, segments)
        incoming, out = None, None
        for step in range(ring.t):
            part = _product(form, ring.chunk(h, (ring.rank + step + 1) % ring.t), w, None)
            out = part if incoming is None else ring.arrived(incoming) + part
            incoming = ring.pass_left(out) if step < ring.t - 1 else None
        ctx.ring, ctx.form, ctx.autocast = ring, form, _autocast_state(h)
        ctx.save_for_backward(h, w)
        return out

    @staticmethod
    def backward(ctx, grad):
        ring, form, (need_h, need_w) = ctx.ring, ctx.form, ctx.needs_input_grad[:2]
        h, w = ctx.saved_tensors
        with _autocast(ctx.autocast):
            pieces: list[torch.Tensor | None] = [None] * ring.t
            h_pieces: list[torch.Tensor | None] = [None] * ring.t
            current = grad.contiguous()
            for step in range(ring.t):
                message = ring.pass_right(current) if step < ring.t - 1 else None
                src = (ring.rank - step) % ring.t
                pieces[src] = current
                if need_h:
                    h_pieces[src] = _input_grad(form, _rows(current), w).view(*current.shape[:-1], h.shape[-1])
                if message is not None:
                    current = ring.arrived(message)
            grad_w = _weight_grad(form, _rows(ring.whole(pieces)), _rows(h)) if need_w else None
            grad_h = ring.whole(h_pieces) if need_h else None
        return grad_h, grad_w, None, None, None, None


# ------------------------------------------------------------------ the graph's ops


def _out_features(form: str, w: torch.Tensor) -> int:
    return w.shape[0] if form == "linear" else w.shape[1]


def _gathered_bytes(node: fx.Node) -> int:
    """The bytes of the value ``all_gather_matmul`` gathers (on one rank): every token's input."""
    x, outs = local_val(node.args[0]), local_val(node)
    return math.prod(outs[0].shape[:-1]) * x.shape[-1] * x.element_size()


def _gather_matmul_flops(node: fx.Node) -> float:
    x, outs = local_val(node.args[0]), local_val(node)
    return sum(matmul_flops(1, math.prod(y.shape[:-1]), y.shape[-1], x.shape[-1]) for y in outs)


def _reduced_bytes(node: fx.Node) -> int:
    """The bytes ``matmul_reduce_scatter`` reduces (on one rank): the GEMM's partial output, every token."""
    h, w, form = local_val(node.args[0]), local_val(node.args[1]), node.args[5]
    return math.prod(h.shape[:-1]) * _out_features(form, w) * local_val(node).element_size()


def _matmul_scatter_flops(node: fx.Node) -> float:
    h, w, form = local_val(node.args[0]), local_val(node.args[1]), node.args[5]
    return matmul_flops(1, math.prod(h.shape[:-1]), _out_features(form, w), h.shape[-1])


def _unfused(tp: TPGroup) -> bool:
    """Run the collective whole and the GEMMs after (or before) it: one rank, or shapes only."""
    return tp.size == 1 or tp.pg is None


@collective("f (all_gather_matmul, async TP)", "fwd all-gather in ring steps under the GEMMs; bwd reduce-scatter "
            "and all-gather of the kept slice, under the GEMMs", (ALL_GATHER, REDUCE_SCATTER, ALL_GATHER),
            lambda node: 3 * _gathered_bytes(node), forward_nbytes=_gathered_bytes, flops=_gather_matmul_flops)
def all_gather_matmul(x: torch.Tensor, tp: TPGroup, dim: int, segments: tuple[int, ...] | None,
                      weights: tuple[torch.Tensor, ...], biases: tuple[torch.Tensor | None, ...],
                      forms: tuple[str, ...]) -> tuple[torch.Tensor, ...]:
    """``form_j(gather_from_sp(x), W_j, b_j)`` for every j (``_product``'s forms), the all-gather along the token
    dim ``dim`` decomposed under the GEMMs (one chunk of tokens multiplied while the next travels);
    backward likewise. This rank keeps only ``x`` for the backward, which gathers it again for the
    weights' gradients, as the unfused path does."""
    if _unfused(tp):
        full = gather_from_sp(x, tp, dim, segments)
        return tuple(_product(f, full, w, b) for f, w, b in zip(forms, weights, biases))
    params = [p for pair in zip(weights, biases) for p in pair]
    return _AllGatherMatmul.apply(x, tp, dim, segments, forms, *params)


@collective("g (matmul_reduce_scatter, async TP)", "fwd reduce-scatter in ring steps under the GEMM; bwd "
            "all-gather under the GEMM", (REDUCE_SCATTER, ALL_GATHER), lambda node: 2 * _reduced_bytes(node),
            forward_nbytes=_reduced_bytes, flops=_matmul_scatter_flops)
def matmul_reduce_scatter(h: torch.Tensor, w: torch.Tensor, tp: TPGroup, dim: int,
                          segments: tuple[int, ...] | None, form: str) -> torch.Tensor:
    """``reduce_scatter_to_sp(form(h, w))`` along the token dim ``dim`` (a bias-free GEMM): the
    row-parallel partial product computed chunk by chunk, the chunk bound for the next rank multiplied
    while the sum before it travels; backward likewise."""
    if _unfused(tp):
        return reduce_scatter_to_sp(_product(form, h, w, None), tp, dim, segments)
    return _MatmulReduceScatter.apply(h, w, tp, dim, segments, form)
