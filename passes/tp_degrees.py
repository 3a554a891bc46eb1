"""Which tensor-parallel degrees split a model whole, and why a degree does not.

The sharding analysis run with every divisibility satisfied (t = 1 with the
vocabulary split, ``sharding.ideal_decisions``) finds the plan the model's
structure allows. Each column-parallel linear opens a *region* of values split
on one dimension, closed by a row-parallel linear, a vocabulary-parallel loss
or a fallback. Every size on a region's split dimension must divide by t:

- the linear's output features (each segment of a fused projection),
- the heads a view cuts them into: the graph viewing the split dimension as
  (heads, head_dim) makes it a head dimension; whether they are query or
  key/value heads is read from the attention op they reach,
- any other value split there.

A region whose every end is a vocabulary-parallel kernel holds a vocabulary:
it is padded to a multiple of t and constrains nothing; nor does one that only
ends in fallbacks (split only to be gathered again, it may as well stay whole:
a one-feature gate). So the degrees that
work for the whole model are the divisors of the greatest common divisor of
all the sizes, and a degree that fails is explained by the sizes it does not
divide, heads first (they explain the features they are made of).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.fx as fx

from autopar.core.graph import module_path, source_line
from autopar.core.tensor_placement import Shard
from passes.rules.decision import Decision

__all__ = ["SplitDim", "ModelSplits", "model_splits", "tp_error", "HEADS", "QUERY_HEADS", "KV_HEADS", "FEATURES", "VALUE"]

aten = torch.ops.aten

HEADS, QUERY_HEADS, KV_HEADS = "heads", "attention heads", "key/value heads"
FEATURES, VALUE = "output features", "split dimension"
_EXPLAINS_FIRST = (QUERY_HEADS, KV_HEADS, HEADS, FEATURES, VALUE)
"""Kinds in the order a failure is explained: heads explain the features made of them."""

_VIEWS = (aten.view.default, aten.reshape.default, aten._unsafe_view.default, aten.unflatten.int)


@dataclass(frozen=True)
class SplitDim:
    """One size on a split dimension: every tensor-parallel degree must divide it."""

    size: int
    kind: str
    """``HEADS``/``QUERY_HEADS``/``KV_HEADS``, ``FEATURES`` or ``VALUE``."""
    region: str
    """The column-parallel linear that opens the region (a node name)."""
    module: str
    """Where the user finds it: the module of the linear, or of the view for heads (the attention)."""
    line: str
    """The model's source line of the node that shows the size (the view, the linear)."""
    detail: str = ""
    """How the size arises ("64 output features viewed as 8 heads of 8")."""


@dataclass(frozen=True)
class ModelSplits:
    """Every size a tensor-parallel plan of the model splits, and its padded vocabularies."""

    dims: tuple[SplitDim, ...]
    vocabularies: tuple[SplitDim, ...]

    @property
    def degrees(self) -> list[int]:
        """The tensor-parallel degrees that divide every split size (up to 1024)."""
        g = math.gcd(*(d.size for d in self.dims)) if self.dims else 0
        return [t for t in range(1, 1025) if g == 0 or g % t == 0]

    def failing(self, tp: int) -> list[SplitDim]:
        """The sizes ``tp`` does not divide that explain the failure: per region, those of the first
        kind (in ``_EXPLAINS_FIRST`` order) with a size ``tp`` does not divide."""
        out = []
        for region in dict.fromkeys(d.region for d in self.dims):
            bad = [d for d in self.dims if d.region == region and d.size % tp]
            for kind in _EXPLAINS_FIRST:
                if any(d.kind == kind for d in bad):
                    out.extend(d for d in bad if d.kind == kind)
                    break
        return out


