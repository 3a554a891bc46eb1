"""Memory per GPU of a layout: model state, DDP buckets and activations on the fullest stage.

Model state per local parameter, in the layout's ``Precision`` (``precision.py``):
weights and gradients, and the optimizer's state (an fp32 master copy when the
weights are 16-bit, Adam's m and v): 2 + 2 + 12 = 16 bytes in the paper's mixed
precision. With the distributed optimizer (ZeRO stage 1, ``Layout.distributed_optimizer``)
each of the d replicas keeps 1/d of the optimizer state (an fp32 master and the
moments: 12/d; the moments alone, 8/d, when the weights are fp32 and their own storage is the
master) and the reduced fp32 gradient of its 1/d range (4/d). Activations
are what the in-flight microbatches keep (``activations.py``) plus the largest
working set (a layer's backward, or the loss), or the optimizer step's fp32
gradient copy when that is larger. In a zero-bubble schedule a microbatch whose B
has run and whose W has not keeps its weight GEMMs' inputs and output gradients
instead (``zero_bubble_costs.py``), priced conservatively.

With expert parallelism a rank holds E/ep of each expert layer's experts
(``models.expert_params_per_stage``): their weights, gradients and optimizer state are E/ep
experts' (the distributed optimizer shards their state over the d/ep replicas holding them);
an expert layer keeps its routed rows (``activations.expert_rows_kept_bytes``): ep S of them
with the all-gather dispatcher, S with the all-to-all one.

Under context parallelism (``Layout.cp``) the parameters are replicated over the cp ranks, so a
rank's weights and gradients do not shrink with cp; the d cp ranks holding the same parameters
reduce the same gradients, and the distributed optimizer shards over all of them (d cp). Every
activation is per token: a rank keeps those of its s/cp tokens (``activations.py``), and a
layer's backward also holds the ring's buffers (``activations.ring_backward_buffers``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from autopar.core.config import Recompute
from autopar.planning.cost.activations import (
    activation_bytes_per_layer,
    embedding_kept_bytes,
    head_kept_bytes,
    layer_backward_transient,
    loss_working_bytes,
)
from autopar.planning.cost.layout import Layout
from autopar.planning.cost.models import (
    ModelSpec,
    expert_params_per_stage,
    max_moe_layers_per_chunk,
    params_per_stage,
)
from autopar.planning.cost.precision import Precision
from autopar.planning.cost.transformer import head_ops, layer_ops
from autopar.planning.cost.zero_bubble_costs import Held, held_bounds, held_peak_bytes, weight_grad_kept_elements
from autopar.schedules import in_flight_bound
from autopar.schedules.chunk_placement import placement_of, stage_of_chunk

__all__ = ["Memory", "activation_bytes_per_layer", "layer_backward_transient", "memory_per_gpu", "stage_memory",
           "model_state_bytes", "REDUCED_GRAD_SHARD_BYTES"]

REDUCED_GRAD_SHARD_BYTES = 4
"""The distributed optimizer's reduced gradient of its own 1/d range, fp32, per parameter (/d)."""


@dataclass(frozen=True)
class Memory:
    """Bytes per GPU on the fullest pipeline stage."""

    weights: float
    """Parameters (``Precision.weight`` bytes each)."""
    grads: float
    """Gradients (``Precision.grad`` bytes each), plus the distributed optimizer's reduced fp32
    shard (4/d bytes per parameter)."""
    optimizer: float
    """Optimizer state: master weights + Adam m and v (12 bytes per parameter in mixed
    precision), 1/d of it with the distributed optimizer."""
    activations: float
    """Peak activations (stored checkpoints or full activations, working set, logits), or
    the fp32 gradient copy of the optimizer step when that is larger."""
    stage: int
    """The stage these numbers are for (the one with the most memory)."""
    buffers: float = 0.0
    """PyTorch DDP's gradient buckets (a second copy of the gradients) when the gradient
    all-reduce overlaps the backward; 0 with Megatron's local DDP or the distributed optimizer."""
    kept: float = 0.0
    """The part of ``activations`` the in-flight microbatches keep for their backward at the
    peak (what the runtime counts as kept), without the working set."""
    step_copy: float = 0.0
    """The optimizer step's fp32 copy of the (local, or 1/d with the distributed optimizer)
    16-bit gradients; 0 when the gradients are fp32 already."""

    @property
    def total(self) -> float:
        return self.weights + self.grads + self.optimizer + self.buffers + self.activations


