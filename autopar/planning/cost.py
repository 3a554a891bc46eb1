"""The performance model: FLOPs, bytes, time and memory of a 3D-parallel step.

Three layers, bottom up:

1. **Per-node costs from shapes.** ``linear_flops(tokens, in_f, out_f)``,
   ``matmul_flops``, ``attention_flops``, ``layernorm_bytes``, ... take the
   shapes a traced graph node has and return FLOPs or HBM bytes. ``Op`` is one
   kernel with its FLOPs, bytes and (for a GEMM) its (batch, M, N, K).
2. **A transformer layer as a list of Ops** on one GPU of a t-way
   tensor-parallel group (Megatron-LM as in the paper, 2021: fused softmax,
   materialised attention scores, LayerNorm and dropout replicated on the t
   ranks, fp32 vocabulary-parallel cross-entropy), for forward and backward.
   ``op_time`` turns an Op into seconds with a roofline: a GEMM runs at
   ``peak * gemm_efficiency(M, N, K)`` unless its bytes take longer at the
   HBM rate; everything else is bytes / achieved HBM bandwidth.
3. **A step.** ``estimate(spec, cluster, layout)`` combines the per-chunk
   forward / backward / recompute times, tensor-parallel all-reduces, pipeline
   sends (scatter/gather), the bubble, the data-parallel gradient all-reduce
   and the optimizer step into an iteration time, TFLOP/s per GPU (counted as
   the paper counts) and memory per GPU.

The paper's closed-form formulas are kept as sympy expressions in
``FORMULAS``; ``explain(estimate)`` prints each one with its value.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from functools import lru_cache

import sympy as sp

from autopar.core.flops import attention_flops, matmul_flops
from autopar.planning.hardware import Hardware, get_hardware
from autopar.planning.simulate import simulate_layout_costs

__all__ = [
    "ModelSpec", "PRESETS", "get_model", "Op", "Layout", "Cluster", "Estimate", "Memory",
    "PaperRun", "PAPER_RUNS", "fit_efficiency", "iteration_flops",
    "linear_flops", "linear_bytes", "matmul_flops", "matmul_bytes", "attention_flops",
    "attention_bytes", "elementwise_bytes", "layernorm_flops", "layernorm_bytes",
    "softmax_flops", "softmax_bytes", "cross_entropy_flops", "cross_entropy_bytes",
    "gemm_efficiency", "op_time", "allreduce_time", "allgather_time", "p2p_time",
    "PhaseOps", "layer_ops", "embedding_ops", "head_ops", "graph_flops", "paper_flops", "param_count",
    "SIMULATION_LIMIT", "Explained", "params_per_stage", "layout_errors", "estimate", "memory_per_gpu",
    "activation_bytes_per_layer", "layer_backward_transient",
    "inflight_units", "FORMULAS", "explain",
]

FP16 = 2
"""Bytes per element of activations, weights and gradients (mixed precision)."""
FP32 = 4

# ---------------------------------------------------------------------------- model


@dataclass(frozen=True)
class ModelSpec:
    """A GPT-shaped decoder given by its dimensions."""

    layers: int
    """Transformer blocks, l."""
    hidden: int
    """Hidden size, h."""
    heads: int
    """Attention (query) heads, a."""
    seq_len: int = 2048
    """Sequence length, s."""
    vocab: int = 51200
    """Vocabulary size, V (already padded as Megatron pads it)."""
    ffn: int | None = None
    """MLP inner size; None means 4h."""
    kv_heads: int | None = None
    """Key/value heads (grouped-query attention); None means ``heads``."""
    gated_mlp: bool = False
    """SwiGLU-style MLP (three projections) instead of GeLU (two)."""
    name: str = ""
    """Display name, e.g. ``gpt-39b``."""

    def __post_init__(self) -> None:
        if self.hidden % self.heads:
            raise ValueError(f"hidden ({self.hidden}) must be a multiple of heads ({self.heads})")
        if self.heads % self.kv:
            raise ValueError(f"heads ({self.heads}) must be a multiple of kv_heads ({self.kv})")
        if min(self.layers, self.hidden, self.heads, self.seq_len, self.vocab) <= 0:
            raise ValueError(f"all dimensions must be positive: {self}")

    @property
    def ffn_size(self) -> int:
        return self.ffn or 4 * self.hidden

    @property
    def kv(self) -> int:
        return self.kv_heads or self.heads

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads

    @property
    def is_paper_gpt(self) -> bool:
        """True when the paper's closed-form formulas apply exactly (4h GeLU MLP, MHA)."""
        return self.ffn_size == 4 * self.hidden and self.kv == self.heads and not self.gated_mlp

    @property
    def label(self) -> str:
        return self.name or f"l{self.layers}-h{self.hidden}-a{self.heads}"


def _gpt(name: str, layers: int, hidden: int, heads: int) -> ModelSpec:
    return ModelSpec(layers=layers, hidden=hidden, heads=heads, name=name)


PRESETS: dict[str, ModelSpec] = {
    # The paper's weak-scaling table (seq 2048, vocab 51200). The first six are
    # the calibration rows; the last four are held out (never fitted).
    "gpt-1.7b": _gpt("gpt-1.7b", 24, 2304, 24),
    "gpt-3.6b": _gpt("gpt-3.6b", 30, 3072, 32),
    "gpt-7.5b": _gpt("gpt-7.5b", 36, 4096, 32),
    "gpt-18b": _gpt("gpt-18b", 40, 6144, 48),
    "gpt-39b": _gpt("gpt-39b", 48, 8192, 64),
    "gpt-76b": _gpt("gpt-76b", 60, 10240, 80),
    "gpt-145b": _gpt("gpt-145b", 80, 12288, 96),
    "gpt-310b": _gpt("gpt-310b", 96, 16384, 128),
    "gpt-530b": _gpt("gpt-530b", 105, 20480, 128),
    "gpt-1t": _gpt("gpt-1t", 128, 25600, 160),
}
_ALIASES = {"gpt-18.4b": "gpt-18b", "gpt-39.1b": "gpt-39b", "gpt-76.1b": "gpt-76b",
            "gpt-145.6b": "gpt-145b", "gpt-310.1b": "gpt-310b", "gpt-529.6b": "gpt-530b",
            "gpt-1008b": "gpt-1t"}


def get_model(name: str) -> ModelSpec:
    """The preset called ``name``; the error lists the known ones."""
    key = _ALIASES.get(name.lower(), name.lower())
    if key not in PRESETS:
        raise ValueError(f"unknown model preset {name!r}; known: {', '.join(PRESETS)}")
    return PRESETS[key]


def param_count(spec: ModelSpec) -> int:
    """Exact parameter count (weights and biases, tied embedding counted once).

    For the paper's GPT this is ``12 l h^2 (1 + 13/(12 h) + (V + s)/(12 l h)) + 2h``
    (the 2h is the final LayerNorm, which the paper's formula leaves out).
    """
    return spec.layers * _layer_params(spec, 1)[0] + (spec.vocab + spec.seq_len) * spec.hidden + 2 * spec.hidden


