"""Context parallelism, found from the rank graph: the sequence split over cp ranks for every layer.

Each of the cp ranks of a context-parallel group keeps 1/cp of every
sequence's tokens for the whole model (``cp_layout``: the load-balanced
layout, chunks r and 2cp-1-r, when any attention is causal; contiguous
chunks otherwise). The pass rewrites the tensor-parallel rank graph so that
it runs on those tokens:

- **The sequence.** Attention fixes it: the query length S of the graph's
  ``scaled_dot_product_attention`` nodes (keys of the same length: self
  attention). Every batch tensor (input or target) with a dim of S tokens
  is split along it (the last such dim, so (B, S) ids split S even when
  B = S): the runtime hands each rank its tokens (``program.context``).
- **Propagation.** ``Shard(sequence dim)`` flows forward from those inputs
  with the sharding rules of ``passes/rules/`` (the split counted cp ways):
  pointwise ops, norms and linears over the features, views (their sizes
  made local), the tensor-parallel collectives, which act token by token.
- **Positions.** A value every rank holds whole along the sequence (a
  position embedding looked up by ``arange``, a rotary table, a causal mask)
  that meets split tokens is cut to the rank's positions (``cp_tokens``), so
  learned and rotary positions follow the rank's tokens in either layout.
- **Attention** over split queries, keys and values becomes
  ``cp_attention``: ring attention with exact online-softmax merging, its
  backward included. Causal or not comes from ``is_causal``, or from the mask
  the model built: a mask made from positions only (no input) is evaluated
  on a sample of positions, deferring its broadcast, and must be the causal
  mask or all true (``_mask_kind``).
- **The loss** is computed on the rank's tokens: a token-mean loss is then
  the mean over the rank's counted targets, which the runtime weighs by the
  counts of every rank (``runtime/engine/loss_weights.py``), as it does the
  data-parallel replicas'.

Anything else that needs the whole sequence (a sum or cumulative op over the
tokens, a view that breaks the split, a mask from an input, an attention
with dropout, cross attention) is refused with a ``ContextParallelError``
naming the node, its module and source line; the model still trains with
cp=1.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

import torch
import torch.fx as fx

from autopar.core import comm
from autopar.core.comm.context_parallel import cp_attention, cp_tokens
from autopar.core.comm.cp_layout import ContextParallelError, ContextSplit
from autopar.core.graph import module_path, source_line
from autopar.core.tensor_placement import Replicate, Shard
from passes.rules import Ctx, Decision, NeedSegments, decide
from passes.rules.context import operand
from passes.sequence_parallel import local_shapes_as_val, split_kept
from passes.tensor_parallel import set_operand
from passes.vocab_parallel import copy_meta

aten = torch.ops.aten

__all__ = ["ContextPlan", "apply_context_parallel", "context_inputs"]

_ATTENTION = (aten.scaled_dot_product_attention.default,)
_TOKENWISE = (comm.copy_to_tp, comm.reduce_from_tp)
"""Tensor-parallel collectives that act on each token alone: a split along the tokens passes through."""
_LOOKUPS = (aten.embedding.default, comm.vocab_parallel_embedding)
"""Tables looked up by ids (the table first, the ids second): the rows come out where the ids are, so
ids split along the tokens give embeddings split the same way."""
_MASK_SAMPLE = 64
"""Positions a mask is evaluated at (the ends, the middle, the rest drawn with a fixed seed)."""


@dataclass(frozen=True)
class ContextPlan:
    """What the pass did, for the summary."""

    split: ContextSplit
    attention: tuple[str, ...]
    """The attention nodes now ring attention (``cp_attention``)."""
    causal: tuple[bool, ...]
    """Per attention node: causal or not."""
    narrowed: tuple[str, ...]
    """Values held whole along the sequence cut to the rank's positions (``cp_tokens``)."""
    op_kinds: dict[str, int] = field(default_factory=dict)
    """Op name -> how many nodes of it run on the rank's tokens."""
    kv_shapes: tuple[tuple[int, ...], ...] = ()
    """Each attention's local key shape (B, Hkv, S/cp, D), and ``kv_dtypes`` its dtype: the ring's traffic."""
    kv_dtypes: tuple[torch.dtype, ...] = ()