def model_state_bytes(prec: Precision, params: float, d: int, distributed_optimizer: bool) -> tuple[float, float, float]:
    """(weights, gradients, optimizer state) bytes of ``params`` local parameters; the distributed
    optimizer (when d > 1) shards the optimizer state over the d replicas and adds the reduced fp32
    gradient of this replica's 1/d range."""
    sharded = distributed_optimizer and d > 1
    grads = prec.grad * params + (REDUCED_GRAD_SHARD_BYTES * params / d if sharded else 0.0)
    state = prec.sharded_state * params / d if sharded else prec.optimizer_state * params
    return float(prec.weight * params), float(grads), float(state)


def memory_per_gpu(spec: ModelSpec, lay: Layout, m: int, inflight: list[int] | None = None) -> Memory:
    """Peak memory of the fullest stage.

    Model state: ``model_state_bytes`` of the stage's local parameters, plus, when the
    gradient all-reduce overlaps the backward (PyTorch DDP, ``lay.dp_overlap`` with
    d > 1, no distributed optimizer), DDP's bucket buffers: a second copy of the gradients.

    Activations at their peak = what the in-flight microbatches keep + the larger of two
    working sets that never coexist:
      - kept: with ``recompute='layer'`` each in-flight chunk-microbatch keeps its layers'
        inputs (A b s h bytes each; /t with sequence parallelism); with ``none`` every
        in-flight layer keeps all its activations (``activation_bytes_per_layer``); in a
        pipeline each in-flight chunk also keeps its output until its backward (the last
        chunk's output is the loss); the first chunk's microbatches keep the embedding's
        (``embedding_kept_bytes``), the last chunk's the head's (``head_kept_bytes``);
      - a layer's backward: (recompute='layer') the layer re-materialised, plus
        ``layer_backward_transient``, plus the incoming and outgoing gradients (2 A b s h);
      - the loss (last stage): the logits and then their gradient in their place
        (``loss_working_bytes``), and the gradient of the LM head's input; a layer's
        backward on the last stage runs after its microbatch's loss released what the
        head kept.
    With 16-bit gradients the optimizer step makes an fp32 copy of them (4 bytes per
    parameter, of the 1/d range with the distributed optimizer) only after the activations
    are freed, so it competes with them: the activation entry is max(activations, that copy).
    ``inflight`` overrides the closed-form count of in-flight units per stage.

    Zero-bubble schedules (ZB-H1, ZB-V): a unit counts until its W (``in_flight_bound``); at
    most ``held_bounds(...).until_b`` of them keep the above, at most ``awaiting_w`` (B run, W
    not) keep what their weight GEMMs need (``weight_grad_kept_elements``: each linear's input
    and output gradient; on the stage of the last chunk also the LM head's input and the logits'
    gradient), and the peak is the worst mix of the two (``held_peak_bytes``): conservative.
    """
    p = lay.p
    best: Memory | None = None
    # in-flight counts fall with the stage index (ZB-V's grow) and only the ends hold embeddings,
    # so the first and last stage are the candidates unless counts are given
    for r in (range(p) if inflight is not None else sorted({0, p - 1})):
        units = inflight[r] if inflight is not None else in_flight_bound(lay.schedule, p, lay.v, m, r)
        cand = stage_memory(spec, lay, r, units, _held(lay, m, r, units))
        if best is None or cand.total > best.total:
            best = cand
    return best


def _held(lay: Layout, m: int, r: int, units: int) -> Held | None:
    """What stage ``r``'s ``units`` wait for in a schedule with W actions (``held_bounds``, capped
    at ``units``); None for a schedule that runs whole backwards."""
    if lay.p == 1 or lay.schedule not in ("zb-h1", "zbv"):
        return None
    bound = held_bounds(lay.schedule, lay.p, lay.v, m, r)
    return Held(units, min(bound.until_b, units), min(bound.awaiting_w, units))


def stage_memory(spec: ModelSpec, lay: Layout, r: int, units: int, held: Held | None = None) -> Memory:
    """Memory of one GPU of pipeline stage ``r`` holding ``units`` chunk-microbatches in flight
    at its peak (``memory_per_gpu`` takes the fullest stage); ``held``: how many of them wait
    for their B and for their W, in a schedule with W actions."""
    head_stage = stage_of_chunk(placement_of(lay.schedule), lay.p, lay.p * lay.v - 1)
    prec, P = lay.precision, params_per_stage(spec, lay.t, lay.p, lay.ep, head_stage)[r]
    P_exp = expert_params_per_stage(spec, lay.t, lay.p, lay.ep)[r] if lay.ep > 1 else 0
    sharded = lay.distopt
    # routed experts (ep > 1) are replicated over, and their optimizer state sharded over, d/ep replicas
    dense = model_state_bytes(prec, P - P_exp, lay.dcp, lay.distributed_optimizer)
    experts = model_state_bytes(prec, P_exp, lay.edp, lay.distributed_optimizer)
    weights, grads, state = (a + b for a, b in zip(dense, experts))
    ddp = prec.grad * P if (lay.dp_overlap and lay.dcp > 1 and not sharded) else 0.0
    owned = (P - P_exp) / lay.dcp + P_exp / lay.edp if sharded else P
    copy = 4.0 * owned if prec.grad < 4 else 0.0
    kept, working = _activations(spec, lay, r, units, held)
    return Memory(weights, grads, state, max(kept + working, copy), r, buffers=ddp, kept=kept, step_copy=copy)