def _layer_params(spec: ModelSpec, t: int) -> tuple[int, int]:
    """(parameters of one layer held by one of t ranks, of which replicated)."""
    h, n, f = spec.hidden, spec.head_dim, spec.ffn_size
    qkv = (spec.heads + 2 * spec.kv) * n
    split = h * qkv + qkv + h * h  # QKV weight + bias (column-split), proj weight (row-split)
    n_in = 2 if spec.gated_mlp else 1
    split += n_in * (h * f + f) + f * h  # fc1 (+gate) weight + bias, fc2 weight
    replicated = h + h + 4 * h  # proj bias, fc2 bias (added after the reduction), 2 LayerNorms
    return split // t + replicated, replicated


def params_per_stage(spec: ModelSpec, t: int, p: int) -> list[int]:
    """Parameters held by one GPU of each pipeline stage 0..p-1.

    Layers are spread evenly (the largest stage gets ceil(l/p)); stage 0 holds
    the vocabulary-parallel word embedding (V h / t) and the position embedding
    (s h, replicated); the last stage holds the final LayerNorm and, when p > 1,
    its own copy of the tied word embedding for the LM head.
    """
    per_layer = _layer_params(spec, t)[0]
    base, extra = divmod(spec.layers, p)
    out = []
    for r in range(p):
        n = (base + (1 if r < extra else 0)) * per_layer
        if r == 0:
            n += math.ceil(spec.vocab / t) * spec.hidden + spec.seq_len * spec.hidden
        if r == p - 1:
            n += 2 * spec.hidden + (math.ceil(spec.vocab / t) * spec.hidden if p > 1 else 0)
        out.append(n)
    return out


# ----------------------------------------------------------------- per-node costs


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


# ------------------------------------------------------------------------ ops


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


def _gemm(name: str, batch: int, m: int, n: int, k: int, accumulate: bool = False) -> Op:
    extra = batch * m * n * FP16 if accumulate else 0
    return Op(name, "gemm", matmul_flops(batch, m, n, k), matmul_bytes(batch, m, n, k) + extra,
              (batch, m, n, k))


def _linear(name: str, tokens: int, in_f: int, out_f: int) -> Op:
    return _gemm(name, 1, tokens, out_f, in_f)


def _gemm_backward(op: Op, weight: bool = True) -> list[Op]:
    """C = A B  ->  dA = dC B^T (M, K, N) and dB = A^T dC (K, N, M).

    A weight gradient (``weight=True``) accumulates into the gradient buffer,
    so it also reads and writes the (K, N) output once more.
    """
    b, m, n, k = op.gemm
    return [_gemm(op.name + ".dA", b, m, k, n), _gemm(op.name + ".dB", b, k, n, m, accumulate=weight)]


def _mem(name: str, numel: float, reads: float, writes: float, mask: float = 0, flops_per: float = 0,
         dtype_bytes: int = FP16) -> Op:
    return Op(name, "memory", flops_per * numel, elementwise_bytes(numel, reads, writes, dtype_bytes, mask))


@dataclass(frozen=True)
class PhaseOps:
    """The kernels of one model piece on one GPU, in execution order."""

    forward: tuple[Op, ...]
    """Forward pass (also what recomputation runs again)."""
    backward: tuple[Op, ...]
    """Backward pass (input and weight gradients, f's all-reduces)."""


@lru_cache(maxsize=4096)
def layer_ops(spec: ModelSpec, b: int, t: int) -> PhaseOps:
    """One transformer layer on one of t tensor-parallel GPUs, micro-batch b.

    Forward (Megatron-LM, 2021; T = b s tokens; "_l" = local to one rank):
      LN -> QKV (T, h)x(h, (a+2kv) d / t) -> scores (b a_l, s, s) = Q K^T
      -> fused scale/mask/softmax -> dropout -> context (b a_l, s, d) = P V
      -> permute -> proj (T, h/t)x(h/t, h) -> all-reduce (g) -> bias+dropout+residual
      -> LN -> fc1 (T, h)x(h, f/t) -> bias+GeLU -> fc2 (T, f/t)x(f/t, h)
      -> all-reduce (g) -> bias+dropout+residual.
    LayerNorm, dropout and residual work on the full (T, h) on every rank (no
    sequence parallelism in the paper). Backward: two GEMMs per GEMM, the
    element-wise backward kernels, and the all-reduces of f (before QKV, fc1).
    """
    s, h, n = spec.seq_len, spec.hidden, spec.head_dim
    T = b * s
    a_l = spec.heads // t
    kv_l = spec.kv // t
    qkv_l = (spec.heads + 2 * spec.kv) * n // t
    h_l = a_l * n
    f_l = spec.ffn_size // t
    scores = b * a_l * s * s
    tp = t > 1
    gqa_repeat = spec.heads != spec.kv

    qkv = _linear("qkv", T, h, qkv_l)
    qk = _gemm("scores", b * a_l, s, s, n)
    pv = _gemm("context", b * a_l, s, n, s)
    proj = _linear("proj", T, h_l, h)
    fc1 = _linear("fc1", T, h, f_l * (2 if spec.gated_mlp else 1))
    fc2 = _linear("fc2", T, f_l, h)
    ar = Op("allreduce", "tp_allreduce", 0.0, T * h * FP16)

    fwd: list[Op] = [
        _mem("ln1", T * h, 1, 1, flops_per=8),
        qkv,
    ]
    if gqa_repeat:
        fwd.append(_mem("kv_repeat", b * s * 2 * a_l * n, 0.5 * kv_l / a_l, 1))
    fwd += [
        qk,
        _mem("softmax", scores, 1, 1, flops_per=5),
        _mem("attn_dropout", scores, 1, 1, mask=1),
        pv,
        _mem("context_permute", T * h_l, 1, 1),
        proj,
    ]
    if tp:
        fwd.append(ar)
    fwd += [
        _mem("bias_dropout_add1", T * h, 2, 1, mask=1, flops_per=3),
        _mem("ln2", T * h, 1, 1, flops_per=8),
        fc1,
        _mem("bias_act", T * f_l * (2 if spec.gated_mlp else 1), 1, 0.5 if spec.gated_mlp else 1,
             flops_per=8),
        fc2,
    ]
    if tp:
        fwd.append(ar)
    fwd.append(_mem("bias_dropout_add2", T * h, 2, 1, mask=1, flops_per=3))

    bwd: list[Op] = [
        _mem("bias_dropout_add2.bwd", T * h, 1, 1, mask=1),
        *_gemm_backward(fc2),
        _mem("bias_act.bwd", T * f_l * (2 if spec.gated_mlp else 1), 1.5 if spec.gated_mlp else 2,
             1, flops_per=8),
        *_gemm_backward(fc1),
    ]
    if tp:
        bwd.append(ar)  # f before fc1
    bwd += [
        _mem("ln2.bwd", T * h, 2, 1, flops_per=8),
        _mem("residual_grad_add", T * h, 2, 1, flops_per=1),
        _mem("bias_dropout_add1.bwd", T * h, 1, 1, mask=1),
        *_gemm_backward(proj),
        _mem("context_permute.bwd", T * h_l, 1, 1),
        *_gemm_backward(pv, weight=False),
        _mem("attn_dropout.bwd", scores, 1, 1, mask=1),
        _mem("softmax.bwd", scores, 2, 1, flops_per=4),
        *_gemm_backward(qk, weight=False),
    ]
    if gqa_repeat:
        bwd.append(_mem("kv_repeat.bwd", b * s * 2 * a_l * n, 1, 0.5 * kv_l / a_l))
    bwd += _gemm_backward(qkv)
    if tp:
        bwd.append(ar)  # f before QKV
    bwd += [
        _mem("ln1.bwd", T * h, 2, 1, flops_per=8),
        _mem("residual_grad_add", T * h, 2, 1, flops_per=1),
    ]
    return PhaseOps(tuple(fwd), tuple(bwd))


