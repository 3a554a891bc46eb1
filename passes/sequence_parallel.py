"""Sequence parallelism, found from the rank graph (Korthikanti et al. 2022).

Between a row-parallel output (after g, the all-reduce) and the next
column-parallel input (f), tensor parallelism runs the ops whole on all t
ranks: norms, dropout, residual adds. This pass runs them on 1/t of the
tokens instead:

- every g whose value has a token dim t divides becomes a reduce-scatter along
  it (``comm.reduce_scatter_to_sp``; backward all-gather): a *seed*;
- ``Shard(token dim)`` is propagated forward with the sharding rules of
  ``passes/rules/`` for as long as an op keeps the value split without
  communicating (pointwise ops, replicated operands broadcast or narrowed,
  norms and reductions over other dims, dropout, views, a replicated linear);
- the region ends at each f, which becomes an all-gather along the token dim
  (``comm.gather_from_sp``; backward reduce-scatter, the sum f's all-reduce
  made), and at any op that needs the whole sequence (attention scores, a sum
  or cumulative op over the tokens, a view that breaks the split, the loss,
  an output): a gather (forward all-gather, backward local slice) before it,
  listed in the plan with its module path and why.

The token dim of a seed is derived from its shape: the largest of its leading
(non-feature) dims, the later one on a tie, so the sequence of (B, T, C) is
split, not a micro-batch of 1 or 2, and the flattened tokens of (B*T, C). A
flatten or reshape of a split value is followed by the view rules: one that
keeps a contiguous split stays in the region, one that does not ends it with
a gather (listed).

Replicated operands read whole by split tokens (norm weights and biases, the
bias of a row-parallel linear, a replicated linear's weight) get gradients
that are partial sums over the t ranks. When a parameter reaches split tokens
only (through parameter-only ops), its gradient is summed over the
tensor-parallel group once per step by the runtime (``partial_params``, as
Megatron does); otherwise (a parameter also read whole elsewhere, an
activation broadcast over the tokens) f is inserted, summing per microbatch.
Random ops on split tokens draw from the per-rank stream (``comm.tp_rng_call``).

The rules read global shapes from ``meta["val"]``; the rank graph's values
are one rank's, so the analysis runs with ``meta["val"]`` set to each node's
``meta["local_val"]`` (restored afterwards): every value it reasons about is
whole across the tensor-parallel ranks, where the two agree.
"""

from __future__ import annotations

import contextlib
import math
import operator
from collections import Counter
from dataclasses import dataclass, field

import torch
import torch.fx as fx

from autopar.core import comm
from autopar.core.collectives import collective_of
from autopar.core.errors import AutoparError
from autopar.core.graph import module_path
from autopar.core.tensor_placement import Replicate, Shard
from passes.rules import Ctx, Decision, NeedSegments, decide
from passes.rules.context import operand
from passes.tensor_parallel import random_on_shard, set_operand
from passes.vocab_parallel import copy_meta

__all__ = ["SequenceParallelError", "SequenceParallelPlan", "SequenceGather", "apply_sequence_parallel", "local_shapes_as_val", "split_kept",
           "SPLIT_META"]

SPLIT_META = "sequence_split"
"""``node.meta`` key of a value split along its tokens: its placement (the pipeline cut reads it)."""

_WHOLE_OUTPUT = (comm.reduce_from_tp, comm.gather_from_tp, comm.vocab_parallel_embedding,
                 comm.vocab_parallel_cross_entropy, comm.vocab_parallel_logsumexp, comm.vocab_parallel_nll_loss,
                 comm.vocab_parallel_soft_cross_entropy)
"""Collectives whose output is whole on every tensor-parallel rank whatever their inputs."""


_SEED_TARGETS = (comm.reduce_from_tp, comm.vocab_parallel_embedding)
"""Where a split region can start: g, and the vocabulary-parallel embedding (whose all-reduce is a g)."""


class SequenceParallelError(AutoparError, ValueError):
    """Sequence parallelism was asked for and cannot split the tokens; the message has the numbers and the fix."""


@dataclass(frozen=True)
class SequenceGather:
    """A gather sequence parallelism added: ``value`` all-gathered before ``consumer``."""

    consumer: str
    value: str
    module: str
    reason: str


