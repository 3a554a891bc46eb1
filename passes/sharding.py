"""Sharding analysis: a tensor-parallel placement for every value of the graph.

Every value starts replicated. A linear whose input is replicated is a
*candidate*: we try it column-parallel (output ``Shard(last)``) and propagate
placements forward through per-op rules (``passes/sharding_rules.py``). The
candidate is kept when its sharded output reaches a consumer that ends the
sharded region by itself: a linear contracting over the sharded dim (which
becomes row-parallel: output partial, reduced by g) or a cross-entropy over a
sharded vocabulary. This finds Megatron's pattern without knowing any model:

    x (R) -f-> linear_A (column) -> gelu -> linear_B (row) -g-> (R)
    x (R) -f-> q, k, v (column, by heads) -> view/transpose/rope -> sdpa -> o (row) -g->

The analysis only decides; ``passes/tensor_parallel.py`` rewrites.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass, field

import torch.fx as fx

from autopar.core.placement import Replicate, Shard
from autopar.core.graph import TracedModel, module_path, source_line
from passes.sharding_rules import (
    Ctx,
    Decision,
    NeedSegments,
    decide,
    linear_parts,
    weight_of,
)

__all__ = ["ShardingPlan", "ShardingError", "Rejected", "analyze_sharding"]


class ShardingError(ValueError):
    """The model cannot be split t ways as asked; the message names the place, numbers and fix."""


@dataclass(frozen=True)
class Rejected:
    node: str
    module: str
    reason: str


@dataclass
class ShardingPlan:
    """Result of the analysis: what each node does and how each parameter is split."""

    tp: int
    decisions: dict[str, Decision]
    """Node name -> decision (its output placement, the collectives around it)."""
    param_specs: dict[str, Replicate | Shard]
    """Parameter placeholder name -> placement of the parameter (Shard may be padded)."""
    column: dict[str, Shard]
    """Column-parallel linear node -> placement of its output."""
    rejected: list[Rejected] = field(default_factory=list)
    """Linears left replicated, and why."""

    def nodes_of_kind(self, kind: str) -> list[str]:
        return [n for n, d in self.decisions.items() if d.kind == kind]

    @property
    def fallbacks(self) -> list[str]:
        return self.nodes_of_kind("fallback")

    def placement(self, name: str):
        return self.decisions[name].out


class _State:
    """Placements of all nodes, updated incrementally when a candidate is tried."""

    def __init__(self, gm: fx.GraphModule, ctx: Ctx):
        self.ctx = ctx
        self.nodes = list(gm.graph.nodes)
        self.index = {n: i for i, n in enumerate(self.nodes)}
        self.dec: dict[fx.Node, Decision] = {}

    def placement_of(self, n: fx.Node):
        d = self.dec.get(n)
        return d.out if d is not None else Replicate()

    def run_all(self) -> None:
        for n in self.nodes:
            self.dec[n] = decide(self.ctx, n, self.placement_of)

    def propagate_from(self, start: fx.Node) -> dict[fx.Node, Decision]:
        """Recompute ``start`` and everything downstream whose inputs changed.

        Returns the previous decisions of the touched nodes (to undo). If a rule
        raises (``NeedSegments``: retry with a segmented split), the nodes
        already recomputed are restored first, so the state is as before.
        """
        old: dict[fx.Node, Decision] = {}
        try:
            self._propagate(start, old)
        except BaseException:
            self.undo(old)
            raise
        return old

    def _propagate(self, start: fx.Node, old: dict[fx.Node, Decision]) -> None:
        heap = [(self.index[start], start.name)]
        byname = {start.name: start}
        seen = set()
        while heap:
            _, name = heapq.heappop(heap)
            if name in seen:
                continue
            seen.add(name)
            n = byname[name]
            new = decide(self.ctx, n, self.placement_of)
            prev = self.dec.get(n)
            old.setdefault(n, prev)
            self.dec[n] = new
            if prev is None or prev.out != new.out or _shard_meta(prev.out) != _shard_meta(new.out):
                for u in n.users:
                    byname[u.name] = u
                    heapq.heappush(heap, (self.index[u], u.name))

    def undo(self, old: dict[fx.Node, Decision]) -> None:
        for n, d in old.items():
            if d is None:
                self.dec.pop(n, None)
            else:
                self.dec[n] = d


def _shard_meta(p):
    if isinstance(p, Shard):
        return (p.dim, p.segments, p.origin)
    if isinstance(p, tuple):
        return tuple(_shard_meta(x) for x in p)
    return p


def _param_conflicts(state: _State, ctx: Ctx) -> list[str]:
    demands: dict[str, dict] = {}
    for n, d in state.dec.items():
        for pname, pl in d.param_demand.items():
            demands.setdefault(pname, {})[n.name] = pl
    msgs = []
    for pname, by_node in demands.items():
        kinds = set(by_node.values())
        if len(kinds) > 1:
            msgs.append(f"{ctx.param_of.get(pname, pname)}: " + ", ".join(f"{k}={v}" for k, v in by_node.items()))
    return msgs


def _describe(ctx: Ctx, node: fx.Node) -> str:
    where = source_line(node)
    mod = module_path(node)
    return f"node {node.name} ({node.target}) in module '{mod}'" + (f" at {where}" if where else "")


def analyze_sharding(traced: TracedModel, tp: int) -> ShardingPlan:
    """Decide the tensor-parallel placement of every value and parameter for ``tp`` ranks."""
    gm = traced.gm
    ctx = Ctx.build(traced, tp)
    state = _State(gm, ctx)
    state.run_all()
    if tp == 1:
        return _finish(traced, ctx, state, [])

    rejected: list[Rejected] = []
    tried: set[fx.Node] = set()
    nodes = list(gm.graph.nodes)
    for node in nodes:
        if node in tried or not _is_candidate(state, ctx, node):
            continue
        # linears reading the same replicated value (Q, K, V; SwiGLU's gate and up) are tried
        # together first: one f on their common input, no transient narrowing between them
        x = _operand(node, linear_parts(ctx, node)[0])
        group = [u for u in nodes if u not in tried and _is_candidate(state, ctx, u)
                 and _operand(u, linear_parts(ctx, u)[0]) is x]
        # a weight applied in several places (a block called once per layer, its weights shared)
        # can only be split everywhere at once: those linears join the group
        weights = {weight_of(ctx, m).name for m in group}
        group += [u for u in nodes if u not in tried and u not in group and _is_candidate(state, ctx, u)
                  and weight_of(ctx, u).name in weights]
        tried.update(group)
        dead: list[fx.Node] = []
        if len(group) > 1:
            ok, _, errors = _try_column(state, ctx, group, dead)
            if ok:
                continue
            live = [m for m in group if m not in dead]
            if dead and len(live) > 1:
                ok, _, errors = _try_column(state, ctx, live)
                if ok:
                    _try_one_by_one(state, ctx, dead, rejected)
                    continue
        # then the linears that share one weight parameter (the experts of a stacked W[e]) as a
        # unit, since one of them split alone would leave the others reading it whole; the rest
        # one by one
        units: dict[str, list[fx.Node]] = {}
        for member in group:
            units.setdefault(weight_of(ctx, member).name, []).append(member)
        for unit in units.values():
            if len(unit) > 1 and len(unit) < len(group) and all(_is_candidate(state, ctx, m) for m in unit):
                ok, reason, errors = _try_column(state, ctx, unit)
                if ok:
                    continue
                if errors:
                    raise ShardingError(errors[0])
                rejected.extend(Rejected(m.name, module_path(m), reason) for m in unit)
                continue
            _try_one_by_one(state, ctx, unit, rejected)
    # A vocabulary-parallel embedding whose (tied) table stayed whole elsewhere
    # cannot be split: run it replicated and say so.
    while conflicts := _param_conflicts(state, ctx):
        bad = [n for n in gm.graph.nodes if n.name in ctx.vocab_embeddings and any(
            c.startswith(ctx.param_of[n.args[0].name] + ":") for c in conflicts)]
        if not bad:
            raise ShardingError("inconsistent parameter sharding: " + "; ".join(conflicts))
        for n in bad:
            ctx.vocab_embeddings.discard(n.name)
            rejected.append(Rejected(n.name, module_path(n), "its table is also read whole by another op, so the "
                                     "vocabulary stays unsplit"))
        state.run_all()
    return _finish(traced, ctx, state, rejected)


def _try_one_by_one(state: "_State", ctx: Ctx, members: list[fx.Node], rejected: list[Rejected]) -> None:
    for member in members:
        if not _is_candidate(state, ctx, member):
            continue
        ok, reason, errors = _try_column(state, ctx, [member])
        if errors and not ok:
            raise ShardingError(errors[0])
        if not ok:
            rejected.append(Rejected(member.name, module_path(member), reason))


def _is_candidate(state: "_State", ctx: Ctx, node: fx.Node) -> bool:
    parts = linear_parts(ctx, node)
    return parts is not None and node not in ctx.column and isinstance(
        state.placement_of(_operand(node, parts[0])), Replicate)


def _operand(node: fx.Node, path: tuple) -> fx.Node:
    if path[0] == "k":
        return node.kwargs[path[1]]
    a = node.args[path[1]]
    return a[path[2]] if len(path) == 3 else a


def _try_column(state: _State, ctx: Ctx, group: list[fx.Node],
                dead_out: list[fx.Node] | None = None) -> tuple[bool, str, list[str]]:
    """Try the linears of ``group`` column-parallel together; keep them if the region closes.

    Kept when the sharded values reach a consumer that ends the region (a
    row-parallel linear, a vocabulary-parallel loss) or join a region already
    sharded, the loss stays replicated, no parameter is asked to be split two
    ways, and the region does not leak: a trial that narrows an activation
    into the sharded region *and* needs fallbacks (the residual stream taken
    apart and gathered again) is worse than leaving the linears whole.
    """
    segments: dict[fx.Node, tuple[int, ...] | None] = {}
    padded: dict[fx.Node, bool] = {}
    for node in group:
        out_features = ctx.shape(weight_of(ctx, node))[ctx.out_dim_of_weight(node)]
        padded[node] = out_features % ctx.tp != 0
        segments[node] = (-(-out_features // ctx.tp) * ctx.tp,) if padded[node] else None
    node = group[0]
    pending_error: str | None = None  # a view's error, if splitting into pieces fails too
    for _attempt in range(2 + len(group)):
        before = {n: d.kind for n, d in state.dec.items()}
        conflicts_before = set(_param_conflicts(state, ctx))
        old: dict = {}
        try:
            for member in group:
                ctx.column[member] = segments[member]
            for member in group:
                for n, d in state.propagate_from(member).items():
                    old.setdefault(n, d)
        except NeedSegments as need:
            state.undo(old)
            for member in group:
                ctx.column.pop(member, None)
            origin = next((m for m in group if m.name == need.origin), None)
            whole = origin is not None and sum(need.sizes) == ctx.shape(weight_of(ctx, origin))[
                ctx.out_dim_of_weight(origin)]  # pieces of the linear's own output, not of a slice of it
            if whole and segments[origin] is None and all(s % ctx.tp == 0 for s in need.sizes):
                segments[origin] = tuple(need.sizes)
                pending_error = pending_error or need.error
                continue
            return False, f"its output is split into {list(need.sizes)} which does not divide by tp={ctx.tp}", []
        touched = list(old)
        # joining a region that is already sharded (K and V after Q) removes its scatters
        merged = any(old[n] is not None and len(old[n].scatter_in) > len(state.dec[n].scatter_in) for n in touched)
        sinks = [n for n in touched if _ends_region(state.dec[n]) and before.get(n) != state.dec[n].kind]
        errors = [state.dec[n].error for n in touched if state.dec[n].error]
        new_fallbacks = [n for n in touched if state.dec[n].kind == "fallback" and before.get(n) != "fallback"]
        leaks = [n for n in touched if any(_operand(n, path).name in ctx.requires_grad
                                           and _operand(n, path).name not in ctx.param_of
                                           for path, _ in state.dec[n].scatter_in)]
        out_node = state.nodes[-1]
        out_ok = all(isinstance(p, Replicate) for p in _flat(state.placement_of(out_node.args[0][0])))
        conflicts = [c for c in _param_conflicts(state, ctx) if c not in conflicts_before]
        padded_bad = any(padded.values()) and any(not state.dec[n].kind.startswith("vocab_") for n in sinks)
        leaking = bool(new_fallbacks and leaks)
        # in a group, a member whose sharded values neither reach a sink nor meet another
        # member's (a router whose top-k falls back, beside the experts it routes to) would only
        # add gathers: the group is retried without it
        dead = _dead_ends(state, group, set(touched), set(sinks)) if len(group) > 1 and new_fallbacks else []
        if dead_out is not None:
            dead_out[:] = dead
        # pieces asked for by a view that could not split otherwise must close the region cleanly:
        # cutting within attention heads (a head dim) only trades the error for gathers
        if pending_error and new_fallbacks:
            leaking = True
        if (sinks or merged) and out_ok and not conflicts and not errors and not padded_bad and not leaking \
                and not dead:
            return True, "", []
        fb_reason = state.dec[new_fallbacks[0]].reason if new_fallbacks else ""
        state.undo(old)
        for member in group:
            ctx.column.pop(member, None)
        if pending_error and not errors:
            errors = [pending_error]
        if errors:
            return False, errors[0], errors
        if any(padded.values()) and sinks:
            dim = ctx.shape(weight_of(ctx, node))[ctx.out_dim_of_weight(node)]
            return False, "", [
                f"{_describe(ctx, node)} has {dim} output features, not divisible by tp={ctx.tp}; "
                f"only a vocabulary (consumed by the cross-entropy) can be padded. "
                f"Use a tp that divides {dim} ({_divisors(dim)})"
            ]
        if conflicts:
            return False, "its weight is also used unsharded elsewhere: " + "; ".join(conflicts), []
        if new_fallbacks:
            fb = new_fallbacks[0]
            return False, f"its output reaches {_describe(ctx, fb)}, which would run replicated: {fb_reason}", []
        if not out_ok:
            return False, "its sharded output would reach the loss", []
        return False, "its output never reaches a row-parallel consumer", []
    return False, "segment search did not converge", []


_VOCAB_SINKS = ("vocab_cross_entropy", "vocab_nll", "vocab_gather")


def _ends_region(d: Decision) -> bool:
    """A consumer that turns a sharded value back into a replicated one by itself: a row-parallel
    linear or a sum over the split dim (g after it), a vocabulary-parallel loss, logsumexp or gather."""
    if d.kind in ("row", *_VOCAB_SINKS) or d.reduce_out:
        return True
    return d.kind == "vocab_softmax" and isinstance(d.out, Replicate)


def _dead_ends(state: _State, group: list[fx.Node], touched: set[fx.Node], sinks: set[fx.Node]) -> list[fx.Node]:
    """Members whose values (followed through the nodes the trial changed) reach no sink and no
    node that another member's values reach too."""
    reach: dict[fx.Node, set[fx.Node]] = {}
    for m in group:
        seen, todo = set(), [m]
        while todo:
            n = todo.pop()
            if n in seen:
                continue
            seen.add(n)
            todo.extend(u for u in n.users if u in touched)
        reach[m] = seen
    dead = []
    for m in group:
        others = set().union(*(reach[o] for o in group if o is not m))
        if not (reach[m] & sinks) and not (reach[m] & others):
            dead.append(m)
    return dead