@lru_cache(maxsize=1024)
def embedding_ops(spec: ModelSpec, b: int, t: int) -> PhaseOps:
    """Vocabulary-parallel word embedding + position embedding + dropout (stage 0)."""
    T, h = b * spec.seq_len, spec.hidden
    fwd = [_mem("wte_lookup", T * h, 1, 1)]
    if t > 1:
        fwd.append(Op("wte_allreduce", "tp_allreduce", 0.0, T * h * FP16))
    fwd += [_mem("wpe_add", T * h, 2, 1, flops_per=1), _mem("emb_dropout", T * h, 1, 1, mask=1)]
    bwd = [
        _mem("emb_dropout.bwd", T * h, 1, 1, mask=1),
        _mem("wpe.bwd", T * h, 1, 0),
        _mem("wte.bwd", T * h, 2, 1),  # scatter-add rows into the gradient
    ]
    return PhaseOps(tuple(fwd), tuple(bwd))


@lru_cache(maxsize=1024)
def head_ops(spec: ModelSpec, b: int, t: int) -> PhaseOps:
    """Final LayerNorm, LM head (T, h) x (h, V/t), fp32 vocabulary-parallel
    cross-entropy (three all-reduces of T floats, latency only), last stage."""
    T, h = b * spec.seq_len, spec.hidden
    V_l = math.ceil(spec.vocab / t)
    logits = _linear("lm_head", T, h, V_l)
    fwd = [
        _mem("ln_f", T * h, 1, 1, flops_per=8),
        logits,
        Op("cross_entropy", "memory", cross_entropy_flops(T, V_l), cross_entropy_bytes(T, V_l)),
    ]
    if t > 1:
        fwd += [Op(f"ce_allreduce{i}", "tp_allreduce", 0.0, T * FP32) for i in range(3)]
    bwd = [
        # softmax - onehot, scaled by the loss gradient in place (8 B), cast back to fp16 (6 B)
        Op("cross_entropy.bwd", "memory", 2.0 * T * V_l, 14.0 * T * V_l),
        *_gemm_backward(logits),
    ]
    if t > 1:
        bwd.append(Op("lm_head_allreduce", "tp_allreduce", 0.0, T * h * FP16))
    bwd.append(_mem("ln_f.bwd", T * h, 2, 1, flops_per=8))
    return PhaseOps(tuple(fwd), tuple(bwd))


def graph_flops(spec: ModelSpec, batch: int, recompute: bool = True) -> float:
    """FLOPs of one iteration summed node by node (t = 1): every layer's
    forward, backward and (with recomputation) second forward, plus the
    embedding and the head. Agrees with ``paper_flops`` within 2% on a GPT."""
    lay = layer_ops(spec, 1, 1)
    per_layer = sum(o.flops for o in lay.forward) * (2 if recompute else 1) + sum(o.flops for o in lay.backward)
    emb, head = embedding_ops(spec, 1, 1), head_ops(spec, 1, 1)
    rest = sum(o.flops for o in emb.forward + emb.backward + head.forward + head.backward)
    return batch * (spec.layers * per_layer + rest)


def paper_flops(spec: ModelSpec, batch: int, recompute: bool = True) -> float:
    """The paper's count: ``96 B s l h^2 (1 + s/(6h) + V/(16 l h))``; 72 without recomputation."""
    s, l, h, V = spec.seq_len, spec.layers, spec.hidden, spec.vocab
    lead = 96 if recompute else 72
    # the logit layer (6 B s h V) is never recomputed
    return lead * batch * s * l * h * h * (1 + s / (6 * h)) + 6.0 * batch * s * h * V


def iteration_flops(spec: ModelSpec, batch: int, recompute: bool = True) -> float:
    """FLOPs that throughput is counted with: the paper's formula on a paper-shaped
    GPT (as the paper counts), the node-by-node sum otherwise."""
    return paper_flops(spec, batch, recompute) if spec.is_paper_gpt else graph_flops(spec, batch, recompute)


# ------------------------------------------------------------------ op timing


def gemm_efficiency(m: int, n: int, k: int, hw: Hardware, batch: int = 1) -> float:
    """Fraction of peak a GEMM (batch, M, N, K) reaches.

    eff = eff_gemm * fill * K / (K + K0), where
      - fill: the output is cut into 256x128 tiles (the long side along the
        longer of M, N) that run in waves of ``sm_count``; the last wave and
        the padding of partial tiles are wasted:
        fill = batch M N / (waves * sm_count * 256 * 128);
      - K / (K + K0): each tile pays a fixed prologue/epilogue worth K0 steps
        of its K loop (matters for the K = head_dim attention matmul).
    """
    tm, tn = (256, 128) if m >= n else (128, 256)
    tiles = batch * math.ceil(m / tm) * math.ceil(n / tn)
    waves = math.ceil(tiles / hw.sm_count)
    fill = batch * m * n / (waves * hw.sm_count * tm * tn)
    return hw.eff.gemm * fill * k / (k + hw.eff.gemm_k_overhead)


def op_time(op: Op, hw: Hardware, t: int = 1) -> float:
    """Seconds for one Op on one GPU (roofline for GEMMs, bandwidth otherwise)."""
    e = hw.eff
    if op.kind == "gemm":
        b, m, n, k = op.gemm
        compute = op.flops / (hw.peak_flops * gemm_efficiency(m, n, k, hw, b))
        return max(compute, op.bytes / (hw.hbm_bw * e.hbm)) + e.kernel_overhead
    if op.kind == "memory":
        return op.bytes / (hw.hbm_bw * e.hbm) + e.kernel_overhead
    if op.kind == "tp_allreduce":
        return allreduce_time(op.bytes, t, _intra_bw(hw), hw.nvlink_latency)
    raise ValueError(f"unknown op kind {op.kind!r} for {op.name}")