@dataclass(frozen=True)
class SequenceParallelPlan:
    """What runs split along the tokens and what the split costs; read by the summary and the runtime."""

    tp: int
    split: dict[str, object]
    """Node -> its placement (``Shard`` on a token dim; a tuple for a multi-output op)."""
    op_kinds: dict[str, int]
    """Op name -> how many nodes of it run split on the tokens."""
    seeds: tuple[str, ...]
    """The g (all-reduce) nodes now reduce-scatters along the tokens."""
    f_gathers: tuple[str, ...]
    """The f (copy_to_tp) nodes now all-gathers along the tokens (backward reduce-scatter)."""
    gathers: tuple[SequenceGather, ...]
    """Gathers added before ops that need the whole sequence."""
    partial_params: tuple[str, ...]
    """Parameters read only by split tokens: gradients summed over the tp group once per step."""
    copies: tuple[str, ...]
    """Values broadcast over split tokens that got f (gradient summed per microbatch)."""
    token_dims: dict[str, int] = field(default_factory=dict)
    """Seed -> the token dim of its value, and that value's shape as text (for the summary)."""
    shapes: dict[str, str] = field(default_factory=dict)


def apply_sequence_parallel(gm: fx.GraphModule, param_of: dict[str, str], param_specs: dict, tp: int,
                            required: bool | None) -> SequenceParallelPlan | None:
    """Rewrite the rank graph ``gm`` (local shapes in ``meta["local_val"]``) in place for sequence
    parallelism; returns the plan, or None when it is off (``required`` False, tp = 1, or nothing to
    split while not required). ``required`` True raises ``SequenceParallelError`` when a seed's
    token dim is not a multiple of ``tp`` or no g exists."""
    if not required and required is not None or tp == 1:
        return None
    nodes = list(gm.graph.nodes)
    tp_split = _tp_split_values(nodes, param_specs)
    ctx = Ctx(tp, dict(param_of), _requires_grad(nodes, param_of), set())
    with local_shapes_as_val(nodes):
        seeds, problems = _seeds(nodes, tp)
        if problems and (required or not seeds):
            if required:
                raise SequenceParallelError(_dim_error(problems, tp))
            return None
        if problems:  # not asked for explicitly: on only where every seed can split
            return None
        if not seeds:
            if required:
                raise SequenceParallelError(
                    "sequence_parallel=True splits the tokens after each tensor-parallel all-reduce (g), and the "
                    "rank graph has none: no linear pair was split. Fix: sequence_parallel=False (or None)")
            return None
        region, decisions, ends = _propagate(nodes, ctx, seeds, tp_split)
    seeds = {s: p for s, p in seeds.items() if any(u.name in region for u in _node(nodes, s).users)}
    if not seeds:
        if required:
            raise SequenceParallelError("sequence_parallel=True found no op to run on split tokens after any "
                                        "all-reduce. Fix: sequence_parallel=False (or None)")
        return None
    region = _reachable(nodes, seeds, region)
    partial, copies = _partial_params(nodes, region, decisions, param_of)
    return _rewrite(gm, tp, seeds, region, decisions, ends, partial, copies, param_of)


# ------------------------------------------------------------------ analysis


@contextlib.contextmanager
def local_shapes_as_val(nodes: list[fx.Node]):
    """The rules read ``meta["val"]``: one rank's values while the analysis runs, restored after."""
    saved = {n: n.meta.get("val") for n in nodes}
    try:
        for n in nodes:
            if "local_val" in n.meta:
                n.meta["val"] = n.meta["local_val"]
        yield
    finally:
        for n, v in saved.items():
            if v is None:
                n.meta.pop("val", None)
            else:
                n.meta["val"] = v


def _tp_split_values(nodes: list[fx.Node], param_specs: dict) -> set[str]:
    """Values that differ across the tensor-parallel ranks (shards, partial sums): a parameter
    placed ``Shard``, a scatter, and whatever reads one, up to a collective that makes it whole."""
    split: set[str] = {n.name for n in nodes if n.op == "placeholder" and isinstance(param_specs.get(n.name), Shard)}
    for n in nodes:
        if n.op != "call_function" or n.target in _WHOLE_OUTPUT:
            continue
        if n.target is comm.scatter_to_tp or any(a.name in split for a in n.all_input_nodes):
            split.add(n.name)
    return split


def _requires_grad(nodes: list[fx.Node], param_of: dict[str, str]) -> set[str]:
    """Float values computed from a parameter: their gradients matter (f on a broadcast one)."""
    needs = set(param_of)
    for n in nodes:
        val = n.meta.get("local_val")
        if (n.op == "call_function" and isinstance(val, torch.Tensor) and val.dtype.is_floating_point
                and any(a.name in needs for a in n.all_input_nodes)):
            needs.add(n.name)
    return needs


