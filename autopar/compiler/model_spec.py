"""The performance model's view of a user's model: its dimensions, read from the traced graph.

``autopar.plan(model, example_inputs=..., gpus=..., global_batch=...)`` plans
for a model the user has, not a preset: the model (with its loss) is traced
as ``parallelize`` traces it (on the meta device it costs no memory) and the
dimensions the performance model needs are read from the graph, by position
and shape, never by name:

- layers: the repeated block stack (``passes/layers.py``);
- sequence length: the example inputs' last dim;
- vocabulary and hidden size: the embedding table looked up by the input ids;
- heads and head size: the attention of the first layer (an sdpa call, or
  q @ k^T of (batch, heads, seq, head_dim) values);
- key/value heads: the attention's input projections (the linears before the
  attention call, with their output features) hold (heads + 2 kv) * head_dim;
- MLP width and gating: the layer's last linear is the down projection (its
  input features are the width); the linears between the attention's output
  projection and it are the up projections, and they hold twice the width
  when the MLP is gated (SwiGLU);
- dropout: a dropout op left in layer 0 (normalisation drops those with p = 0);
- fused attention: the attention is one ``scaled_dot_product_attention`` call
  (it keeps its output and log-sum-exp, not the s x s scores);
- tied head: the last projection outside the layers (the LM head) multiplies by
  the word embedding's own table (tied weights are one graph input);
- learned positions: a second embedding table outside the layers (rotary
  positions have none).

A projection is a linear, or a matrix product with a parameter 2-D weight
(``addmm(bias, x, W)``, ``mm(x, W)``: HuggingFace GPT-2's ``Conv1D``, weight
stored (in, out)).

- graph nodes of the embedding, one layer and the head (with the loss): what a tuned profile's per-node
  runtime overhead prices;
- what a layer, the embedding and the head save for the backward, per token: counted by running the
  graph once under fake tensors (``saved_census.py``), for a dense model;
- experts: the mixture-of-experts layers ``passes/experts.py`` finds (E, top-k,
  one expert's width from its grouped matmuls, the layers holding them; a list
  of expert modules stacked first, ``passes/expert_lists.py``); in an
  MoE layer the router (E outputs) and one-feature gates are not MLP
  projections, and the linears left are a shared expert.

The planner then models the model as a GPT-shaped decoder with those
dimensions (``cost.ModelSpec``). A block the graph does not show in that form
(no attention call, experts that are not one row-wise computation) is reported by name in the
error, with the flags to give the dimensions by hand instead.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.fx as fx
import torch.nn as nn

from autopar.core.errors import AutoparError
from autopar.core.graph import ancestors
from autopar.planning.cost.models import ModelSpec
from autopar.compiler.saved_census import saved_census, split_regions
from autopar.compiler.trace import lm_cross_entropy, trace
from passes.experts import find_experts
from passes.layers import find_layers
from passes.expert_lists import stack_expert_lists
from passes.normalize import normalize

aten = torch.ops.aten

__all__ = ["SpecError", "spec_from_model", "spec_from_graph"]


class SpecError(AutoparError, ValueError):
    """The traced model does not show the dimensions the planner needs; the message says which."""


def spec_from_model(model: nn.Module, example_inputs: Any, example_targets: Any = None,
                    loss_fn: Callable | None = None, name: str = "") -> ModelSpec:
    """Trace ``model`` (like ``parallelize``) and read a ``ModelSpec`` from its graph."""

    inputs = example_inputs if isinstance(example_inputs, (tuple, list)) else (example_inputs,)
    if example_targets is None:
        example_targets = torch.zeros_like(inputs[0])
    traced = trace(model, inputs, example_targets, loss_fn or lm_cross_entropy)
    normalize(traced.gm, set(traced.param_of))
    stack_expert_lists(traced, model)  # experts applied one by one: one grouped computation, as compiled
    seq = int(inputs[0].shape[-1])
    return spec_from_graph(traced.gm, set(traced.param_of), seq, name or type(model).__name__)


def _shape(n: fx.Node) -> tuple[int, ...]:
    return tuple(n.meta["val"].shape)


def spec_from_graph(gm: fx.GraphModule, params: set[str], seq_len: int, name: str = "") -> ModelSpec:
    """Read layers, hidden, heads, kv heads, MLP width and vocabulary from a traced graph."""
    layers = find_layers(gm)
    if layers.count == 0:
        raise SpecError(f"{name}: no repeated block stack in the graph; give the dimensions by hand "
                        "(autopar plan --layers --hidden --heads --seq-len --vocab)")
    nodes = [n for n in gm.graph.nodes if n.op == "call_function"]
    first = [n for n in nodes if layers.node_layer.get(n.name) == 0]

    tables = [n for n in nodes if n.target == aten.embedding.default and n.args[0].name in params
              and layers.node_layer.get(n.name) is None]
    if not tables:
        raise SpecError(f"{name}: no embedding table outside the layers; give --vocab and --hidden")
    vocab, hidden = max((_shape(t.args[0]) for t in tables), key=lambda s: s[0])

    attn = _attention(first, seq_len)
    if attn is None:
        raise SpecError(f"{name}: layer 0 shows no attention over (batch, heads, seq, head size) values "
                        "(scaled_dot_product_attention, or q @ k^T); give --heads (and --kv-heads) by hand")
    q = _shape(attn.args[0])
    heads, head_dim = q[-3], q[-1]

    linears = [n for n in first if _projection(n, params) is not None]
    before = [n for n in linears if n in ancestors(attn.all_input_nodes)]
    after = [n for n in linears if n not in before]
    in_f = lambda n: _projection(n, params)[1]  # noqa: E731
    out_f = lambda n: _projection(n, params)[2]  # noqa: E731
    qkv_total = sum(out_f(n) for n in before)
    kv = (qkv_total // head_dim - heads) // 2 if qkv_total % head_dim == 0 else 0
    if kv <= 0 or heads % kv:
        raise SpecError(f"{name}: the attention's input projections in layer 0 hold {qkv_total} features, "
                        f"not (heads {heads} + 2 kv) x head size {head_dim}; give --kv-heads by hand")
    moe = _experts(gm, params, layers, name)
    if moe and 0 in moe["layers"]:  # layer 0's MLP is experts: its linears are the router, a shared expert, gates
        after = [n for n in after if out_f(n) not in (moe["experts"], 1)]
    # after the attention: its output projection, the MLP's up (and gate) projections, the down one
    if moe and 0 in moe["layers"] and len(after) < 3:  # no shared expert: the experts' width stands for ffn
        ffn, ups, shared = moe["expert_ffn"], moe["expert_ups"], 0
    else:
        if len(after) < 3:
            raise SpecError(f"{name}: layer 0 shows {len(after)} linear(s) after the attention, not an output "
                            f"projection and an MLP (experts applied another way?); give --ffn by hand")
        down = after[-1]
        ffn = in_f(down)
        ups = sum(out_f(n) for n in after[1:-1])
        shared = ffn if moe and 0 in moe["layers"] else 0  # layer 0's dense MLP beside its experts
        if shared:
            ffn = moe["expert_ffn"]
    if ups not in (ffn, 2 * ffn) and not shared:
        raise SpecError(f"{name}: the MLP's up projections hold {ups} features for a width of {ffn}; "
                        f"give --ffn (and --gated-mlp) by hand")
    gated = (moe["expert_ups"] == 2 * moe["expert_ffn"]) if moe and 0 in moe["layers"] else ups == 2 * ffn
    dropout = any(n.target in _DROPOUTS for n in first)
    word = max(tables, key=lambda n: _shape(n.args[0])[0]).args[0]
    heads_out = [n for n in nodes if layers.node_layer.get(n.name) is None and _projection(n, params) is not None]
    tied = bool(heads_out) and _projection(heads_out[-1], params)[0] is word
    positions = any(t.args[0] is not word for t in tables)
    experts = {} if not moe else dict(experts=moe["experts"], top_k=moe["top_k"], expert_ffn=moe["expert_ffn"],
                                      shared_expert_ffn=shared, moe_every=moe["every"])
    saved = None
    if not moe:  # an expert layer's rows depend on the routing: its activations keep the formulas
        batch = int(next(n for n in gm.graph.nodes if n.op == "placeholder" and n.name not in params
                         and n.meta["val"].dim() >= 1 and n.meta["val"].shape[-1] == seq_len).meta["val"].numel())
        regions = split_regions([(before, after[0]), (after[1:-1], after[-1])])
        saved = saved_census(gm, layers.node_layer, params, regions, heads_out[-1] if heads_out else None,
                             tables, batch)
    calls = [n for n in nodes if n.op == "call_function"]
    order = {n: i for i, n in enumerate(calls)}
    in_layers = [order[n] for n in calls if n.name in layers.node_layer]
    outside = [n for n in calls if n.name not in layers.node_layer]
    graph_nodes = (sum(order[n] < in_layers[0] for n in outside), len(first),
                   sum(order[n] > in_layers[-1] for n in outside))
    return ModelSpec(layers=layers.count, hidden=hidden, heads=heads, seq_len=seq_len, vocab=vocab, ffn=ffn,
                     kv_heads=kv, gated_mlp=gated, dropout=dropout,
                     fused_attention=attn.target == aten.scaled_dot_product_attention.default,
                     tied_head=tied, learned_positions=positions, name=name, saved=saved,
                     graph_nodes=graph_nodes, **experts)


def _experts(gm: fx.GraphModule, params: set[str], layers, name: str) -> dict | None:
    """The mixture-of-experts layers (``passes/experts.find_experts``) as the planner's fields: E, k, one
    expert's width (the last grouped matmul's input features) and its up projections' (the first's
    output), the layers holding them and the ``moe_every`` that picks those; None for a dense model."""
    found = find_experts(gm, dict.fromkeys(params, ""))
    if not found:
        return None
    nodes = {n.name: n for n in gm.graph.nodes}
    first = found[0]
    at = sorted({layers.node_layer.get(x.grouped[0]) for x in found} - {None})
    every = next((m for m in range(1, layers.count + 1)
                  if at == [i for i in range(layers.count) if (i + 1) % m == 0]), None)
    if every is None:
        raise SpecError(f"{name}: the mixture-of-experts layers are {at} of {layers.count}, which no moe_every "
                        f"picks (layer i when (i + 1) % moe_every == 0); give the dimensions by hand "
                        f"(autopar plan --experts --top-k --expert-ffn --moe-every)")
    ups = int(nodes[first.grouped[0]].meta["val"].shape[-1])
    width = int(nodes[first.grouped[-1]].args[0].meta["val"].shape[-1])
    return dict(experts=first.experts, top_k=first.top_k or 1, expert_ffn=width, expert_ups=ups,
                layers=set(at), every=every)


def _projection(n: fx.Node, params: set[str]) -> tuple[fx.Node, int, int] | None:
    """(weight, in features, out features) of a projection by a parameter: ``linear(x, W)``
    (W stored (out, in)), ``addmm(bias, x, W)`` or ``mm(x, W)`` (W stored (in, out)); else None."""
    if n.target == aten.linear.default:
        w = n.args[1]
        out_features, in_features = _shape(w)
    elif n.target in (aten.addmm.default, aten.mm.default):
        w = n.args[-1]
        if not isinstance(w, fx.Node) or len(_shape(w)) != 2:
            return None
        in_features, out_features = _shape(w)
    else:
        return None
    return (w, in_features, out_features) if isinstance(w, fx.Node) and w.name in params else None


_DROPOUTS = (aten.dropout.default, aten.native_dropout.default)


def _attention(nodes: list[fx.Node], seq_len: int) -> fx.Node | None:
    """The layer's attention: an sdpa call, or the first q @ k^T of 4-D (batch, heads, seq, d)
    values giving (batch, heads, seq, seq) scores."""
    for n in nodes:
        if n.target == aten.scaled_dot_product_attention.default and len(_shape(n.args[0])) == 4:
            return n
    for n in nodes:
        if n.target in (aten.matmul.default, aten.bmm.default) and len(_shape(n.args[0])) == 4:
            out = _shape(n)
            if out[-2:] == (seq_len, seq_len):
                return n
    return None