def _intra_bw(hw: Hardware) -> float:
    return hw.nvlink_bw * hw.nvlink_efficiency


def _inter_bw(hw: Hardware) -> float:
    return hw.ib_bw * hw.ib_efficiency


def allreduce_time(nbytes: float, n: int, bw: float, latency: float) -> float:
    """Ring all-reduce of ``nbytes`` over n ranks: 2 (n-1)/n * bytes / bw + 2 (n-1) latency."""
    if n <= 1:
        return 0.0
    return 2 * (n - 1) / n * nbytes / bw + 2 * (n - 1) * latency


def allgather_time(nbytes: float, n: int, bw: float, latency: float) -> float:
    """Ring all-gather of a tensor of ``nbytes`` in total: (n-1)/n * bytes / bw + (n-1) latency."""
    if n <= 1:
        return 0.0
    return (n - 1) / n * nbytes / bw + (n - 1) * latency


def p2p_time(nbytes: float, bw: float, latency: float) -> float:
    """One point-to-point message."""
    return nbytes / bw + latency


@dataclass(frozen=True)
class _PhaseTime:
    gemm: float = 0.0
    memory: float = 0.0
    comm: float = 0.0

    @property
    def total(self) -> float:
        return self.gemm + self.memory + self.comm

    def __add__(self, o: "_PhaseTime") -> "_PhaseTime":
        return _PhaseTime(self.gemm + o.gemm, self.memory + o.memory, self.comm + o.comm)

    def __mul__(self, k: float) -> "_PhaseTime":
        return _PhaseTime(self.gemm * k, self.memory * k, self.comm * k)


def _phase_time(ops: tuple[Op, ...], hw: Hardware, t: int) -> _PhaseTime:
    g = m = c = 0.0
    for op in ops:
        x = op_time(op, hw, t)
        if op.kind == "gemm":
            g += x
        elif op.kind == "memory":
            m += x
        else:
            c += x
    return _PhaseTime(g, m, c)


@lru_cache(maxsize=8192)
def _times(spec: ModelSpec, hw: Hardware, b: int, t: int) -> dict[str, _PhaseTime]:
    lay, emb, head = layer_ops(spec, b, t), embedding_ops(spec, b, t), head_ops(spec, b, t)
    return {
        "layer_f": _phase_time(lay.forward, hw, t), "layer_b": _phase_time(lay.backward, hw, t),
        "emb_f": _phase_time(emb.forward, hw, t), "emb_b": _phase_time(emb.backward, hw, t),
        "head_f": _phase_time(head.forward, hw, t), "head_b": _phase_time(head.backward, hw, t),
    }


# ------------------------------------------------------------------- layouts


SCHEDULES = ("1f1b", "interleaved", "gpipe")
RECOMPUTE = ("full", "none")


@dataclass(frozen=True)
class Cluster:
    """The machines: how many GPUs of which kind, and the global batch to train."""

    gpus: int
    """Total GPUs, n."""
    hardware: Hardware
    """Node profile."""
    global_batch: int
    """Sequences per optimizer step, B."""

    @classmethod
    def of(cls, gpus: int, hardware: str | Hardware, global_batch: int) -> "Cluster":
        hw = get_hardware(hardware) if isinstance(hardware, str) else hardware
        return cls(gpus, hw, global_batch)


@dataclass(frozen=True)
class Layout:
    """One way to run: parallel degrees, micro-batch, schedule, recomputation."""

    t: int
    """Tensor-parallel degree (inside a node)."""
    p: int
    """Pipeline stages."""
    d: int
    """Data-parallel replicas."""
    b: int
    """Micro-batch size (sequences)."""
    v: int = 1
    """Model chunks per pipeline stage (interleaved schedule when > 1)."""
    schedule: str = ""
    """``1f1b``, ``interleaved`` or ``gpipe``; empty means interleaved if v > 1 else 1f1b."""
    recompute: str = "full"
    """Activation recomputation: ``full`` (every layer) or ``none``."""
    scatter_gather: bool = True
    """Send 1/t of each boundary activation and all-gather it over NVLink."""
    dp_overlap: bool = False
    """Overlap the data-parallel gradient all-reduce with the last backward."""

    def __post_init__(self) -> None:
        if not self.schedule:
            object.__setattr__(self, "schedule", "interleaved" if self.v > 1 else "1f1b")
        if self.schedule not in SCHEDULES:
            raise ValueError(f"schedule must be one of {SCHEDULES}, got {self.schedule!r}")
        if self.recompute not in RECOMPUTE:
            raise ValueError(f"recompute must be one of {RECOMPUTE}, got {self.recompute!r}")
        if min(self.t, self.p, self.d, self.b, self.v) < 1:
            raise ValueError(f"all degrees must be >= 1: {self}")
        if self.schedule == "1f1b" and self.v != 1:
            raise ValueError(f"1f1b runs one chunk per stage (v=1), got v={self.v}; use 'interleaved'")

    @property
    def short(self) -> str:
        parts = [f"t={self.t}", f"p={self.p}", f"d={self.d}", f"b={self.b}"]
        if self.v > 1:
            parts.append(f"v={self.v}")
        if self.p > 1:
            parts.append({"1f1b": "1F1B", "interleaved": "int", "gpipe": "GPipe"}[self.schedule])
        if self.recompute != "full":
            parts.append("no-rc")
        return " ".join(parts)


def layout_errors(spec: ModelSpec, cluster: Cluster, lay: Layout, divisible_layers: bool = True) -> list[str]:
    """Every rule ``lay`` breaks, each naming the numbers and the fix (empty if valid)."""
    errs = []
    hw = cluster.hardware
    if lay.t * lay.p * lay.d != cluster.gpus:
        errs.append(f"t({lay.t}) * p({lay.p}) * d({lay.d}) = {lay.t * lay.p * lay.d}, "
                    f"but the cluster has {cluster.gpus} GPUs")
    if lay.t > hw.gpus_per_node or hw.gpus_per_node % lay.t:
        errs.append(f"t={lay.t} must divide the {hw.gpus_per_node} GPUs of a node (tensor parallelism stays on NVLink)")
    if spec.heads % lay.t or spec.kv % lay.t:
        errs.append(f"heads ({spec.heads}, kv {spec.kv}) must be divisible by t={lay.t}")
    if spec.ffn_size % lay.t:
        errs.append(f"ffn ({spec.ffn_size}) must be divisible by t={lay.t}")
    chunks = lay.p * lay.v
    if spec.layers < chunks:
        errs.append(f"{spec.layers} layers cannot fill p*v = {lay.p}*{lay.v} = {chunks} chunks")
    elif divisible_layers and spec.layers % chunks:
        errs.append(f"layers ({spec.layers}) must be divisible by p*v = {chunks}")
    if lay.v > 1 and lay.p == 1:
        errs.append(f"v={lay.v} needs a pipeline (p > 1)")
    B = cluster.global_batch
    if B % (lay.d * lay.b):
        errs.append(f"global batch {B} is not divisible by d*b = {lay.d}*{lay.b} = {lay.d * lay.b}")
    else:
        m = B // (lay.d * lay.b)
        if lay.schedule == "interleaved" and m % lay.p:
            errs.append(f"interleaved schedule needs microbatches m = B/(d b) = {m} to be a multiple of p = {lay.p}")
        elif lay.schedule != "gpipe" and m < lay.p:
            errs.append(f"{lay.schedule} needs at least one microbatch per stage: m = B/(d b) = {m} < p = {lay.p}")
    return errs