def _activations(spec: ModelSpec, lay: Layout, r: int, units: int,
                 held: Held | None = None) -> tuple[float, float]:
    """(kept, working set) activation bytes of stage ``r`` holding ``units`` chunk-microbatches in
    flight: what they keep, and the larger working set (a layer's backward, or on the stage of
    the last chunk the loss)."""
    t, p, b, sp, prec, cp = lay.t, lay.p, lay.b, lay.sp, lay.precision, lay.cp
    last = stage_of_chunk(placement_of(lay.schedule), p, p * lay.v - 1)  # the loss's stage
    T = b * spec.seq_len // cp  # this rank's tokens
    chunk_layers = math.ceil(spec.layers / (p * lay.v))
    moe_layers = min(max_moe_layers_per_chunk(spec, p * lay.v), chunk_layers)
    kinds = [(chunk_layers - moe_layers, False), (moe_layers, True)]  # (layers, mixture-of-experts)
    full = {moe: activation_bytes_per_layer(spec, b, t, sp, prec, moe, lay.ep, lay.expert_dispatch, cp)
            for n, moe in kinds if n}
    transient = {moe: layer_backward_transient(spec, b, t, sp, prec, moe, lay.ep, lay.expert_dispatch, cp)
                 for n, moe in kinds if n}
    ckpt = prec.activation * T * spec.hidden  # a layer's input or output, whole
    split = ckpt / (t if sp else 1)  # as kept between layers (1/t of the tokens with sequence parallelism)
    if lay.recompute is Recompute.LAYER:
        per_unit = chunk_layers * split
        working = max(full[k] + transient[k] for k in full) + 2 * ckpt
    else:
        per_unit = sum(n * full[moe] for n, moe in kinds if n)
        working = max(transient.values()) + 2 * ckpt
    out = split if p > 1 else 0.0  # each chunk's output, kept for its backward (the last chunk's is the loss)
    if held is None:
        kept = units * (per_unit + out)
    else:
        kept = held_peak_bytes(held, per_unit + out, _awaiting_w_bytes(spec, lay, chunk_layers, r == last))
    if p > 1 and r == last:
        kept -= split
    first_units = math.ceil(units / lay.v)  # microbatches in flight in the first chunk
    if r == 0:
        kept += first_units * embedding_kept_bytes(spec, b, t, sp, prec, cp)
    if r == last:  # a microbatch's layers run backward after its loss has released the head's
        head = head_kept_bytes(spec, b, t, sp, prec, cp)
        # the last chunk's backward follows its forward at once, except in GPipe (all forwards first)
        kept += (first_units if lay.schedule == "gpipe" else 1) * head
        working = max(working - head, loss_working_bytes(spec, b, t, prec, cp) + ckpt)
    return kept, working


def _awaiting_w_bytes(spec: ModelSpec, lay: Layout, chunk_layers: int, holds_head: bool) -> float:
    """Bytes one chunk-microbatch keeps between its B and its W: its layers' weight-GEMM inputs and
    output gradients, and on the stage of the last chunk the LM head's (its input and the logits'
    gradient; counted for every unit there, as if each were the last chunk's: conservative for v > 1)."""
    prec = lay.precision
    moe = min(max_moe_layers_per_chunk(spec, lay.p * lay.v), chunk_layers)
    layer = weight_grad_kept_elements(layer_ops(spec, lay.b, lay.t, lay.sp, cp=lay.cp).backward)
    layers = (chunk_layers - moe) * layer
    if moe:
        ops = layer_ops(spec, lay.b, lay.t, lay.sp, moe=True, ep=lay.ep, dispatch=lay.expert_dispatch, cp=lay.cp)
        layers += moe * weight_grad_kept_elements(ops.backward)
    head = weight_grad_kept_elements(head_ops(spec, lay.b, lay.t, lay.cp).backward) if holds_head else 0.0
    return prec.activation * (layers + head)
