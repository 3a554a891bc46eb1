"""What one kernel costs, from the shapes a traced graph node carries: FLOPs and HBM bytes.

``linear_flops(tokens, in_f, out_f)``, ``matmul_flops``, ``attention_flops``,
``layernorm_bytes``, ... take shapes and return FLOPs or bytes (fp16 = 2 bytes
per element unless said otherwise). ``Op`` is one kernel (or one
tensor-parallel all-reduce) on one GPU with its FLOPs, bytes and, for a GEMM,
its (batch, M, N, K); ``gemm_op``, ``linear_op``, ``gemm_backward`` and
``memory_op`` build the Ops the transformer layer is made of
(``transformer.py``). How long an Op takes is ``op_times.py``'s job.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from autopar.core.flops import attention_flops, matmul_flops

__all__ = [
    "FP16", "FP32", "Op", "linear_flops", "linear_bytes", "matmul_flops", "matmul_bytes", "attention_flops",
    "attention_bytes", "elementwise_bytes", "layernorm_flops", "layernorm_bytes", "softmax_flops",
    "softmax_bytes", "cross_entropy_flops", "cross_entropy_bytes", "gemm_op", "linear_op", "gemm_backward",
    "memory_op",
]

FP16 = 2
"""Bytes per element of activations, weights and gradients (mixed precision)."""
FP32 = 4


def linear_flops(tokens: int, in_f: int, out_f: int) -> float:
    """Y (tokens, out_f) = X (tokens, in_f) @ W (in_f, out_f): 2 * tokens * in_f * out_f."""
    return 2.0 * tokens * in_f * out_f


def linear_bytes(tokens: int, in_f: int, out_f: int, dtype_bytes: int = FP16) -> float:
    """HBM traffic of a linear: read X and W once, write Y once."""
    return float(tokens * in_f + in_f * out_f + tokens * out_f) * dtype_bytes


def matmul_bytes(batch: int, m: int, n: int, k: int, dtype_bytes: int = FP16) -> float:
    return float(batch) * (m * k + k * n + m * n) * dtype_bytes


def attention_bytes(batch: int, heads: int, seq_q: int, seq_k: int, head_dim: int,
                    dtype_bytes: int = FP16) -> float:
    """Forward HBM traffic of unfused attention: the score matrix is written by
    Q K^T, read+written by softmax, read+written (+1-byte mask) by dropout and
    read by P V: 13 bytes per score in fp16, plus Q, K, V and the output."""
    scores = float(batch) * heads * seq_q * seq_k
    qkvo = float(batch) * heads * head_dim * (2 * seq_q + 2 * seq_k)
    return scores * (6.5 * dtype_bytes) + qkvo * dtype_bytes


def elementwise_bytes(numel: float, reads: float = 1, writes: float = 1, dtype_bytes: int = FP16,
                      mask_bytes: float = 0) -> float:
    """An element-wise kernel reads ``reads`` and writes ``writes`` tensors of
    ``numel`` elements, plus ``mask_bytes`` per element (a dropout mask is 1)."""
    return float(numel) * ((reads + writes) * dtype_bytes + mask_bytes)


def layernorm_flops(tokens: int, hidden: int) -> float:
    """Mean, variance, normalise, scale and shift: about 8 FLOPs per element."""
    return 8.0 * tokens * hidden


def layernorm_bytes(tokens: int, hidden: int, dtype_bytes: int = FP16) -> float:
    return elementwise_bytes(tokens * hidden, 1, 1, dtype_bytes)


def softmax_flops(rows: float, cols: int) -> float:
    """Scale, mask, max, subtract, exp, sum, divide: about 5 FLOPs per element."""
    return 5.0 * rows * cols


def softmax_bytes(rows: float, cols: int, dtype_bytes: int = FP16) -> float:
    return elementwise_bytes(rows * cols, 1, 1, dtype_bytes)


def cross_entropy_flops(tokens: int, vocab: int) -> float:
    """Max, subtract, exp, sum, divide over the logits: about 5 FLOPs per logit."""
    return 5.0 * tokens * vocab


def cross_entropy_bytes(tokens: int, vocab: int) -> float:
    """Megatron's fp32 vocabulary-parallel cross-entropy, forward: cast the fp16
    logits to fp32 (2 + 4 bytes), max (4), subtract in place (8), exp in place
    (8), sum (4), divide in place (8) = 38 bytes per logit."""
    return 38.0 * tokens * vocab


@dataclass(frozen=True)
class Op:
    """One kernel (or one collective) on one GPU."""

    name: str
    """What it is, e.g. ``fc1``, ``fc1.dX``, ``softmax``."""
    kind: str
    """``gemm``, ``memory`` (bandwidth-bound) or ``tp_allreduce``."""
    flops: float = 0.0
    """Floating-point operations."""
    bytes: float = 0.0
    """HBM bytes moved (for ``tp_allreduce``: the size of the reduced tensor)."""
    gemm: tuple[int, int, int, int] | None = None
    """(batch, M, N, K) for a GEMM: C (M, N) = A (M, K) B (K, N)."""
    weight_grad: bool = False
    """A weight's gradient GEMM (``dB`` of a linear): the work a zero-bubble schedule's W runs;
    everything else of a backward is its B (``zero_bubble_costs.py``)."""
    elements: float = 0.0
    """Elements an element-wise kernel (``memory_op``) runs over: what ``transformer.op_by_op`` splits."""
    attention: bool = False
    """One of the attention core's kernels (scores, softmax, dropout, context, and their backward): the
    work ring attention splits into blocks and hides its transfers behind (``ring_costs``)."""


def gemm_op(name: str, batch: int, m: int, n: int, k: int, accumulate: bool = False) -> Op:
    """C (M, N) = A (M, K) B (K, N), ``batch`` times; ``accumulate``: C is added into an
    existing buffer (read and written once more)."""
    extra = batch * m * n * FP16 if accumulate else 0
    return Op(name, "gemm", matmul_flops(batch, m, n, k), matmul_bytes(batch, m, n, k) + extra,
              (batch, m, n, k))


def linear_op(name: str, tokens: int, in_f: int, out_f: int) -> Op:
    """Y (tokens, out_f) = X (tokens, in_f) W (in_f, out_f) as a GEMM."""
    return gemm_op(name, 1, tokens, out_f, in_f)


def gemm_backward(op: Op, weight: bool = True) -> list[Op]:
    """C = A B  ->  dA = dC B^T (M, K, N) and dB = A^T dC (K, N, M).

    A weight gradient (``weight=True``) accumulates into the gradient buffer,
    so it also reads and writes the (K, N) output once more, and is marked ``weight_grad``.
    """
    b, m, n, k = op.gemm
    d_b = gemm_op(op.name + ".dB", b, k, n, m, accumulate=weight)
    return [gemm_op(op.name + ".dA", b, m, k, n), replace(d_b, weight_grad=weight)]


def memory_op(name: str, numel: float, reads: float, writes: float, mask: float = 0, flops_per: float = 0,
              dtype_bytes: int = FP16) -> Op:
    """A bandwidth-bound kernel over ``numel`` elements (see ``elementwise_bytes``), doing
    ``flops_per`` FLOPs per element."""
    return Op(name, "memory", flops_per * numel, elementwise_bytes(numel, reads, writes, dtype_bytes, mask),
              elements=float(numel))