def model_splits(decisions: dict[fx.Node, Decision]) -> ModelSplits:
    """The split sizes of the plan ``decisions`` (the analysis run with every divisibility satisfied)."""
    dims: list[SplitDim] = []
    vocabularies: list[SplitDim] = []
    for linear, dec in decisions.items():
        if dec.kind != "column":
            continue
        nodes, ends = _region(linear, decisions)
        features = _region_features(linear, decisions[linear])
        kinds = {decisions[e].kind for e in ends}
        if kinds and all(k.startswith("vocab_") for k in kinds):
            vocabularies.extend(features)
        if not any(k != "fallback" and not k.startswith("vocab_") for k in kinds):
            continue  # a vocabulary (padded), or a region only gathered again: whole is as good
        dims.extend(features)
        dims.extend(_region_heads(linear, nodes, decisions))
        dims.extend(_region_values(linear, nodes, decisions))
    return ModelSplits(tuple(_name_mha_heads(dims)), tuple(vocabularies))


def _region(linear: fx.Node, decisions: dict[fx.Node, Decision]) -> tuple[list[fx.Node], list[fx.Node]]:
    """The nodes holding values split by ``linear``'s region, and the nodes that end it."""
    nodes, ends, todo, seen = [], [], [linear], set()
    while todo:
        n = todo.pop()
        dec = decisions.get(n)
        if n in seen or dec is None:
            continue
        seen.add(n)
        if n is not linear and (dec.ends_region or dec.kind == "fallback"):
            ends.append(n)
        elif any(isinstance(p, Shard) for p in _flat(dec.out)):
            nodes.append(n)
            todo.extend(n.users)
    return nodes, ends


def _region_features(linear: fx.Node, dec: Decision) -> list[SplitDim]:
    """The column-parallel linear's output features, one entry per segment of a fused projection."""
    sizes = _split_sizes(linear, dec.out)
    detail = f"a fused projection of {sum(sizes)} features in segments {list(sizes)}" if len(sizes) > 1 else ""
    return [SplitDim(s, FEATURES, linear.name, module_path(linear), source_line(linear), detail) for s in sizes]


def _region_heads(linear: fx.Node, nodes: list[fx.Node], decisions: dict[fx.Node, Decision]) -> list[SplitDim]:
    """Views that cut the split dimension into (heads, head_dim): the heads, named by the attention
    operand they become (query or key/value) when they reach a scaled dot-product attention."""
    out = []
    for n in nodes:
        if n.target not in _VIEWS or not isinstance(decisions[n].out, Shard):
            continue
        before = _split_sizes(n.args[0], decisions[n.args[0]].out)
        after = _split_sizes(n, decisions[n].out)
        if max(after) >= min(before) or any(b % a for b in before for a in after):
            continue
        head_dim = min(before) // max(after)
        kind = _attention_role(n, set(nodes))
        for heads in dict.fromkeys(after):
            out.append(SplitDim(heads, kind, linear.name, module_path(n), source_line(n),
                                f"{sum(before)} features viewed as {heads} heads of {head_dim}"))
    return out


def _region_values(linear: fx.Node, nodes: list[fx.Node], decisions: dict[fx.Node, Decision]) -> list[SplitDim]:
    """Every other size on the split dimension (each distinct one once)."""
    seen: set[int] = set()
    out = []
    for n in nodes:
        for size in _split_sizes(n, decisions[n].out):
            if size not in seen:
                seen.add(size)
                out.append(SplitDim(size, VALUE, linear.name, module_path(linear), source_line(n),
                                    f"node {n.name} split on a dimension of {size}"))
    return out


def _attention_role(view: fx.Node, region: set[fx.Node]) -> str:
    """``QUERY_HEADS`` or ``KV_HEADS`` by the scaled dot-product attention operand the view's values
    become (query: argument 0; key, value: 1, 2), ``HEADS`` when they reach none."""
    todo, seen = [view], set()
    while todo:
        n = todo.pop(0)
        for user in n.users:
            if "scaled_dot_product" in str(user.target):
                position = next(i for i, a in enumerate(user.args) if a is n)
                return QUERY_HEADS if position == 0 else KV_HEADS if position in (1, 2) else HEADS
            if user in region and user not in seen:
                seen.add(user)
                todo.append(user)
    return HEADS


def _name_mha_heads(dims: list[SplitDim]) -> list[SplitDim]:
    """Key/value heads as many as the query heads are just the attention heads (no grouped query)."""
    query = {d.size for d in dims if d.kind == QUERY_HEADS}
    return [SplitDim(d.size, QUERY_HEADS, d.region, d.module, d.line, d.detail)
            if d.kind == KV_HEADS and d.size in query else d for d in dims]