def token_dim(shape: tuple[int, ...]) -> int | None:
    """The token dim of a value of ``shape`` (..., features): the largest leading dim, the later one
    on a tie; None for a value with no leading dim."""
    if len(shape) < 2:
        return None
    lead = list(shape[:-1])
    return max(range(len(lead)), key=lambda d: (lead[d], d))


def _seeds(nodes: list[fx.Node], tp: int) -> tuple[dict[str, Shard], list[tuple[fx.Node, int, tuple]]]:
    """g nodes whose value splits along its token dim -> that split; and (g, dim, shape) where t
    does not divide it."""
    seeds, problems = {}, []
    sequences = _sequence_shapes(nodes)
    for n in nodes:
        if n.op != "call_function" or n.target not in _SEED_TARGETS:
            continue
        shape = tuple(int(s) for s in n.meta["val"].shape)
        dim = token_dim(shape)
        if dim is None or shape[dim] == 1:
            continue
        if shape[dim] % tp:
            if n.target is comm.reduce_from_tp:  # the embedding then keeps its all-reduce
                problems.append((n, dim, shape))
        else:
            seeds[n.name] = Shard(dim, _segments(shape[dim], sequences, tp) if dim == len(shape) - 2 else None)
    return seeds, problems


def _sequence_shapes(nodes: list[fx.Node]) -> Counter:
    """How often each (..., sequences, tokens) leading shape occurs among the graph's values of
    three or more dims whose token dim is their last leading one: the layouts a flattened token
    dim may be viewed back to."""
    found: Counter = Counter()
    for n in nodes:
        val = n.meta.get("val")
        if isinstance(val, torch.Tensor) and val.dim() >= 3:
            lead = tuple(int(s) for s in val.shape[:-1])
            if token_dim(tuple(val.shape)) == len(lead) - 1 and math.prod(lead[:-1]) > 1:
                found[lead] += 1
    return found


def _segments(size: int, sequences: Counter, tp: int) -> tuple[int, ...] | None:
    """The split of a token dim of ``size`` that survives viewing it back as sequences: when the
    graph views ``size`` tokens as (B, T) (the most frequent such layout), each of the B sequences
    split t ways (segments of T), so the view keeps a split of T; else one contiguous split."""
    layouts = [(count, lead) for lead, count in sequences.items() if math.prod(lead) == size and lead[-1] % tp == 0]
    if not layouts:
        return None
    lead = max(layouts)[1]
    return (lead[-1],) * math.prod(lead[:-1])


