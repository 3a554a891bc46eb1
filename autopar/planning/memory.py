"""Memory per GPU of a layout: model state, DDP buckets and activations on the fullest stage.

Model state is 16 bytes per local parameter (fp16 weights and gradients, fp32
master weights and Adam's m and v); activations are what the in-flight
microbatches keep plus the largest working set (a layer's backward, or the
loss), or the optimizer step's fp32 gradient copy when that is larger.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from autopar.core.config import Recompute, optimizer_bytes_per_param
from autopar.planning.layout import Layout
from autopar.planning.models import ModelSpec, params_per_stage
from autopar.planning.op_costs import FP16, FP32
from autopar.schedules import in_flight_bound

__all__ = ["Memory", "activation_bytes_per_layer", "layer_backward_transient", "memory_per_gpu"]

OPTIMIZER_STATE = optimizer_bytes_per_param(FP16)
"""Adam's state per 16-bit parameter (mixed precision): m and v, and the fp32 master weights,
12 bytes."""


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
      - stored: with ``recompute='layer'`` each in-flight chunk-microbatch keeps
        its layers' inputs (2 b s h bytes each); with ``none`` every in-flight
        layer keeps all its activations (``activation_bytes_per_layer``); in a
        pipeline each in-flight chunk also keeps its output (2 b s h) until its
        backward (Megatron-LM 2021 backpropagates from it; the last chunk's
        output is the loss);
      - a layer's backward: (recompute='layer') the layer re-materialised,
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
    p = lay.p
    params = params_per_stage(spec, lay.t, p)
    ddp = FP16 if (lay.dp_overlap and lay.d > 1) else 0.0
    best: Memory | None = None
    # in-flight counts fall with the stage index and only the ends hold embeddings,
    # so the first and last stage are the candidates unless counts are given
    for r in (range(p) if inflight is not None else sorted({0, p - 1})):
        units = inflight[r] if inflight is not None else in_flight_bound(lay.schedule, p, lay.v, m, r)
        P = params[r]
        act = max(_activations(spec, lay, r, units), FP32 * P)
        cand = Memory(FP16 * P, FP16 * P, float(OPTIMIZER_STATE) * P, act, r, buffers=ddp * P)
        if best is None or cand.total > best.total:
            best = cand
    return best


def _activations(spec: ModelSpec, lay: Layout, r: int, units: int) -> float:
    """Peak activation bytes of stage ``r`` holding ``units`` chunk-microbatches in flight:
    what they keep, plus the larger working set (a layer's backward, or on the last stage
    the loss), plus the embedding's output on stage 0."""
    t, p, b = lay.t, lay.p, lay.b
    T = b * spec.seq_len
    chunk_layers = math.ceil(spec.layers / (p * lay.v))
    full_layer = activation_bytes_per_layer(spec, b, t)
    transient = layer_backward_transient(spec, b, t)
    ckpt = FP16 * T * spec.hidden
    if lay.recompute is Recompute.LAYER:
        stored = units * chunk_layers * ckpt
        working = full_layer + transient + 2 * ckpt
    else:
        stored = units * chunk_layers * full_layer
        working = transient + 2 * ckpt
    if p > 1:  # each chunk's output, kept for its backward (the last chunk's is the loss)
        stored += (units - (1 if r == p - 1 else 0)) * ckpt
    if r == p - 1:
        working = max(working, T * math.ceil(spec.vocab / t) * (FP32 + FP16) + 2 * ckpt)
    return stored + working + (ckpt if r == 0 else 0.0)