def _split_sizes(node: fx.Node, placement) -> tuple[int, ...]:
    """The sizes the ranks split on ``node``'s split dimension(s): each segment, or the whole dim."""
    vals = node.meta.get("val")
    vals = vals if isinstance(vals, (tuple, list)) else (vals,)
    sizes = []
    for p, v in zip(_flat(placement), vals, strict=False):  # an output without a value has no size
        if isinstance(p, Shard) and isinstance(v, torch.Tensor):
            sizes.extend(p.segments if p.segments is not None else (int(v.shape[p.dim]),))
    return tuple(sizes)


def _flat(p) -> list:
    return [x for item in p for x in _flat(item)] if isinstance(p, tuple) else [p]


def tp_error(splits: ModelSplits, tp: int, model_name: str) -> str:
    """Why ``tp`` cannot split the model: the sizes it does not divide (where, which source line),
    the degrees that divide every split size, and the fix."""
    lines = [f"tp={tp} cannot split {model_name}: tensor parallelism cuts these dimensions {tp} ways, "
             f"and {tp} does not divide them:"]
    for (kind, size), dims in _grouped(splits.failing(tp)).items():
        first = dims[0]
        modules = list(dict.fromkeys(d.module or "(top level)" for d in dims))
        more = f" and {len(modules) - 2} more" if len(modules) > 2 else ""
        lines.append(f"  - the {size} {kind} of {', '.join(modules[:2])}{more}"
                     + (f": {first.detail}" if first.detail else "") + (f" at {first.line}" if first.line else ""))
    degrees = splits.degrees
    works = [t for t in degrees if t <= 64]
    lines.append(f"tp values that split the whole model: {', '.join(map(str, works))}"
                 f"{' (and larger divisors)' if len(works) < len(degrees) else ''}: they divide "
                 f"every split dimension ({_summary(splits.dims)})" + _vocabulary_note(splits) + ".")
    failing_kinds = " and ".join(dict.fromkeys(f"its {kind}" for kind, _ in _grouped(splits.failing(tp))))
    lines.append(f"Fix: use {_nearest(works, tp)} (or another of {works}), or change the model so that {tp} "
                 f"divides {failing_kinds}.")
    return "\n".join(lines)


def _nearest(works: list[int], tp: int) -> str:
    """The working degrees next to ``tp``, below and above (``tp=2 or tp=4``); tp=1 if none other."""
    below = max((t for t in works if 1 < t < tp), default=None)
    above = min((t for t in works if t > tp), default=None)
    return " or ".join(f"tp={t}" for t in (below, above) if t is not None) or "tp=1"


def _grouped(dims: list[SplitDim]) -> dict[tuple[str, int], list[SplitDim]]:
    """Sizes by (kind, size), in order of first appearance."""
    out: dict[tuple[str, int], list[SplitDim]] = {}
    for d in dims:
        out.setdefault((d.kind, d.size), []).append(d)
    return out


def _summary(dims: tuple[SplitDim, ...]) -> str:
    """``8 attention heads, 4 key/value heads, 512 output features``: per region the sizes of the
    kind that explains the others (heads imply the features they are made of), each once."""
    primary = []
    for region in dict.fromkeys(d.region for d in dims):
        own = [d for d in dims if d.region == region]
        kind = next(k for k in _EXPLAINS_FIRST if any(d.kind == k for d in own))
        primary.extend(d for d in own if d.kind == kind)
    return ", ".join(f"{size} {kind}" for kind, size in _grouped(primary))


def _vocabulary_note(splits: ModelSplits) -> str:
    if not splits.vocabularies:
        return ""
    sizes = sorted({d.size for d in splits.vocabularies})
    where = ", ".join(dict.fromkeys(d.module or "(top level)" for d in splits.vocabularies))
    return (f"; the vocabulary of {', '.join(map(str, sizes))} ({where}) is padded to a multiple of tp "
            f"and does not constrain it")
