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

A mixture-of-experts layer (``moe=True``) keeps, instead of the dense MLP's split terms, its
shared expert's (3 f_s A or 2 f_s A, split), the router's softmax over E, the k gate weights
and the k sort indices of each token (replicated), and per routed row
(``transformer.expert_rows``): the grouped GEMMs' input and the expert's activation and down
projection inputs, (h + 3 f_e/t) A gated, on the R rows the grouped GEMMs' tensors have (ep S
with the all-gather dispatcher, S = k b s otherwise), and each of the S results back at its
token (h A, for the gate weight's gradient).

A spec read from a traced model carries what its layer, embedding and head save, counted on its
graph (``ModelSpec.saved``, ``compiler/saved_census.py``): an RMSNorm's normalised product, rotary
cos and sin, an eager SwiGLU's four products, whatever the model's code keeps. Then
``activation_bytes_per_layer``, ``embedding_kept_bytes`` and ``head_kept_bytes`` price those counts
(``SavedShare.bytes``: the column-parallel and vocabulary-parallel part 1/t, the hidden stream's
whole or 1/t with sequence parallelism) and the formulas above are the fallback of a spec given by
its dimensions, of a mixture-of-experts layer and of context parallelism.

Under context parallelism (``cp`` > 1) a rank holds s/cp tokens of each sequence, and every term
above is per token: each function prices b s/cp tokens. The attention is ring attention, which
keeps what a fused kernel keeps (its output and an fp32 log-sum-exp per head and query), never
scores, whatever ``fused_attention`` says; so with a fused attention a layer keeps exactly 1/cp of
what it keeps at cp = 1. Its backward holds, on top, the ring's buffers
(``ring_backward_buffers``).
"""

from __future__ import annotations

import math

from autopar.planning.cost.models import ModelSpec
from autopar.planning.cost.precision import MIXED, Precision
from autopar.planning.cost.transformer import expert_rows

__all__ = ["layer_kept_per_token", "expert_rows_kept_bytes", "activation_bytes_per_layer", "layer_backward_transient",
           "ring_backward_buffers", "embedding_kept_bytes", "head_kept_bytes", "loss_working_bytes"]

TOKEN_ID_BYTES = 8
"""An int64 token id (the embedding's and the loss's index tensors, kept for their backward)."""
LSE_BYTES = 4
"""A fused attention's fp32 log-sum-exp, per head and query."""
SOFTMAX_BYTES = 4
"""The cross-entropy's fp32 (log-)softmax, per local logit."""


def layer_kept_per_token(spec: ModelSpec, prec: Precision = MIXED, moe: bool = False,
                         cp: int = 1) -> tuple[float, float]:
    """(replicated, split) bytes one layer keeps per token on one rank before dividing by t: the
    replicated part is kept whole by every tensor-parallel rank, the split part is divided by t.
    ``moe``: a mixture-of-experts layer's, without its routed rows (``expert_rows_kept_bytes``);
    ``cp`` > 1: the attention a ring, keeping a fused kernel's output and log-sum-exp."""
    h, n, A, M = spec.hidden, spec.head_dim, prec.activation, prec.mask
    q, kv, f, a = spec.heads * n, spec.kv * n, spec.ffn_size, spec.heads
    replicated = A * (2 * h + h + h) + 2 * prec.norm_stats + (2 * h * M if spec.dropout else 0)
    attn = A * ((q + 2 * kv) + q)  # Q, K, V and the projection's input (the attention's output)
    if spec.fused_attention or cp > 1:
        attn += LSE_BYTES * a
    else:
        attn += a * spec.seq_len * (A + ((M + A) if spec.dropout else 0))
    n_act = 3 if spec.gated_mlp else 2
    if moe and spec.is_moe:
        mlp = A * n_act * spec.shared_expert_ffn
        replicated += A * (spec.experts + spec.top_k) + TOKEN_ID_BYTES * spec.top_k  # softmax, gates, sort order
    else:
        mlp = A * n_act * f
    return float(replicated), float(attn + mlp)


def expert_rows_kept_bytes(spec: ModelSpec, b: int, t: int, ep: int = 1, dispatch: str = "allgather",
                           precision: Precision = MIXED, cp: int = 1) -> float:
    """What a mixture-of-experts layer's routed rows keep for the backward on one rank:
    R (h + (3|2) f_e / t) A for the grouped GEMMs (R rows: ep S with the all-gather dispatcher,
    S otherwise) and S h A for the results back at their tokens (the gate weights' gradient)."""
    rows = expert_rows(spec, b, ep, dispatch, cp)
    A, h = precision.activation, spec.hidden
    n_act = 3 if spec.gated_mlp else 2
    return A * (rows.held * (h + n_act * spec.expert_ffn_size / t) + rows.sent * h)


def activation_bytes_per_layer(spec: ModelSpec, b: int, t: int, sequence_parallel: bool = False,
                               precision: Precision = MIXED, moe: bool = False, ep: int = 1,
                               dispatch: str = "allgather", cp: int = 1) -> float:
    """Bytes one layer keeps for its backward without recomputation on one of t ranks, micro-batch b:
    ``s b (replicated / (t if sequence_parallel else 1) + split / t)`` (``layer_kept_per_token``);
    the paper's ``s b h (10 + 24/t + 5 a s / (h t))`` for its GPT in mixed precision. ``moe``: a
    mixture-of-experts layer on a rank of an expert group of ``ep``, its routed rows
    (``expert_rows_kept_bytes``) added. ``cp``: on s/cp tokens, the attention a ring."""
    moe = moe and spec.is_moe
    if spec.saved is not None and not moe and cp == 1:  # counted on the model's own graph
        return spec.seq_len * b * spec.saved.layer.bytes(precision.activation, t, sequence_parallel)
    replicated, split = layer_kept_per_token(spec, precision, moe, cp)
    kept = spec.seq_len // cp * b * (replicated / (t if sequence_parallel else 1) + split / t)
    return kept + (expert_rows_kept_bytes(spec, b, t, ep, dispatch, precision, cp) if moe else 0.0)


def layer_backward_transient(spec: ModelSpec, b: int, t: int, sequence_parallel: bool = False,
                             precision: Precision = MIXED, moe: bool = False, ep: int = 1,
                             dispatch: str = "allgather", cp: int = 1) -> float:
    """Bytes a layer's backward allocates on top of its stored activations, at its peak.

    Two candidate moments:
      - fc2's backward makes the gradient of the activation's output, ``A b s f/t`` bytes
        (twice that gated), while every stored activation of the layer is still alive;
      - in an unfused attention, ``P V``'s backward makes the gradient of the probabilities,
        ``A b (a/t) s^2`` bytes (the softmax backward then works in place), while the MLP
        block's stored activations (fc1 input, dropout mask, activation and fc2 inputs) and
        LN2's input have been released. A fused attention makes no s x s gradient.
    A mixture-of-experts layer (``moe``): the gradient of the experts' activation output on the
    R rows of the grouped GEMMs (``transformer.expert_rows``), the routed rows' kept bytes
    released before the attention's backward. Under context parallelism (``cp`` > 1) on s/cp tokens,
    and the attention's moment is the ring's backward: its buffers (``ring_backward_buffers``) and,
    for an attention that is not fused, one block's s/cp x s/cp score gradient.
    """
    s, h, f, A = spec.seq_len // cp, spec.hidden, spec.ffn_size, precision.activation
    r = t if sequence_parallel else 1
    n_act = 3 if spec.gated_mlp else 2
    replicated = 2 * A * h + (precision.mask * h if spec.dropout else 0)  # LN2 and fc1 inputs, mask
    if moe and spec.is_moe:
        rows = expert_rows(spec, b, ep, dispatch, cp)
        mlp_grad = A * rows.held * (n_act - 1) * spec.expert_ffn_size / t
        shared = spec.shared_expert_ffn
        mlp_grad = max(mlp_grad, A * b * s * (n_act - 1) * shared / t)
        released = s * b * (replicated / r + n_act * A * shared / t) + expert_rows_kept_bytes(
            spec, b, t, ep, dispatch, precision, cp)
    else:
        mlp_grad = A * b * s * (n_act - 1) * f / t
        released = s * b * (replicated / r + n_act * A * f / t)
    attn_grad = 0.0 if spec.fused_attention else A * b * (spec.heads / t) * s * s
    if cp > 1:
        attn_grad += ring_backward_buffers(spec, b, t, cp, precision)
    return max(mlp_grad, attn_grad - released, 0.0)


def ring_backward_buffers(spec: ModelSpec, b: int, t: int, cp: int, precision: Precision = MIXED) -> float:
    """What ring attention's backward holds beside the layer's kept activations, on one of t ranks with
    s_l = s/cp tokens (``core.comm.ring_attention.ring_backward``): the key/value block it computes with
    and the one arriving (2 x 2 b kv_l s_l d A), the dK/dV accumulator it passes on, the one arriving
    and its own block's part (3 x 2 b kv_l s_l d, fp32), and dQ in fp32 (b a_l s_l d x 4)."""
    if cp <= 1:
        return 0.0
    s_l, d = spec.seq_len // cp, spec.head_dim
    block = 2 * b * (spec.kv // t) * s_l * d
    return 2 * block * precision.activation + 3 * block * 4 + b * (spec.heads // t) * s_l * d * 4


def embedding_kept_bytes(spec: ModelSpec, b: int, t: int, sequence_parallel: bool = False,
                         precision: Precision = MIXED, cp: int = 1) -> float:
    """What the first stage's embedding keeps per microbatch: the token ids (the lookup's
    backward scatters by them) and its dropout mask (split over t with sequence parallelism), for the
    s/cp tokens of a context-parallel rank."""
    T = b * spec.seq_len // cp
    if spec.saved is not None and cp == 1:
        return T * spec.saved.embedding.bytes(precision.activation, t, sequence_parallel)
    mask = precision.mask * spec.hidden / (t if sequence_parallel else 1) if spec.dropout else 0.0
    return T * (TOKEN_ID_BYTES + mask)


def head_kept_bytes(spec: ModelSpec, b: int, t: int, sequence_parallel: bool = False,
                    precision: Precision = MIXED, cp: int = 1) -> float:
    """What the last stage's head keeps per microbatch: the final norm's input and statistics
    and the LM head's input (split over t with sequence parallelism, the head re-gathering its
    input in the backward), the cross-entropy's fp32 softmax over the local V/t logits and
    the target ids; for the s/cp tokens of a context-parallel rank."""
    T, h, A = b * spec.seq_len // cp, spec.hidden, precision.activation
    if spec.saved is not None and cp == 1:
        return T * spec.saved.head.bytes(A, t, sequence_parallel)
    r = t if sequence_parallel else 1
    return T * ((2 * A * h + precision.norm_stats) / r + SOFTMAX_BYTES * math.ceil(spec.vocab / t)
                + TOKEN_ID_BYTES)


def loss_working_bytes(spec: ModelSpec, b: int, t: int, precision: Precision = MIXED, cp: int = 1) -> float:
    """The loss's working set beyond what it keeps: the logits (and, in the backward, their
    gradient in their place), one activation per local logit (of s/cp tokens per sequence)."""
    return b * spec.seq_len // cp * math.ceil(spec.vocab / t) * precision.activation