# ------------------------------------------------------------------- memory


def activation_bytes_per_layer(spec: ModelSpec, b: int, t: int) -> float:
    """Bytes one layer keeps for its backward without recomputation (fp16, 1-byte
    dropout masks, no sequence parallelism; Korthikanti et al. 2022, eq. 2):
    ``s b h (10 + 24/t + 5 a s / (h t))`` for the paper's GPT, generalised to
    any MLP width and key/value head count."""
    s, h, n = spec.seq_len, spec.hidden, spec.head_dim
    q, kv, f = spec.heads * n, spec.kv * n, spec.ffn_size
    replicated = 10 * h  # 2 LN inputs (4h), QKV input (2h), fc1 input (2h), 2 dropout masks (2h)
    attn_split = 2 * (q + 2 * kv) + 2 * q  # Q, K, V and the proj input
    mlp_split = (3 if spec.gated_mlp else 2) * 2 * f  # activation inputs and fc2 input
    scores = 5 * spec.heads * s  # softmax output (2), dropout mask (1), dropout output (2)
    return s * b * (replicated + (attn_split + mlp_split + scores) / t)


def inflight_units(schedule: str, p: int, v: int, m: int, rank: int) -> int:
    """Chunk-microbatch activations alive at once on ``rank`` (closed forms)."""
    if schedule == "gpipe":
        return m * v
    if schedule == "1f1b":
        return min(p - rank, m)
    warmup = (p - rank - 1) * 2 + (v - 1) * p
    return min(warmup + 1, m * v)


@dataclass(frozen=True)
class Memory:
    """Bytes per GPU on the fullest pipeline stage."""

    weights: float
    """fp16 parameters."""
    grads: float
    """fp16 gradients."""
    optimizer: float
    """fp32 master weights + Adam m and v (12 bytes per parameter)."""
    activations: float
    """Peak activations (stored checkpoints or full activations, working set, logits), or
    the fp32 gradient copy of the optimizer step when that is larger."""
    stage: int
    """The stage these numbers are for (the one with the most memory)."""
    buffers: float = 0.0
    """PyTorch DDP's gradient buckets (a second fp16 copy of the gradients) when the
    gradient all-reduce overlaps the backward; 0 with Megatron's local DDP."""

    @property
    def total(self) -> float:
        return self.weights + self.grads + self.optimizer + self.buffers + self.activations


def layer_backward_transient(spec: ModelSpec, b: int, t: int) -> float:
    """Bytes a layer's backward allocates on top of its stored activations, at its peak.

    Two candidate moments (fp16, no sequence parallelism):
      - fc2's backward makes the gradient of the GeLU output, ``2 b s f/t`` bytes,
        while every stored activation of the layer is still alive;
      - in attention, ``P V``'s backward makes the gradient of the dropped-out
        probabilities, ``2 b (a/t) s^2`` bytes (the fused softmax backward then
        works in place), while the MLP block's stored activations (fc1 input 2h,
        GeLU input and fc2 input 2 x 2f/t, dropout mask h) and LN2's input (2h)
        have already been released.
    """
    s, h, f = spec.seq_len, spec.hidden, spec.ffn_size
    n_act = 3 if spec.gated_mlp else 2
    mlp_grad = FP16 * b * s * (n_act - 1) * f / t
    released = s * b * (5 * h + n_act * 2 * f / t)
    attn_grad = FP16 * b * (spec.heads / t) * s * s
    return max(mlp_grad, attn_grad - released, 0.0)


def memory_per_gpu(spec: ModelSpec, lay: Layout, m: int, inflight: list[int] | None = None) -> Memory:
    """Peak memory of the fullest stage.

    Model state: 16 bytes per local parameter (fp16 weights and grads, fp32
    master, Adam m and v: mixed-precision Adam), plus, when the gradient
    all-reduce overlaps the backward (PyTorch DDP, ``lay.dp_overlap`` with
    d > 1), DDP's bucket buffers: a second fp16 copy of the gradients (2 bytes).

    Activations at their peak = what the in-flight microbatches keep + the
    larger of two working sets that never coexist:
      - stored: with ``recompute=full`` each in-flight chunk-microbatch keeps
        its layers' inputs (2 b s h bytes each); with ``none`` every in-flight
        layer keeps all its activations (``activation_bytes_per_layer``); in a
        pipeline each in-flight chunk also keeps its output (2 b s h) until its
        backward (Megatron-LM 2021 backpropagates from it; the last chunk's
        output is the loss);
      - a layer's backward: (recompute=full) the layer re-materialised,
        plus ``layer_backward_transient``, plus the incoming and outgoing
        gradients (2 x 2 b s h);
      - the loss (last stage): the fp32 softmax of the vocabulary-parallel
        cross-entropy and the fp16 logits / logit gradient (6 bytes per local
        logit), the LM head's and final LayerNorm's inputs (2 x 2 b s h);
      - stage 0 also keeps the embedding's output (2 b s h; its dropout mask).
    The optimizer step makes an fp32 copy of the gradients (4 bytes per
    parameter) only after the activations are freed, so it competes with them:
    the activation entry is max(activations, 4 P).
    ``inflight`` overrides the closed-form count of in-flight units per stage.
    """
    t, p, v, b = lay.t, lay.p, lay.v, lay.b
    s, h = spec.seq_len, spec.hidden
    T = b * s
    params = params_per_stage(spec, t, p)
    chunk_layers = math.ceil(spec.layers / (p * v))
    full_layer = activation_bytes_per_layer(spec, b, t)
    transient = layer_backward_transient(spec, b, t)
    ckpt = FP16 * T * h
    ddp = FP16 if (lay.dp_overlap and lay.d > 1) else 0.0
    best: Memory | None = None
    # in-flight counts fall with the stage index and only the ends hold embeddings,
    # so the first and last stage are the candidates unless counts are given
    for r in (range(p) if inflight is not None else sorted({0, p - 1})):
        units = inflight[r] if inflight is not None else inflight_units(lay.schedule, p, v, m, r)
        if lay.recompute == "full":
            stored = units * chunk_layers * ckpt
            working = full_layer + transient + 2 * ckpt
        else:
            stored = units * chunk_layers * full_layer
            working = transient + 2 * ckpt
        if p > 1:  # each chunk's output, kept for its backward (the last chunk's is the loss)
            stored += (units - (1 if r == p - 1 else 0)) * ckpt
        if r == p - 1:
            working = max(working, T * math.ceil(spec.vocab / t) * (FP32 + FP16) + 2 * ckpt)
        act = stored + working + (ckpt if r == 0 else 0.0)
        P = params[r]
        act = max(act, FP32 * P)
        cand = Memory(FP16 * P, FP16 * P, 12.0 * P, act, r, buffers=ddp * P)
        if best is None or cand.total > best.total:
            best = cand
    return best