def _divisors(n: int) -> str:
    return ", ".join(str(d) for d in range(1, min(n, 64) + 1) if n % d == 0)


def _flat(p):
    if isinstance(p, tuple):
        out = []
        for x in p:
            out.extend(_flat(x))
        return out
    return [p]


def _check_consistent(ctx: Ctx, state: _State) -> None:
    """Invariant: every decision is what its rule gives for its inputs' final placements
    (a stale decision left by an undone trial would make a rank program compute wrong shapes)."""
    for n in state.nodes:
        fresh = decide(ctx, n, state.placement_of)
        if fresh != state.dec[n]:
            raise ShardingError(
                f"internal error in the sharding analysis: the decision for {_describe(ctx, n)} is stale "
                f"({state.dec[n].out} recorded, {fresh.out} from its inputs); please report it with the model. "
                f"tp=1 avoids the analysis.")


def _finish(traced: TracedModel, ctx: Ctx, state: _State, rejected: list[Rejected]) -> ShardingPlan:
    conflicts = _param_conflicts(state, ctx)
    if conflicts:  # internal invariant: candidates with conflicts are never accepted
        raise ShardingError("inconsistent parameter sharding: " + "; ".join(conflicts))
    _check_consistent(ctx, state)
    specs: dict[str, Replicate | Shard] = {}
    for d in state.dec.values():
        specs.update(d.param_demand)
    for name in traced.param_of:
        specs.setdefault(name, Replicate())
    column = {n.name: state.dec[n].out for n in ctx.column}
    return ShardingPlan(
        tp=ctx.tp,
        decisions={n.name: d for n, d in state.dec.items()},
        param_specs=specs,
        column=column,
        rejected=rejected,
    )