def context_inputs(traced, gm: fx.GraphModule, split: ContextSplit) -> dict[str, tuple[int, ...]]:
    """Batch placeholder -> its shape on one context-parallel rank (the sequence dim cut cp ways)."""
    out = {}
    for node in gm.graph.nodes:
        if node.op == "placeholder" and node.name in split.seq_dims:
            shape = list(node.meta["val"].shape)
            shape[split.seq_dims[node.name]] //= split.cp
            out[node.name] = tuple(shape)
    return out


def apply_context_parallel(gm: fx.GraphModule, param_of: dict[str, str], batch_names: list[str], cp: int,
                           model_name: str) -> ContextPlan | None:
    """Rewrite the rank graph ``gm`` (local shapes in ``meta["local_val"]``) in place to run on one
    context-parallel rank's tokens; the plan, or None for cp = 1."""
    if cp == 1:
        return None
    nodes = list(gm.graph.nodes)
    with local_shapes_as_val(nodes):
        attention = find_attention(nodes)
        if not attention:
            raise ContextParallelError(
                f"cp={cp} splits the sequence over {cp} ranks for every layer, and attention exchanges keys and values "
                f"between them; {model_name} has no attention autopar can rewrite (it looks for "
                f"scaled_dot_product_attention, and for softmax(q @ k^T * scale + mask) @ v written out). Fix: cp=1")
        seq_len, causal = _sequence(attention, model_name)
        balanced = any(causal.values())
        seeds = _seeds(nodes, batch_names, seq_len, cp, balanced)
        split = ContextSplit(cp, balanced, seq_len, {name: p.dim for name, p in seeds.items()})
        ctx = Ctx(cp, dict(param_of), set(), set())
        region, decisions = _propagate(nodes, ctx, seeds, attention, seq_len)
    narrowed = _rewrite(gm, region, decisions, attention, causal, split)
    kinds = Counter(getattr(n.target, "__name__", str(n.target)).replace(".default", "")
                    for n in gm.graph.nodes if n.name in region and n.op == "call_function")
    kv = [n.args[2] for n in gm.graph.nodes if n.op == "call_function" and n.target is cp_attention]
    return ContextPlan(split, tuple(a.out.name for a in attention), tuple(causal[a.out] for a in attention),
                       tuple(narrowed),
                       dict(kinds), tuple(tuple(int(s) for s in k.meta["local_val"].shape[:-2]) +
                                          (int(k.meta["local_val"].shape[-2]) // cp, int(k.meta["local_val"].shape[-1]))
                                          for k in kv),
                       tuple(k.meta["local_val"].dtype for k in kv))


# ------------------------------------------------------------------ the sequence and its attention


@dataclass(frozen=True)
class _Attention:
    """One attention of the graph: ``out`` computes softmax(q k^T * scale + mask) v, by
    ``scaled_dot_product_attention`` or written out (``interior``: the scores, their scaling and mask,
    the softmax and the casts between the two matmuls, all replaced with ``out``)."""

    out: fx.Node
    q: fx.Node
    k: fx.Node
    v: fx.Node
    mask: fx.Node | None
    scale: float | None
    is_causal: bool
    dropout: float
    interior: tuple[fx.Node, ...] = ()


_SOFTMAX = (aten.softmax.int, aten._softmax.default)
_MATMUL = (aten.matmul.default, aten.bmm.default)
_CASTS = (aten.to.dtype, aten._to_copy.default, aten.to.dtype_layout, aten.clone.default, aten.alias.default,
          aten.type_as.default)


def find_attention(nodes: list[fx.Node]) -> list[_Attention]:
    """Every attention of the graph, in graph order: scaled_dot_product_attention nodes, and the form
    written out, softmax(q @ k^T (* or / a scale) (+ a mask), dim=-1) (cast, dropout) @ v."""
    found = []
    for n in nodes:
        if n.op != "call_function":
            continue
        if n.target in _ATTENTION:
            found.append(_Attention(n, n.args[0], n.args[1], n.args[2], _arg(n, 3, "attn_mask", None),
                                    _arg(n, 6, "scale", None), bool(_arg(n, 5, "is_causal", False)),
                                    float(_arg(n, 4, "dropout_p", 0.0))))
        elif n.target in _SOFTMAX:
            written = _written_out(n)
            if written is not None:
                found.append(written)
    return found


def _written_out(softmax: fx.Node) -> _Attention | None:
    """The attention around ``softmax`` when it is the written-out form, else None."""
    x = softmax.args[0]
    if _arg(softmax, 1, "dim", -1) % x.meta["val"].dim() != x.meta["val"].dim() - 1:
        return None
    interior, scale, mask = [softmax], 1.0, None
    while x.op == "call_function" and x.target not in _MATMUL:
        if len(x.users) != 1:
            return None
        interior.append(x)
        if x.target in (aten.mul.Tensor, aten.div.Tensor) and not isinstance(x.args[1], fx.Node):
            scale = scale * x.args[1] if x.target == aten.mul.Tensor else scale / x.args[1]
            x = x.args[0]
        elif x.target == aten.add.Tensor and mask is None and all(isinstance(a, fx.Node) for a in x.args[:2]):
            scores, mask = (x.args[0], x.args[1]) if _reaches_matmul(x.args[0]) else (x.args[1], x.args[0])
            x = scores
        elif x.target in _CASTS:
            x = x.args[0]
        else:
            return None
    if x.op != "call_function" or len(x.users) != 1:
        return None
    q, kt = x.args[0], x.args[1]
    if kt.op != "call_function" or kt.target != aten.transpose.int or q.meta["val"].dim() != 4:
        return None
    if {d % 4 for d in kt.args[1:3]} != {2, 3}:
        return None
    interior.append(x)
    y, dropout = softmax, 0.0
    while True:
        if len(y.users) != 1:
            return None
        u = next(iter(y.users))
        if u.target in _MATMUL and u.args[0] is y:
            return _Attention(u, q, kt.args[0], u.args[1], mask, scale, False, dropout, tuple(interior))
        if u.target in (aten.dropout.default, aten.native_dropout.default):
            train = _arg(u, 2, "train", True)
            dropout = float(u.args[1]) if train is not False else 0.0
            if u.target == aten.native_dropout.default:
                return None
        elif u.target not in _CASTS:
            return None
        interior.append(u)
        y = u


def _reaches_matmul(x: fx.Node) -> bool:
    """``x`` is the scores: a matmul, through scalings and casts."""
    while x.op == "call_function" and x.target not in _MATMUL:
        if x.target in (aten.mul.Tensor, aten.div.Tensor, *_CASTS):
            x = x.args[0]
        else:
            return False
    return x.op == "call_function"


def _where(node: fx.Node) -> str:
    return f"node {node.name} in {module_path(node) or 'the model'} ({source_line(node) or 'no source line'})"


def _sequence(attention: list[_Attention], model_name: str) -> tuple[int, dict[fx.Node, bool]]:
    """The sequence length (the attentions' query length) and whether each attention is causal (by
    its output node)."""
    lengths, causal = set(), {}
    for att in attention:
        node, q, k = att.out, att.q, att.k
        sq, sk = int(q.meta["val"].shape[-2]), int(k.meta["val"].shape[-2])
        if sq != sk:
            raise ContextParallelError(f"cp splits the sequence of self attention, and {_where(node)} attends "
                                       f"{sq} queries to {sk} keys (cross attention or a cache). Fix: cp=1")
        dropout = att.dropout
        if dropout:
            raise ContextParallelError(f"{_where(node)} drops attention weights (dropout_p={dropout}): ring attention "
                                       f"computes the softmax in blocks and draws no dropout. Fix: attention dropout "
                                       f"0 for training with cp (e.g. the config's attention_dropout), or cp=1")
        lengths.add(sq)
        causal[node] = _causal(att, sq)
    if len(lengths) > 1:
        raise ContextParallelError(f"cp splits one sequence length, and {model_name}'s attentions see "
                                   f"{sorted(lengths)} tokens. Fix: cp=1")
    return lengths.pop(), causal


def _arg(node: fx.Node, index: int, name: str, default):
    return node.args[index] if len(node.args) > index else node.kwargs.get(name, default)


def _causal(att: _Attention, seq_len: int) -> bool:
    """Whether the attention is causal: its ``is_causal``, or the mask it reads evaluated on positions."""
    mask = att.mask
    if mask is None:
        return att.is_causal
    kind, why = _mask_kind(mask, seq_len)
    if kind is None:
        raise ContextParallelError(f"{_where(att.out)} reads a mask ({mask.name}) ring attention cannot follow: {why}. "
                                   f"Context parallelism runs causal attention or attention over every token. "
                                   f"Fix: cp=1 (the model trains without context parallelism)")
    return kind == "causal"


def _sample_positions(seq_len: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(0)
    ends = [0, 1, 2, 3, seq_len // 2 - 1, seq_len // 2, seq_len // 2 + 1, seq_len - 3, seq_len - 2, seq_len - 1]
    drawn = torch.randint(0, seq_len, (_MASK_SAMPLE,), generator=gen).tolist()
    return torch.tensor(sorted({p for p in ends + drawn if 0 <= p < seq_len}), dtype=torch.int64)


def _mask_kind(mask: fx.Node, seq_len: int) -> tuple[str | None, str]:
    """'causal', 'full', or None and why: the mask's subgraph run with every ``arange`` over the
    sequence replaced by a sample of positions and its broadcasts deferred, so a mask of S x S is
    checked on K x K entries."""
    order = {n: i for i, n in enumerate(mask.graph.nodes)}
    seen, todo = set(), [mask]
    while todo:
        n = todo.pop()
        if n in seen:
            continue
        seen.add(n)
        if n.op == "placeholder":
            return None, f"it is computed from the input {n.name} (a padding mask)"
        if n.op != "call_function":
            return None, f"it reads {n.name} ({n.op})"
        todo.extend(n.all_input_nodes)
    positions = _sample_positions(seq_len)
    env: dict[fx.Node, object] = {}
    for n in sorted(seen, key=order.__getitem__):
        args, kwargs = torch.fx.node.map_arg((n.args, n.kwargs), env.__getitem__)
        if n.target in (aten.arange.default, aten.arange.start, aten.arange.start_step):
            full = n.target(*args, **{k: v for k, v in kwargs.items() if k != "device"}, device="cpu")
            if full.numel() == seq_len:
                env[n] = positions.to(full.dtype) + full[0]
                continue
            env[n] = full
        elif n.target in (aten.expand.default, aten.expand_copy.default):
            env[n] = args[0]  # the broadcast happens when compared
        elif n.target in (aten.view.default, aten.reshape.default, aten._unsafe_view.default):
            return None, f"it reshapes its positions ({n.name})"
        else:
            try:
                env[n] = n.target(*args, **{k: (torch.device("cpu") if k == "device" else v) for k, v in kwargs.items()})
            except Exception as e:  # noqa: BLE001 - any op that cannot run on the sample: not a form we follow
                return None, f"{n.name} ({n.target}) cannot be evaluated on positions: {type(e).__name__}"
    value = env[mask]
    if not isinstance(value, torch.Tensor) or value.dim() < 2:
        return None, "it is not a (..., queries, keys) tensor"
    k = positions.numel()
    value = torch.broadcast_to(value, (*value.shape[:-2], k, k)) if value.shape[-2:] != (k, k) else value
    allowed = value if value.dtype == torch.bool else value == 0
    rows = allowed.reshape(-1, k, k)
    if not bool((rows == rows[:1]).all()):
        return None, "it differs between sequences or heads"
    allowed = rows[0]
    if bool(allowed.all()):
        return "full", ""
    if torch.equal(allowed, positions[None, :] <= positions[:, None]):
        return "causal", ""
    return None, "it is neither causal nor all true (a sliding window, a prefix, a document mask)"


def _seeds(nodes: list[fx.Node], batch_names: list[str], seq_len: int, cp: int, balanced: bool) -> dict[str, Shard]:
    """Batch placeholders with a dim of ``seq_len`` tokens -> ``Shard`` of their last such dim."""
    from autopar.core.comm.cp_layout import check_cp_divisible

    check_cp_divisible(seq_len, cp, balanced)
    seeds = {}
    for n in nodes:
        if n.op == "placeholder" and n.name in batch_names:
            shape = tuple(int(s) for s in n.meta["val"].shape)
            dims = [d for d, s in enumerate(shape) if s == seq_len]
            if dims:
                seeds[n.name] = Shard(dims[-1])
    if not seeds:
        raise ContextParallelError(f"cp splits the sequence of the batch, and no input or target has a dim of the "
                                   f"{seq_len} tokens the attention sees. Fix: cp=1")
    return seeds


# ------------------------------------------------------------------ propagation


def _propagate(nodes: list[fx.Node], ctx: Ctx, seeds: dict[str, Shard], attention: list[_Attention],
               seq_len: int) -> tuple[dict[str, object], dict[str, Decision]]:
    """Forward from the seeds: region (node -> placement) and the region's decisions. What ends the
    region is the loss (its value returned) or an error."""
    region: dict[str, object] = dict(seeds)
    decisions: dict[str, Decision] = {}
    outs = {a.out: a for a in attention}
    inside = {n for a in attention for n in a.interior}
    for n in nodes:
        if n.op != "call_function" or n.name in region or not any(a.name in region for a in n.all_input_nodes):
            continue
        if n in inside:
            continue
        if n in outs:
            region[n.name] = _attention_placement(outs[n], region)
            continue
        if n.target in _TOKENWISE or n.target in _LOOKUPS:
            first = n.args[1] if n.target in _LOOKUPS else n.args[0]
            if n.target in _LOOKUPS and n.args[0].name in region:
                raise ContextParallelError(f"{_where(n)} looks up a table split along the sequence. Fix: cp=1")
            region[n.name] = region[first.name] if first.name in region else Replicate()
            continue
        joined = _cat_with_empty(n, region)
        if joined is not None:  # a key/value cache that starts empty, joined to the new keys: the keys
            region[n.name] = joined
            continue
        try:
            dec = decide(ctx, n, lambda a: region.get(a.name, Replicate()))
        except NeedSegments:
            dec = None
        why = split_kept(n, dec, every_output=False, replicated_ok=True)
        if why is None:
            region[n.name] = dec.out
            decisions[n.name] = dec
        elif not _is_loss_end(n):
            raise ContextParallelError(f"cp keeps 1/cp of the tokens for the whole model, and {_where(n)} "
                                       f"needs the whole sequence: {why}. Fix: cp=1 (the model trains without "
                                       f"context parallelism)")
    return region, decisions


def _cat_with_empty(n: fx.Node, region: dict[str, object]) -> Shard | None:
    """The placement of a ``cat`` along the split dim of one split value and values empty along it (an
    empty key/value cache joined to the new keys in training), which is that value's; else None."""
    if n.target != aten.cat.default:
        return None
    parts = n.args[0]
    dim = _arg(n, 1, "dim", 0)
    split = [p for p in parts if isinstance(p, fx.Node) and isinstance(region.get(p.name), Shard)]
    if len(split) != 1:
        return None
    placement = region[split[0].name]
    dim %= split[0].meta["val"].dim()
    if placement.dim != dim:
        return None
    others = [p for p in parts if p is not split[0]]
    if all(isinstance(p, fx.Node) and p.meta["val"].numel() == 0 for p in others):  # cat skips empty 1-D too
        return placement
    return None


def _attention_placement(att: _Attention, region: dict[str, object]) -> Shard:
    for x, what in ((att.q, "queries"), (att.k, "keys"), (att.v, "values")):
        p = region.get(x.name)
        if not isinstance(p, Shard) or p.dim != x.meta["val"].dim() - 2:
            raise ContextParallelError(f"{_where(att.out)}: its {what} ({x.name}) are not split along the "
                                       f"sequence like the batch ({p}), so ring attention cannot pass them around. "
                                       f"Fix: cp=1")
    return Shard(att.out.meta["val"].dim() - 2)


def _is_loss_end(n: fx.Node) -> bool:
    """A reduction of the rank's tokens to the loss the graph returns first: a scalar whose every use
    leads, through scalar ops, to the output."""
    val = n.meta.get("val")
    if not isinstance(val, torch.Tensor) or val.dim() != 0:
        return False
    todo, seen = [n], set()
    while todo:
        u = todo.pop()
        if u in seen:
            continue
        seen.add(u)
        for user in u.users:
            if user.op == "output":
                continue
            uval = user.meta.get("val")
            if not isinstance(uval, torch.Tensor) or uval.dim() != 0:
                return False
            todo.append(user)
    return True


# ------------------------------------------------------------------ rewrite


def _rewrite(gm: fx.GraphModule, region: dict[str, object], decisions: dict[str, Decision],
             attention: list[_Attention], causal: dict[fx.Node, bool], split: ContextSplit) -> list[str]:
    graph = gm.graph
    tp = next(iter(graph.nodes))
    by_name = {n.name: n for n in graph.nodes}
    inserted: dict[tuple, fx.Node] = {}
    for name, dec in decisions.items():
        node = by_name[name]
        for path, value in dec.local_args:
            set_operand(node, path, value)
        for path, sh in dec.scatter_in:
            src = operand(node, path)
            key = (src.name, sh.dim, sh.segments)
            if key not in inserted:
                with graph.inserting_before(node):
                    inserted[key] = copy_meta(graph.call_function(
                        cp_tokens, (src, tp, sh.dim, split.cp, split.balanced, sh.segments)), node)
            set_operand(node, path, inserted[key])
    for att in attention:
        node = att.out
        k, v = _unrepeated(att.k, region), _unrepeated(att.v, region)
        with graph.inserting_before(node):
            ring = copy_meta(graph.call_function(cp_attention, (tp, att.q, k, v, split.cp, causal[node],
                                                               split.balanced, att.scale)), node)
        node.replace_all_uses_with(ring)
        inputs = list(node.all_input_nodes)
        graph.erase_node(node)
        _erase_dead(graph, inputs)  # the scores, the softmax, the mask made for the whole sequence
    graph.lint()
    gm.recompile()
    return [name for name, *_ in inserted]


def _unrepeated(x: fx.Node, region: dict[str, object]) -> fx.Node:
    """The key or value heads before grouped-query attention repeated them (``repeat_kv``: unsqueeze at
    dim 2, expand n times, reshape to n x the heads), when ``x`` is that repeat: ring attention takes
    the fewer heads and repeats them inside each block, so only those travel. Else ``x``."""
    if x.target not in (aten.reshape.default, aten.view.default, aten._unsafe_view.default):
        return x
    expand = x.args[0]
    if not isinstance(expand, fx.Node) or expand.target != aten.expand.default:
        return x
    unsqueeze = expand.args[0]
    if not isinstance(unsqueeze, fx.Node) or unsqueeze.target != aten.unsqueeze.default or unsqueeze.args[1] != 2:
        return x
    heads = unsqueeze.args[0]
    before, after = heads.meta["val"].shape, x.meta["val"].shape
    if len(before) != 4 or len(after) != 4 or after[1] % before[1] or (after[0], *after[2:]) != (before[0], *before[2:]):
        return x
    return heads if isinstance(region.get(heads.name), Shard) else x


def _erase_dead(graph: fx.Graph, nodes: list[fx.Node]) -> None:
    """Erase each of ``nodes`` no one reads any more, and what only it read (pure ops only)."""
    todo = list(nodes)
    while todo:
        n = todo.pop()
        if n.op == "call_function" and not n.users and n.graph is graph and (not n.is_impure() or _random(n)):
            inputs = list(n.all_input_nodes)
            graph.erase_node(n)
            todo.extend(inputs)


def _random(n: fx.Node) -> bool:
    """A random op (a dropout between the softmax and the values): pure but for its draw."""
    return isinstance(n.target, torch._ops.OpOverload) and torch.Tag.nondeterministic_seeded in n.target.tags