# ----------------------------------------------------------------- estimate


OPTIMIZER_BYTES_PER_PARAM = 52
"""HBM bytes per parameter of Megatron's mixed-precision Adam step: fp16 grad ->
fp32 copy (6), unscale + inf check (8), grad-norm (4), fused Adam reading
grad, param, m, v and writing param, m, v (28), fp32 -> fp16 param copy (6)."""

DDP_BUCKET_BYTES = 25e6
"""PyTorch DDP's bucket: with overlap, at least the last bucket's all-reduce is exposed."""


SIMULATION_LIMIT = 60_000
"""Most F/B actions (2 p v m) ``estimate(simulate=True)`` runs through the event
simulator (about a second); bigger pipelines keep the closed form."""


@dataclass(frozen=True)
class Estimate:
    """Predicted iteration of one layout: times in seconds, memory in bytes."""

    spec: ModelSpec
    cluster: Cluster
    layout: Layout
    m: int
    """Microbatches per pipeline per step, B / (d b)."""
    chunk_layers: int
    """Layers in the largest model chunk."""
    t_chunk_f: float
    """Forward of one chunk for one microbatch (incl. its tensor-parallel all-reduces)."""
    t_chunk_b: float
    """Backward of one chunk for one microbatch, incl. recomputation."""
    t_head_f: float
    t_head_b: float
    t_emb_f: float
    t_emb_b: float
    t_p2p: float
    """One stage-to-stage send (scatter/gather included), blocking as in Megatron."""
    t_pipeline: float
    """Forward/backward of all microbatches through the pipeline, bubble included."""
    bubble: float
    """Bubble fraction: idle time / busy time of a stage; (p-1)/(v m) for uniform chunks."""
    t_dp: float
    """Data-parallel gradient all-reduce, whole."""
    t_dp_exposed: float
    """The part of it not hidden behind the backward."""
    t_emb_sync: float
    """All-reduce of the tied word-embedding gradient between the first and last stage."""
    t_optimizer: float
    """Optimizer step (memory-bound)."""
    breakdown: dict[str, float]
    """Critical-path seconds by cause: gemm, memory, tp_comm, p2p, bubble, dp, optimizer."""
    memory: Memory
    flops: float
    """FLOPs of one iteration as the paper counts them."""
    sim: object = field(default=None, repr=False, compare=False)
    """The ``simulate.SimResult`` when ``t_pipeline`` and ``bubble`` come from the
    event simulator (and memory from the schedule's real in-flight peak), else None."""

    @property
    def simulated(self) -> bool:
        return self.sim is not None

    @property
    def t_iter(self) -> float:
        return self.t_pipeline + self.t_dp_exposed + self.t_emb_sync + self.t_optimizer

    @property
    def tflops_per_gpu(self) -> float:
        return self.flops / (self.t_iter * self.cluster.gpus) / 1e12

    @property
    def frac_peak(self) -> float:
        return self.tflops_per_gpu * 1e12 / self.cluster.hardware.peak_flops

    @property
    def fits(self) -> bool:
        return self.memory.total <= self.cluster.hardware.usable_bytes

    @property
    def comm_time(self) -> float:
        """Exposed communication per iteration: TP all-reduces, p2p, DP, embedding sync."""
        b = self.breakdown
        return b["tp_comm"] + b["p2p"] + b["dp"]

    def as_dict(self) -> dict:
        lay = self.layout
        return {
            "model": self.spec.label, "gpus": self.cluster.gpus, "hardware": self.cluster.hardware.name,
            "global_batch": self.cluster.global_batch,
            "t": lay.t, "p": lay.p, "d": lay.d, "v": lay.v, "b": lay.b, "m": self.m,
            "schedule": lay.schedule, "recompute": lay.recompute, "scatter_gather": lay.scatter_gather,
            "dp_overlap": lay.dp_overlap,
            "iteration_s": self.t_iter, "tflops_per_gpu": self.tflops_per_gpu, "frac_peak": self.frac_peak,
            "bubble": self.bubble, "comm_s": self.comm_time, "memory_gib": self.memory.total / 2**30,
            "fits": self.fits, "breakdown_s": dict(self.breakdown), "simulated": self.simulated,
            "memory_breakdown_gib": {k: getattr(self.memory, k) / 2**30
                                     for k in ("weights", "grads", "optimizer", "buffers", "activations")},
        }