def _dim_error(problems: list[tuple[fx.Node, int, tuple]], tp: int) -> str:
    node, dim, shape = problems[0]
    size = shape[dim]
    fits = [k * tp for k in range(max(1, size // tp), size // tp + 2)]
    return (f"sequence_parallel=True splits the tokens after each tensor-parallel all-reduce along their token "
            f"dim (the largest leading dim), but tp={tp} does not divide it: the all-reduce in module "
            f"'{module_path(node)}' has a value of shape {list(shape)}, token dim {dim} of size {size} "
            f"({len(problems)} such all-reduce(s)). Fix: a sequence length (example microbatch) that is a multiple "
            f"of {tp} (e.g. {' or '.join(map(str, fits))}), a tp that divides {size}, or sequence_parallel=False")


def _node(nodes: list[fx.Node], name: str) -> fx.Node:
    return next(n for n in nodes if n.name == name)


def _propagate(nodes: list[fx.Node], ctx: Ctx, seeds: dict[str, Shard], tp_split: set[str]):
    """Forward from the seeds: region (node -> placement), the region's decisions, and the ops that
    end it (consumer name -> why)."""
    region: dict[str, object] = dict(seeds)
    decisions: dict[str, Decision] = {}
    ends: dict[str, str] = {}
    for n in nodes:
        if n.op != "call_function" or n.name in region or not any(a.name in region for a in n.all_input_nodes):
            if n.op == "output":
                ends[n.name] = "a value the graph returns"
            continue
        why = _why_not_candidate(n, tp_split)
        if why is None:
            try:
                dec = decide(ctx, n, lambda a: region.get(a.name, Replicate()))
            except NeedSegments:
                dec = None
            why = _why_rejected(n, dec)
        if why is None:
            region[n.name] = dec.out
            decisions[n.name] = dec
        else:
            ends[n.name] = why
    return region, decisions, ends


def _why_not_candidate(n: fx.Node, tp_split: set[str]) -> str | None:
    if n.target is comm.copy_to_tp:
        return "f: the column-parallel region after it reads every token"
    if collective_of(n.target) is not None or n.target is comm.tp_rng_call:
        return "a tensor-parallel collective"
    if any(a.name in tp_split for a in n.all_input_nodes):
        return "it also reads a value split across the tensor-parallel ranks"
    return None


def _why_rejected(n: fx.Node, dec: Decision | None) -> str | None:
    """None when ``dec`` keeps the tokens split with no communication; else why the region ends here."""
    return split_kept(n, dec, every_output=True)


def split_kept(n: fx.Node, dec: Decision | None, every_output: bool, replicated_ok: bool = False) -> str | None:
    """None when ``dec`` runs ``n`` on this rank's tokens without communicating and keeps them split
    (every output, or at least one with ``every_output`` False; a replicated decision allowed with
    ``replicated_ok``: an op on split inputs that the rules leave as it is); else why not. Shared by
    sequence and context parallelism, which split the tokens alike."""
    if dec is None:
        return "a view that would cut the token split into pieces"
    kinds = ("sharded", "replicated") if replicated_ok else ("sharded",)
    if dec.kind not in kinds or dec.gather_in or dec.reduce_out or dec.rewrite is not None or dec.closes_region \
            or dec.error:
        if dec.reduce_out:
            return "it sums over the split tokens"
        return dec.reason or "it needs the whole sequence"
    outs = dec.out if isinstance(dec.out, tuple) else (dec.out,)
    split = [isinstance(p, Shard) for p in outs]
    if not (all(split) if every_output else any(split)):
        return "not every output keeps the tokens split" if every_output else "its result no longer has the tokens"
    if isinstance(dec.out, tuple) and any(u.target is not operator.getitem for u in n.users):
        return "a multi-output op read whole"
    return None


def _reachable(nodes: list[fx.Node], seeds: dict[str, Shard], region: dict[str, object]) -> dict[str, object]:
    """The region restricted to what the kept seeds reach."""
    keep = dict(seeds)
    for n in nodes:
        if n.name in region and n.name not in keep and any(a.name in keep for a in n.all_input_nodes):
            keep[n.name] = region[n.name]
    return keep


def _param_only(nodes: list[fx.Node], param_of: dict[str, str]) -> dict[str, set[str]]:
    """Node -> the parameter placeholders it is computed from, for values computed from parameters
    (and constants) only."""
    out: dict[str, set[str]] = {p: {p} for p in param_of}
    for n in nodes:
        if n.op == "call_function" and n.all_input_nodes and all(a.name in out for a in n.all_input_nodes):
            out[n.name] = set().union(*(out[a.name] for a in n.all_input_nodes))
    return out


def _partial_params(nodes, region, decisions, param_of) -> tuple[set[str], set[tuple[str, tuple]]]:
    """(parameter placeholders whose gradients are summed once per step, (node, path) operands that
    get f instead). A parameter qualifies when every read of it (through parameter-only ops) is a
    broadcast into split tokens; a value mixing one that does not gets f, and so do its parameters."""
    sources = _param_only(nodes, param_of)
    by_name = {n.name: n for n in nodes}
    reads = {(name, path) for name, dec in decisions.items() if name in region for path in dec.copy_in}
    ok = {p for p in param_of if _only_read_by(by_name[p], sources, reads)}
    while True:
        copies = {(name, path) for name, path in reads
                  if not sources.get(operand(by_name[name], path).name, {None}) <= ok}
        bad = set().union(*(sources.get(operand(by_name[name], path).name, set()) for name, path in copies))
        if not bad & ok:
            return ok & set().union(*(sources.get(operand(by_name[n], p).name, set()) for n, p in reads)), copies
        ok -= bad


def _only_read_by(param: fx.Node, sources: dict[str, set[str]], reads: set[tuple[str, tuple]]) -> bool:
    """Every consumer of ``param`` past its parameter-only ops reads it as a split-token broadcast."""
    todo, seen = list(param.users), set()
    while todo:
        u = todo.pop()
        if u in seen:
            continue
        seen.add(u)
        if u.name in sources:
            todo.extend(u.users)
            continue
        paths = [p for (name, p) in reads if name == u.name]
        via = [p for p in paths if operand(u, p).name in sources and param.name in sources[operand(u, p).name]]
        inputs = [a for a in u.all_input_nodes if a.name in sources and param.name in sources[a.name]]
        if not via or len(via) < len(inputs):
            return False
    return True


# ------------------------------------------------------------------ rewrite


def _rewrite(gm, tp_n, seeds, region, decisions, ends, partial, copies, param_of) -> SequenceParallelPlan:
    graph = gm.graph
    tp = next(iter(graph.nodes))
    by_name = {n.name: n for n in graph.nodes}
    for name, sh in seeds.items():
        _start_split(by_name[name], tp, sh)
    inserted: dict[tuple, fx.Node] = {}
    for name, dec in decisions.items():
        if name in region:
            _localize(graph, by_name[name], dec, tp, copies, inserted)
    f_gathers, gathers = _close(graph, tp, region, ends, by_name)
    for name, placement in region.items():
        by_name[name].meta[SPLIT_META] = placement
    graph.lint()
    gm.recompile()
    kinds = Counter(_op_name(by_name[n]) for n in region if n not in seeds)
    return SequenceParallelPlan(
        tp=tp_n, split=dict(region), op_kinds=dict(kinds), seeds=tuple(seeds), f_gathers=tuple(f_gathers),
        gathers=tuple(gathers), partial_params=tuple(param_of[p] for p in param_of if p in partial),
        copies=tuple(sorted({operand(by_name[n], p).name for n, p in copies})),
        token_dims={s: sh.dim for s, sh in seeds.items()},
        shapes={s: str(list(by_name[s].meta["local_val"].shape)) for s in seeds})


def _start_split(seed: fx.Node, tp: fx.Node, split: Shard) -> None:
    """A seed's all-reduce becomes a reduce-scatter along its token dim: g, or the embedding's."""
    if seed.target is comm.vocab_parallel_embedding:
        weight, ids, _tp, *padding = seed.args
        seed.target = comm.vocab_parallel_embedding_sp
        seed.args = (weight, ids, tp, split.dim, split.segments, *padding)
    else:
        seed.target, seed.args = comm.reduce_scatter_to_sp, (seed.args[0], tp, split.dim, split.segments)
    seed.kwargs = {}


def _localize(graph: fx.Graph, node: fx.Node, dec: Decision, tp: fx.Node, copies: set, inserted: dict) -> None:
    """A region node made to run on this rank's tokens: local view sizes, replicated operands with the
    token dim narrowed, f where a broadcast operand's gradient is summed per microbatch, its own
    random stream."""
    for path, value in dec.local_args:
        set_operand(node, path, value)
    for path, sh in dec.scatter_in:
        src = operand(node, path)
        key = ("scatter", src.name, sh.dim, sh.segments)
        if key not in inserted:
            with graph.inserting_before(node):
                inserted[key] = copy_meta(graph.call_function(comm.scatter_to_tp, (src, tp, sh.dim, sh.segments)),
                                          node)
        set_operand(node, path, inserted[key])
    for path in dec.copy_in:
        if (node.name, path) not in copies:
            continue
        src = operand(node, path)
        key = ("copy", src.name)
        if key not in inserted:
            with graph.inserting_before(node):
                inserted[key] = copy_meta(graph.call_function(comm.copy_to_tp, (src, tp)), node)
        set_operand(node, path, inserted[key])
    if random_on_shard(node, dec):
        node.args = (node.target, tp, *node.args)
        node.target = comm.tp_rng_call


def _close(graph: fx.Graph, tp: fx.Node, region: dict, ends: dict, by_name: dict) -> tuple[list, list]:
    """Where the region ends: each f reading split tokens becomes their all-gather (backward
    reduce-scatter); any other consumer gets a gather (backward local slice) of the value."""
    f_gathers, gathers = [], []
    for name, placement in list(region.items()):
        value = by_name[name]
        if isinstance(placement, tuple):
            continue  # read through getitems, which are in the region
        for user in list(value.users):
            if user.name in region:
                continue
            if user.target is comm.copy_to_tp:
                user.target, user.args = comm.gather_from_sp, (value, tp, placement.dim, placement.segments)
                f_gathers.append(user.name)
                continue
            # the value's size along the tokens before the split: its local_val is still the whole one
            full = sum(placement.segments) if placement.segments else int(value.meta["local_val"].shape[placement.dim])
            with graph.inserting_before(user):
                gather = copy_meta(graph.call_function(
                    comm.gather_from_tp, (value, tp, placement.dim, placement.segments, full)), user)
            user.replace_input_with(value, gather)
            gathers.append(SequenceGather(user.name, name, module_path(user) or "(top level)",
                                          ends.get(user.name, "it needs the whole sequence")))
    return f_gathers, gathers


def _op_name(node: fx.Node) -> str:
    target = node.target
    if target is comm.tp_rng_call:
        target = node.args[0]
    return getattr(target, "__name__", str(target)).replace(".default", "")
