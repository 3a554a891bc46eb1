"""Activation bytes: what one layer, the embedding and the LM head keep for their backward,
and what a layer's backward allocates on top, with and without sequence parallelism.

Each term is a tensor of the layer (Korthikanti et al. 2022, "Reducing Activation
Recomputation in Large Transformer Models", section 4), priced with a ``Precision``:
``A`` bytes per activation element, ``M`` per dropout-mask element. Per token of a layer:

- replicated on the t tensor-parallel ranks (LayerNorm/dropout/residual region):
  the two norms' inputs (2h A), the QKV and fc1 inputs (h A each), the two residual
  dropout masks (2h M, when the model has dropout) and the norms' statistics;
- split t ways (the column/row-parallel region): Q, K, V and the projection's input
  ((a + 2 kv) d A + a d A), the MLP's activation and fc2 inputs (2 f A; 3 f A gated),
  and the attention: the s x s softmax output (a s A), with dropout also its mask and
  output (a s (M + A)); a fused attention kernel keeps only its output (the
  projection's input) and an fp32 log-sum-exp per head (4 a).

With sequence parallelism the replicated terms are split over the t ranks too (each
keeps s/t tokens). With the paper's numbers (A = 2, M = 1, dropout, unfused attention)
the sum is ``s b h (10 + 24/t + 5 a s/(h t))``, or ``s b h (34 + 5 a s/h) / t`` with
sequence parallelism.
"""

from __future__ import annotations

import math

from autopar.planning.cost.models import ModelSpec
from autopar.planning.cost.precision import MIXED, Precision

__all__ = ["layer_kept_per_token", "activation_bytes_per_layer", "layer_backward_transient",
           "embedding_kept_bytes", "head_kept_bytes", "loss_working_bytes"]

TOKEN_ID_BYTES = 8
"""An int64 token id (the embedding's and the loss's index tensors, kept for their backward)."""
LSE_BYTES = 4
"""A fused attention's fp32 log-sum-exp, per head and query."""
SOFTMAX_BYTES = 4
"""The cross-entropy's fp32 (log-)softmax, per local logit."""


def layer_kept_per_token(spec: ModelSpec, prec: Precision = MIXED) -> tuple[float, float]:
    """(replicated, split) bytes one layer keeps per token on one rank before dividing by t: the
    replicated part is kept whole by every tensor-parallel rank, the split part is divided by t."""
    h, n, A, M = spec.hidden, spec.head_dim, prec.activation, prec.mask
    q, kv, f, a = spec.heads * n, spec.kv * n, spec.ffn_size, spec.heads
    replicated = A * (2 * h + h + h) + 2 * prec.norm_stats + (2 * h * M if spec.dropout else 0)
    attn = A * ((q + 2 * kv) + q)  # Q, K, V and the projection's input (the attention's output)
    if spec.fused_attention:
        attn += LSE_BYTES * a
    else:
        attn += a * spec.seq_len * (A + ((M + A) if spec.dropout else 0))
    mlp = A * (3 if spec.gated_mlp else 2) * f
    return float(replicated), float(attn + mlp)


def activation_bytes_per_layer(spec: ModelSpec, b: int, t: int, sequence_parallel: bool = False,
                               precision: Precision = MIXED) -> float:
    """Bytes one layer keeps for its backward without recomputation on one of t ranks, micro-batch b:
    ``s b (replicated / (t if sequence_parallel else 1) + split / t)`` (``layer_kept_per_token``);
    the paper's ``s b h (10 + 24/t + 5 a s / (h t))`` for its GPT in mixed precision."""
    replicated, split = layer_kept_per_token(spec, precision)
    return spec.seq_len * b * (replicated / (t if sequence_parallel else 1) + split / t)


def layer_backward_transient(spec: ModelSpec, b: int, t: int, sequence_parallel: bool = False,
                             precision: Precision = MIXED) -> float:
    """Bytes a layer's backward allocates on top of its stored activations, at its peak.

    Two candidate moments:
      - fc2's backward makes the gradient of the activation's output, ``A b s f/t`` bytes
        (twice that gated), while every stored activation of the layer is still alive;
      - in an unfused attention, ``P V``'s backward makes the gradient of the probabilities,
        ``A b (a/t) s^2`` bytes (the softmax backward then works in place), while the MLP
        block's stored activations (fc1 input, dropout mask, activation and fc2 inputs) and
        LN2's input have been released. A fused attention makes no s x s gradient.
    """
    s, h, f, A = spec.seq_len, spec.hidden, spec.ffn_size, precision.activation
    r = t if sequence_parallel else 1
    n_act = 3 if spec.gated_mlp else 2
    mlp_grad = A * b * s * (n_act - 1) * f / t
    replicated = 2 * A * h + (precision.mask * h if spec.dropout else 0)  # LN2 and fc1 inputs, mask
    released = s * b * (replicated / r + n_act * A * f / t)
    attn_grad = 0.0 if spec.fused_attention else A * b * (spec.heads / t) * s * s
    return max(mlp_grad, attn_grad - released, 0.0)


def embedding_kept_bytes(spec: ModelSpec, b: int, t: int, sequence_parallel: bool = False,
                         precision: Precision = MIXED) -> float:
    """What the first stage's embedding keeps per microbatch: the token ids (the lookup's
    backward scatters by them) and its dropout mask (split over t with sequence parallelism)."""
    T = b * spec.seq_len
    mask = precision.mask * spec.hidden / (t if sequence_parallel else 1) if spec.dropout else 0.0
    return T * (TOKEN_ID_BYTES + mask)


def head_kept_bytes(spec: ModelSpec, b: int, t: int, sequence_parallel: bool = False,
                    precision: Precision = MIXED) -> float:
    """What the last stage's head keeps per microbatch: the final norm's input and statistics
    and the LM head's input (split over t with sequence parallelism, the head re-gathering its
    input in the backward), the cross-entropy's fp32 softmax over the local V/t logits and
    the target ids."""
    T, h, A = b * spec.seq_len, spec.hidden, precision.activation
    r = t if sequence_parallel else 1
    return T * ((2 * A * h + precision.norm_stats) / r + SOFTMAX_BYTES * math.ceil(spec.vocab / t)
                + TOKEN_ID_BYTES)


def loss_working_bytes(spec: ModelSpec, b: int, t: int, precision: Precision = MIXED) -> float:
    """The loss's working set beyond what it keeps: the logits (and, in the backward, their
    gradient in their place), one activation per local logit."""
    return b * spec.seq_len * math.ceil(spec.vocab / t) * precision.activation