def _dp_bandwidth(hw: Hardware, t: int, d: int) -> tuple[float, float]:
    """(bytes/s, latency) of one data-parallel group's ring.

    Ranks are laid out tp fastest, then dp: a node holds k = G / t members of a
    DP group. If the whole group fits in a node it runs over NVLink; otherwise
    each ring crosses nodes through the group's k NICs (k x ib_bw), and NVLink
    is never the bottleneck.
    """
    G = hw.gpus_per_node
    k = max(1, G // t)
    if d <= k:
        return _intra_bw(hw), hw.nvlink_latency
    return min(_intra_bw(hw), k * _inter_bw(hw)), hw.ib_latency


def _stage_link(hw: Hardware, t: int, d: int) -> tuple[float, float]:
    """(bytes/s, latency) between adjacent pipeline stages: a pp peer is t*d ranks
    away, so it is on another node once t*d >= GPUs per node."""
    if t * d >= hw.gpus_per_node:
        return _inter_bw(hw), hw.ib_latency
    return _intra_bw(hw), hw.nvlink_latency


def estimate(spec: ModelSpec, cluster: Cluster, lay: Layout, simulate: bool = False,
             divisible_layers: bool = True) -> Estimate:
    """Predict one iteration of ``lay``.

    Closed form (``simulate=False``), with per-chunk forward t_F and backward
    t_B (recompute included) and a blocking send c per compute action:
        T_pipe = (m v + p - 1) (t_F + t_B + 2c) + m max(head, embedding)
    i.e. ideal m v (t_F + t_B) plus the bubble (p-1)/(v m). With
    ``simulate=True`` the real schedule runs through the event simulator
    (``autopar.planning.simulate``) with the same per-chunk costs instead, unless it has
    more than ``SIMULATION_LIMIT`` actions (then ``Estimate.simulated`` is False).
    Then T_iter = T_pipe + exposed DP all-reduce + tied-embedding sync + optimizer.
    """
    errs = layout_errors(spec, cluster, lay, divisible_layers)
    if errs:
        raise ValueError(f"invalid layout {lay.short} for {spec.label} on {cluster.gpus} GPUs:\n  - "
                         + "\n  - ".join(errs))
    hw = cluster.hardware
    t, p, d, v, b = lay.t, lay.p, lay.d, lay.v, lay.b
    m = cluster.global_batch // (d * b)
    L = math.ceil(spec.layers / (p * v))
    tm = _times(spec, hw, b, t)
    rc = 1.0 if lay.recompute == "full" else 0.0
    chunk_f = tm["layer_f"] * L
    chunk_b = tm["layer_b"] * L + tm["layer_f"] * (L * rc)
    t_F, t_B = chunk_f.total, chunk_b.total
    head_f, head_b = tm["head_f"].total, tm["head_b"].total
    emb_f, emb_b = tm["emb_f"].total, tm["emb_b"].total

    # pipeline send: b s h fp16, 1/t of it per GPU with scatter/gather, then an all-gather
    c = 0.0
    if p > 1:
        bw, lat = _stage_link(hw, t, d)
        msg = FP16 * b * spec.seq_len * spec.hidden
        if lay.scatter_gather and t > 1:
            c = p2p_time(msg / t, bw, lat) + allgather_time(msg, t, _intra_bw(hw), hw.nvlink_latency)
        else:
            c = p2p_time(msg, bw, lat)

    extra = max(head_f + head_b, emb_f + emb_b) if p > 1 else head_f + head_b + emb_f + emb_b
    steps = m * v + p - 1
    sim = None
    inflight = None
    if simulate and p > 1 and 2 * p * v * m <= SIMULATION_LIMIT:
        sim = simulate_layout_costs(lay.schedule, p, v, m, t_F, t_B, c,
                                    first_extra=(emb_f, emb_b), last_extra=(head_f, head_b))
        t_pipe, bubble = sim.step_time, sim.bubble
        inflight = [sim.peak_in_flight[r] for r in range(p)]
    else:
        t_pipe = steps * (t_F + t_B + 2 * c) + m * extra
        bubble = (p - 1) / (v * m)

    # data parallel: fp16 gradients of the fullest stage, ring over d
    P_max = max(params_per_stage(spec, t, p))
    bw, lat = _dp_bandwidth(hw, t, d)
    t_dp = allreduce_time(FP16 * P_max, d, bw, lat)
    if lay.dp_overlap and d > 1:
        window = v * t_B
        t_dp_exposed = max(t_dp - window, allreduce_time(min(DDP_BUCKET_BYTES, FP16 * P_max), d, bw, lat))
    else:
        t_dp_exposed = t_dp
    t_emb = 0.0
    if p > 1:
        V_l = math.ceil(spec.vocab / t)
        t_emb = allreduce_time(FP16 * V_l * spec.hidden, 2, _inter_bw(hw), hw.ib_latency)
    t_opt = P_max * OPTIMIZER_BYTES_PER_PARAM / (hw.hbm_bw * hw.eff.hbm)

    # where the time goes, on the critical path (the bubble proportionally)
    per_mb = chunk_f + chunk_b
    ideal = m * v * (t_F + t_B) + m * extra
    pipe_work = ideal + m * v * 2 * c
    bubble_time = max(t_pipe - pipe_work, 0.0)
    head_t, emb_t = tm["head_f"] + tm["head_b"], tm["emb_f"] + tm["emb_b"]
    if p == 1:
        heads = head_t + emb_t
    else:  # on different stages: the slower of the two paces the pipeline
        heads = head_t if head_t.total >= emb_t.total else emb_t
    work = per_mb * (m * v) + heads * m
    breakdown = {
        "gemm": work.gemm, "memory": work.memory, "tp_comm": work.comm,
        "p2p": m * v * 2 * c, "bubble": bubble_time,
        "dp": t_dp_exposed + t_emb, "optimizer": t_opt,
    }
    mem = memory_per_gpu(spec, lay, m, inflight)
    return Estimate(
        spec=spec, cluster=cluster, layout=lay, m=m, chunk_layers=L,
        t_chunk_f=t_F, t_chunk_b=t_B, t_head_f=head_f, t_head_b=head_b, t_emb_f=emb_f, t_emb_b=emb_b,
        t_p2p=c, t_pipeline=t_pipe, bubble=bubble, t_dp=t_dp, t_dp_exposed=t_dp_exposed,
        t_emb_sync=t_emb, t_optimizer=t_opt, breakdown=breakdown, memory=mem,
        flops=iteration_flops(spec, cluster.global_batch, lay.recompute == "full"),
        sim=sim,
    )


# ------------------------------------------------------------ paper's runs


@dataclass(frozen=True)
class PaperRun:
    """One row of the paper's weak-scaling table (the calibration data)."""

    model: str
    """Preset name."""
    t: int
    p: int
    gpus: int
    batch: int
    micro: int
    tflops: float
    """Reported TFLOP/s per GPU."""
    v: int = 1
    """Chunks per stage we assume (the paper does not print it; see docs)."""
    dp_overlap: bool = False
    """Whether the gradient all-reduce overlapped the backward (see docs)."""

    @property
    def spec(self) -> ModelSpec:
        return get_model(self.model)

    def layout(self) -> Layout:
        d = self.gpus // (self.t * self.p)
        return Layout(t=self.t, p=self.p, d=d, b=self.micro, v=self.v, dp_overlap=self.dp_overlap)

    def cluster(self, hardware: str | Hardware = "dgx-a100-80gb") -> Cluster:
        return Cluster.of(self.gpus, hardware, self.batch)

    def predict(self, hardware: str | Hardware = "dgx-a100-80gb", simulate: bool = True) -> Estimate:
        """The model's estimate at the paper's layout."""
        return estimate(self.spec, self.cluster(hardware), self.layout(), simulate=simulate)


# Assumptions the paper's table does not state (docs/performance-model.md):
# - v: 76B uses 5 layers per model chunk (v=3); 39B, 24 layers per stage, uses
#   6 (v=4). Any v in 3..8 moves either prediction by less than 1%.
# - dp_overlap: the p=1 rows ran PyTorch DDP (gradient all-reduce overlapped
#   with the backward), the pipelined rows Megatron's local DDP (all-reduce
#   after the pipeline flush).
PAPER_RUNS: tuple[PaperRun, ...] = (
    PaperRun("gpt-1.7b", 1, 1, 32, 512, 16, 137, dp_overlap=True),
    PaperRun("gpt-3.6b", 2, 1, 64, 512, 16, 138, dp_overlap=True),
    PaperRun("gpt-7.5b", 4, 1, 128, 512, 16, 142, dp_overlap=True),
    PaperRun("gpt-18b", 8, 1, 256, 1024, 8, 135, dp_overlap=True),
    PaperRun("gpt-39b", 8, 2, 512, 1536, 4, 138, v=4),
    PaperRun("gpt-76b", 8, 4, 1024, 1792, 2, 140, v=3),
)


def fit_efficiency(runs: tuple[PaperRun, ...] = PAPER_RUNS, hardware: str = "dgx-a100-80gb",
                   gemm: tuple[float, float, float] = (0.60, 0.90, 0.01),
                   hbm: tuple[float, float, float] = (0.50, 0.95, 0.01)) -> tuple[float, float, float]:
    """Fit the two free constants (``Efficiency.gemm``, ``Efficiency.hbm``) on
    ``runs`` by grid search, minimising the sum of squared log errors of the
    predicted TFLOP/s (closed-form pipeline, which is within 0.2% of the
    simulator on these rows). Returns (gemm, hbm, worst relative error)."""
    hw0 = get_hardware(hardware)
    best = None
    for gi in range(round((gemm[1] - gemm[0]) / gemm[2]) + 1):
        g = round(gemm[0] + gi * gemm[2], 6)
        for hi in range(round((hbm[1] - hbm[0]) / hbm[2]) + 1):
            hb = round(hbm[0] + hi * hbm[2], 6)
            hw = hw0.with_efficiency(gemm=g, hbm=hb)
            errs = [r.predict(hw, simulate=False).tflops_per_gpu / r.tflops - 1 for r in runs]
            loss = sum(math.log1p(e) ** 2 for e in errs)
            if best is None or loss < best[0]:
                best = (loss, g, hb, max(abs(e) for e in errs))
    return best[1], best[2], best[3]


# --------------------------------------------------------------- symbolic


_sym = sp.symbols("B s l h V a t p d v m b n c T_F T_B T_pipe T_dp T_opt T_iter F", positive=True)
B_, s_, l_, h_, V_, a_, t_, p_, d_, v_, m_, b_, n_, c_, TF_, TB_, TP_, TDP_, TOPT_, TIT_, F_ = _sym

_P_EXPR = 12 * l_ * h_**2 * (1 + sp.Rational(13, 12) / h_ + (V_ + s_) / (12 * l_ * h_))

FORMULAS: dict[str, tuple[str, sp.Expr]] = {
    "P": ("parameters", _P_EXPR),
    "F": ("FLOPs per iteration, full recomputation (72 instead of 96 without)",
          96 * B_ * s_ * l_ * h_**2 * (1 + s_ / (6 * h_) + V_ / (16 * l_ * h_))),
    "m": ("microbatches per pipeline", B_ / (d_ * b_)),
    "bubble": ("pipeline bubble fraction (uniform chunks)", (p_ - 1) / (v_ * m_)),
    "tp_volume": ("TP all-reduce elements per layer per microbatch per GPU", 8 * b_ * s_ * h_ * (t_ - 1) / t_),
    "p2p_volume": ("elements per stage-to-stage send (scatter/gather)", b_ * s_ * h_ / t_),
    "T_pipe": ("pipeline time, closed form (c: one send)", (m_ * v_ + p_ - 1) * (TF_ + TB_ + 2 * c_)),
    "T_iter": ("iteration time (pipeline as simulated)", TP_ + TDP_ + TOPT_),
    "state": ("model-state bytes per GPU, mixed-precision Adam (approx.)", 16 * _P_EXPR / (t_ * p_)),
    "act_layer": ("activation bytes of one layer without recomputation",
                  s_ * b_ * h_ * (10 + 24 / t_ + 5 * a_ * s_ / (h_ * t_))),
    "X": ("TFLOP/s per GPU", F_ / (TIT_ * n_)),
}
_UNITS = {"P": "", "F": "FLOP", "m": "", "bubble": "", "tp_volume": "elements", "p2p_volume": "elements",
          "T_pipe": "s", "T_iter": "s", "state": "B", "act_layer": "B", "X": "TFLOP/s"}


@dataclass(frozen=True)
class Explained:
    key: str
    description: str
    expr: sp.Expr
    value: float
    unit: str = ""


def explain(est: Estimate) -> list[Explained]:
    """Every formula of ``FORMULAS`` with this layout's numbers substituted, plus
    the simulated bubble when the estimate ran the schedule."""
    spec, lay, cl = est.spec, est.layout, est.cluster
    subs = {B_: cl.global_batch, s_: spec.seq_len, l_: spec.layers, h_: spec.hidden, V_: spec.vocab,
            a_: spec.heads, t_: lay.t, p_: lay.p, d_: lay.d, v_: lay.v, b_: lay.b, m_: est.m,
            n_: cl.gpus, c_: est.t_p2p, TF_: est.t_chunk_f, TB_: est.t_chunk_b,
            TP_: est.t_pipeline, TDP_: est.t_dp_exposed + est.t_emb_sync, TOPT_: est.t_optimizer,
            TIT_: est.t_iter, F_: est.flops}
    out = []
    for key, (desc, expr) in FORMULAS.items():
        if key == "F" and lay.recompute != "full":
            expr = 72 * B_ * s_ * l_ * h_**2 * (1 + s_ / (6 * h_) + V_ / (12 * l_ * h_))
        val = float(expr.subs(subs))
        if key == "X":
            val /= 1e12
        out.append(Explained(key, desc, expr, val, _UNITS[key]))
    if est.sim is not None:
        idle, busy = sp.symbols("idle busy", positive=True)
        out.insert(4, Explained("bubble_sim", "bubble as simulated (idle / compute, worst stage; "
                                "includes the LM head's imbalance)", idle / busy, est.bubble))
    return out


def simulate_estimate(spec: ModelSpec, cluster: Cluster, layout: Layout) -> tuple[Estimate, "SimResult"]:
    """(Estimate with the simulated pipeline, its SimResult) for one layout.

    For p = 1 there is no pipeline to simulate; the result is a one-stage run. A
    pipeline over ``SIMULATION_LIMIT`` actions is simulated here all the same
    (the Estimate keeps its closed-form pipeline time).
    """
    est = estimate(spec, cluster, layout, simulate=True)
    if est.sim is not None:
        return est, est.sim
    lay = est.layout
    if lay.p > 1:  # over SIMULATION_LIMIT for the planner, but asked for explicitly
        sim = simulate_layout_costs(lay.schedule, lay.p, lay.v, est.m, est.t_chunk_f, est.t_chunk_b, est.t_p2p,
                                    (est.t_emb_f, est.t_emb_b), (est.t_head_f, est.t_head_b))
        return est, sim
    sim = simulate_layout_costs("1f1b", 1, 1, est.m, est.t_chunk_f, est.t_chunk_b, 0.0,
                                (est.t_emb_f, est.t_emb_b), (est.t_head_f, est.t_head_b))
    return est, sim
