"""Sharding analysis: a tensor-parallel placement for every value of the graph.

Every value starts replicated. A linear whose input is replicated is a
*candidate*: we try it column-parallel (output ``Shard(last)``) and propagate
placements forward through per-op rules (the registry of ``passes/rules/``). The
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

import torch
import torch.fx as fx

from autopar.core.errors import AutoparError
from autopar.core.graph import TracedModel, module_path, source_line
from autopar.core.tensor_placement import Replicate, Shard
from passes.rules import Ctx, Decision, NeedSegments, decide, linear_parts, out_features, weight_of
from passes.rules.context import operand
from passes.routers import find_routers
from passes.tp_degrees import model_splits, tp_error

aten = torch.ops.aten

__all__ = ["ShardingPlan", "ShardingError", "Rejected", "analyze_sharding", "ideal_decisions"]


class ShardingError(AutoparError, ValueError):
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


class _State:
    """Placements of all nodes, updated incrementally when a candidate is tried."""

    def __init__(self, gm: fx.GraphModule, ctx: Ctx, must_split: set[str] | None = None):
        self.ctx = ctx
        self.nodes = list(gm.graph.nodes)
        self.index = {n: i for i, n in enumerate(self.nodes)}
        self.dec: dict[fx.Node, Decision] = {}
        self.must_split = must_split
        """Linears whose divisibility errors are raised (None: all); any other is left whole instead."""
        self.demands: dict[str, dict[fx.Node, Replicate | Shard]] = {}
        """Parameter placeholder -> the nodes whose decisions ask for it -> the placement each asks for,
        kept with ``dec`` (every trial asks which parameters are wanted two ways; the answer is read
        here, not gathered from every decision again)."""
        self.conflicting: set[str] = set()
        """The parameters of ``demands`` asked for in more than one placement."""

    def record(self, n: fx.Node, d: Decision) -> None:
        """Record ``d`` as ``n``'s decision (``demands`` follows)."""
        prev = self.dec.get(n)
        self.dec[n] = d
        if (prev is not None and prev.param_demand) or d.param_demand:
            self._redemand(n, prev.param_demand if prev is not None else {}, d.param_demand)

    def forget(self, n: fx.Node) -> None:
        """Forget ``n``'s decision."""
        prev = self.dec.pop(n, None)
        if prev is not None and prev.param_demand:
            self._redemand(n, prev.param_demand, {})

    def _redemand(self, n: fx.Node, before: dict, after: dict) -> None:
        for pname in before:
            self.demands[pname].pop(n, None)
        for pname, pl in after.items():
            self.demands.setdefault(pname, {})[n] = pl
        for pname in before.keys() | after.keys():
            by_node = self.demands[pname]
            if len(set(by_node.values())) > 1:
                self.conflicting.add(pname)
            else:
                self.conflicting.discard(pname)
            if not by_node:
                del self.demands[pname]

    def param_conflicts(self, param_of: dict[str, str]) -> list[str]:
        """One line per parameter asked for in two placements, naming each node's placement: the
        parameters in the order their first demanding node comes in the graph, each parameter's
        nodes in graph order."""
        def first(pname: str) -> tuple[int, int]:
            n = min(self.demands[pname], key=self.index.__getitem__)
            return self.index[n], list(self.dec[n].param_demand).index(pname)

        msgs = []
        for pname in sorted(self.conflicting, key=first):
            by_node = sorted(self.demands[pname].items(), key=lambda item: self.index[item[0]])
            msgs.append(f"{param_of.get(pname, pname)}: " + ", ".join(f"{n.name}={pl}" for n, pl in by_node))
        return msgs

    def reject(self, members: list[fx.Node], reason: str, errors: list[str], rejected: list[Rejected]) -> None:
        """``members`` stay whole for ``reason``; a divisibility error is raised instead when one of
        them must be split (``must_split``)."""
        if errors and (self.must_split is None or any(m.name in self.must_split for m in members)):
            raise ShardingError(errors[0])
        rejected.extend(Rejected(m.name, module_path(m), reason) for m in members)

    def placement_of(self, n: fx.Node):
        d = self.dec.get(n)
        return d.out if d is not None else Replicate()

    def run_all(self) -> None:
        for n in self.nodes:
            self.record(n, decide(self.ctx, n, self.placement_of))

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
            self.record(n, new)
            if prev is None or prev.out != new.out or _shard_meta(prev.out) != _shard_meta(new.out):
                for u in n.users:
                    byname[u.name] = u
                    heapq.heappush(heap, (self.index[u], u.name))

    def undo(self, old: dict[fx.Node, Decision]) -> None:
        for n, d in old.items():
            if d is None:
                self.forget(n)
            else:
                self.record(n, d)


def _shard_meta(p):
    if isinstance(p, Shard):
        return (p.dim, p.segments, p.origin)
    if isinstance(p, tuple):
        return tuple(_shard_meta(x) for x in p)
    return p


def _describe(ctx: Ctx, node: fx.Node) -> str:
    where = source_line(node)
    mod = module_path(node)
    return f"node {node.name} ({node.target}) in module '{mod}'" + (f" at {where}" if where else "")


def analyze_sharding(traced: TracedModel, tp: int, keep_whole: dict[str, str] | None = None) -> ShardingPlan:
    """Decide the tensor-parallel placement of every value and parameter for ``tp`` ranks.

    ``keep_whole``: linear-like node -> why it stays whole (never tried split: whole experts under
    ``expert_tp=1``); they are listed in the plan's replicated linears with that reason.

    When the trials fail or leave a linear whole, the plan the model's structure allows
    (``ideal_decisions``) says whether ``tp`` is to blame: a ``tp`` that does not divide a
    dimension that plan splits (heads, key/value heads, an MLP width) fails, naming those
    dimensions and the degrees that work for the whole model (``passes/tp_degrees.py``). A
    divisibility error in a region that plan leaves whole at every degree only leaves it whole.
    """
    if tp == 1:
        ctx = Ctx.build(traced, tp)
        state = _State(traced.gm, ctx)
        state.run_all()
        return _finish(traced, ctx, state, [])
    ctx = Ctx.build(traced, tp)
    try:
        state, rejected = _run_trials(traced, ctx, keep_whole=keep_whole)
    except ShardingError:
        state, rejected = None, []
    if state is None or rejected:
        ideal = ideal_decisions(traced, keep_whole)
        splits = model_splits(ideal)
        if splits.failing(tp):
            raise ShardingError(tp_error(splits, tp, traced.model_name)) from None
        if state is None:
            ctx = Ctx.build(traced, tp)
            state, rejected = _run_trials(traced, ctx, {n.name for n, d in ideal.items() if d.kind == "column"},
                                          keep_whole)
    _unsplit_tables_read_whole(state, ctx, rejected)
    return _finish(traced, ctx, state, rejected)


def ideal_decisions(traced: TracedModel, keep_whole: dict[str, str] | None = None) -> dict[fx.Node, Decision]:
    """The decisions of the analysis when every divisibility holds (t = 1, vocabulary split):
    the plan the model's structure allows, whose split sizes any degree must divide."""
    state, _ = _run_trials(traced, Ctx.build(traced, 1, split_vocabulary=True), must_split=set(),
                           keep_whole=keep_whole)
    return dict(state.dec)


def _run_trials(traced: TracedModel, ctx: Ctx, must_split: set[str] | None = None,
                keep_whole: dict[str, str] | None = None) -> tuple[_State, list[Rejected]]:
    """Every candidate linear tried column-parallel (with those it goes with), in graph order;
    a divisibility error raised for the linears in ``must_split`` (None: any); those in
    ``keep_whole`` never tried."""
    state = _State(traced.gm, ctx, must_split)
    state.run_all()
    rejected: list[Rejected] = []
    tried: set[fx.Node] = set()
    by_name = {n.name: n for n in state.nodes}
    for name, reason in (keep_whole or {}).items():
        tried.add(by_name[name])
        state.reject([by_name[name]], reason, [], rejected)
    for router, topk in find_routers(state.nodes, ctx).items():  # before any trial: never a member of a group
        tried.add(router)
        state.reject([router], f"its {out_features(ctx, router)} output features are the scores {topk.name} "
                               f"({source_line(topk) or 'no source line'}) takes the top-k of: a router, whose "
                               f"top-k needs every score on every rank (split, they would be gathered back at "
                               f"once); it stays whole, as Megatron keeps a mixture-of-experts router", [], rejected)
    linears = _Linears(state, ctx)
    for node in state.nodes:
        if node not in tried and _is_candidate(state, ctx, node):
            _try_group(state, ctx, _group_of(state, ctx, node, tried, linears), rejected)
    return state, rejected


class _Linears:
    """The graph's linear-like nodes by the value they read and by their weight, found once (the graph
    does not change during the trials): a group is looked up, not searched for over every node."""

    def __init__(self, state: _State, ctx: Ctx):
        self.order = {n: i for i, n in enumerate(state.nodes)}
        self.by_x: dict[fx.Node, list[fx.Node]] = {}
        self.by_weight: dict[str, list[fx.Node]] = {}
        for u in state.nodes:
            parts = linear_parts(ctx, u)
            if parts is not None:
                self.by_x.setdefault(operand(u, parts.x_path), []).append(u)
                self.by_weight.setdefault(parts.weight.name, []).append(u)


def _group_of(state: _State, ctx: Ctx, node: fx.Node, tried: set[fx.Node], linears: _Linears) -> list[fx.Node]:
    """The candidates tried with ``node`` (marked tried): linears reading the same replicated value
    (Q, K, V; SwiGLU's gate and up: one f on their input, no transient narrowing between them), and
    those sharing a weight with one of them (a block called once per layer, its weights shared: it
    can only be split everywhere at once); each part in graph order."""
    x = operand(node, linear_parts(ctx, node).x_path)
    group = [u for u in linears.by_x[x] if u not in tried and _is_candidate(state, ctx, u)]
    weights = {weight_of(ctx, m).name for m in group}
    sharing = {u for w in weights for u in linears.by_weight[w]}
    group += sorted((u for u in sharing if u not in tried and u not in group and _is_candidate(state, ctx, u)),
                    key=linears.order.__getitem__)
    tried.update(group)
    return group


def _try_group(state: _State, ctx: Ctx, group: list[fx.Node], rejected: list[Rejected]) -> None:
    """Try ``group`` column-parallel together; failing that, without the members whose values lead
    nowhere; then the linears sharing one weight parameter (the experts of a stacked W[e]) as a
    unit, since one of them split alone would leave the others reading it whole; the rest one by one."""
    if len(group) > 1:
        dead: list[fx.Node] = []
        ok, _, _ = _try_column(state, ctx, group, dead)
        if ok:
            return
        live = [m for m in group if m not in dead]
        if dead and len(live) > 1:
            ok, _, _ = _try_column(state, ctx, live)
            if ok:
                _try_one_by_one(state, ctx, dead, rejected)
                return
    units: dict[str, list[fx.Node]] = {}
    for member in group:
        units.setdefault(weight_of(ctx, member).name, []).append(member)
    for unit in units.values():
        if 1 < len(unit) < len(group) and all(_is_candidate(state, ctx, m) for m in unit):
            ok, reason, errors = _try_column(state, ctx, unit)
            if not ok:
                state.reject(unit, reason, errors, rejected)
            continue
        _try_one_by_one(state, ctx, unit, rejected)


def _unsplit_tables_read_whole(state: _State, ctx: Ctx, rejected: list[Rejected]) -> None:
    """A vocabulary-parallel embedding whose (tied) table stayed whole elsewhere cannot be split:
    run it replicated and say so."""
    while conflicts := state.param_conflicts(ctx.param_of):
        bad = [n for n in state.nodes if n.name in ctx.vocab_embeddings and any(
            c.startswith(ctx.param_of[n.args[0].name] + ":") for c in conflicts)]
        if not bad:
            raise ShardingError("inconsistent parameter sharding: " + "; ".join(conflicts))
        for n in bad:
            ctx.vocab_embeddings.discard(n.name)
            rejected.append(Rejected(n.name, module_path(n), "its table is also read whole by another op, so the "
                                     "vocabulary stays unsplit"))
        state.run_all()


def _try_one_by_one(state: _State, ctx: Ctx, members: list[fx.Node], rejected: list[Rejected]) -> None:
    for member in members:
        if not _is_candidate(state, ctx, member):
            continue
        ok, reason, errors = _try_column(state, ctx, [member])
        if not ok:
            state.reject([member], reason, errors, rejected)


def _is_candidate(state: _State, ctx: Ctx, node: fx.Node) -> bool:
    parts = linear_parts(ctx, node)
    return parts is not None and node not in ctx.column and isinstance(
        state.placement_of(operand(node, parts.x_path)), Replicate)


def _try_column(state: _State, ctx: Ctx, group: list[fx.Node],
                dead_out: list[fx.Node] | None = None) -> tuple[bool, str, list[str]]:
    """Try the linears of ``group`` column-parallel together; keep them if the region closes.

    Kept when the split values reach a consumer that ends the region (a
    row-parallel linear, a vocabulary-parallel loss) or join a region already
    split, the loss stays replicated, no parameter is asked to be split two
    ways, and the region does not leak: a trial that narrows an activation
    into the split region *and* needs fallbacks (the residual stream taken
    apart and gathered again) is worse than leaving the linears whole.
    Returns (kept, why not, errors to raise); ``dead_out`` gets the members
    whose values lead nowhere.
    """
    return _ColumnTrial(state, ctx, group).run(dead_out)


@dataclass
class _Effects:
    """What one attempt of a trial changed."""

    sinks: list[fx.Node]
    """Nodes that now end a split region (and did not before)."""
    merged: bool
    """The trial joined a region already split (K and V after Q: scatters removed)."""
    errors: list[str]
    new_fallbacks: list[fx.Node]
    fallback_reason: str
    """Why the first new fallback runs replicated."""
    leaking: bool
    out_ok: bool
    """The loss stays replicated."""
    conflicts: list[str]
    padded_bad: bool
    """A padded split ends somewhere else than in a vocabulary-parallel kernel."""
    dead: list[fx.Node]

    @property
    def accepted(self) -> bool:
        return ((bool(self.sinks) or self.merged) and self.out_ok and not self.conflicts and not self.errors
                and not self.padded_bad and not self.leaking and not self.dead)


class _ColumnTrial:
    """The linears of ``group`` tried column-parallel together; retried with segmented splits
    when a view or split asks for pieces (``NeedSegments``)."""

    def __init__(self, state: _State, ctx: Ctx, group: list[fx.Node]):
        self.state, self.ctx, self.group = state, ctx, group
        self.padded = {m: out_features(ctx, m) % ctx.tp != 0 for m in group}
        self.segments: dict[fx.Node, tuple[int, ...] | None] = {
            m: (-(-out_features(ctx, m) // ctx.tp) * ctx.tp,) if self.padded[m] else None for m in group}
        self.pending_error: str | None = None
        """A view's error, if splitting into pieces fails too."""

    def run(self, dead_out: list[fx.Node] | None) -> tuple[bool, str, list[str]]:
        for _attempt in range(2 + len(self.group)):
            conflicts_before = set(self.state.param_conflicts(self.ctx.param_of))
            try:
                old = self._apply()
            except NeedSegments as need:
                if self._take_segments(need):
                    continue
                return False, f"its output is split into {list(need.sizes)} which does not divide by tp={self.ctx.tp}", []
            effects = self._effects(old, conflicts_before)
            if dead_out is not None:
                dead_out[:] = effects.dead
            if effects.accepted:
                return True, "", []
            self._undo(old)
            return self._rejection(effects)
        return False, "segment search did not converge", []

    def _apply(self) -> dict[fx.Node, Decision | None]:
        """Make the members column-parallel and propagate; the previous decisions of what changed."""
        old: dict[fx.Node, Decision | None] = {}
        try:
            for member in self.group:
                self.ctx.column[member] = self.segments[member]
            for member in self.group:
                for n, d in self.state.propagate_from(member).items():
                    old.setdefault(n, d)
        except NeedSegments:
            self._undo(old)
            raise
        return old

    def _undo(self, old: dict[fx.Node, Decision | None]) -> None:
        self.state.undo(old)
        for member in self.group:
            self.ctx.column.pop(member, None)

    def _take_segments(self, need: NeedSegments) -> bool:
        """Split the linear that ``need`` names in the pieces asked for, if they are pieces of its own
        output (not of a slice of it) and each divides by t."""
        origin = next((m for m in self.group if m.name == need.origin), None)
        whole = origin is not None and sum(need.sizes) == out_features(self.ctx, origin)
        if whole and self.segments[origin] is None and all(self.ctx.divides(s) for s in need.sizes):
            self.segments[origin] = tuple(need.sizes)
            self.pending_error = self.pending_error or need.error
            return True
        return False

    def _effects(self, old: dict, conflicts_before: set[str]) -> _Effects:
        """What the attempt changed; ``old``: the touched nodes' decisions before it (None: none)."""
        state, ctx = self.state, self.ctx
        touched = list(old)
        before = {n: d.kind for n, d in old.items() if d is not None}
        dec = state.dec
        merged = any(old[n] is not None and len(old[n].scatter_in) > len(dec[n].scatter_in) for n in touched)
        sinks = [n for n in touched if dec[n].ends_region and before.get(n) != dec[n].kind]
        new_fallbacks = [n for n in touched if dec[n].kind == "fallback" and before.get(n) != "fallback"]
        leaks = [n for n in touched if any(operand(n, path).name in ctx.requires_grad
                                           and operand(n, path).name not in ctx.param_of
                                           for path, _ in dec[n].scatter_in)]
        out_node = state.nodes[-1]
        # in a group, a member whose split values neither reach a sink nor meet another member's (a
        # router whose top-k falls back, beside the experts it routes to) would only add gathers:
        # the group is retried without it
        dead = (_dead_ends(state, self.group, set(touched), set(sinks))
                if len(self.group) > 1 and new_fallbacks else [])
        return _Effects(
            sinks=sinks,
            merged=merged,
            errors=[dec[n].error for n in touched if dec[n].error],
            new_fallbacks=new_fallbacks,
            fallback_reason=dec[new_fallbacks[0]].reason if new_fallbacks else "",
            # pieces asked for by a view that could not split otherwise must close the region
            # cleanly: cutting within attention heads (a head dim) only trades the error for gathers
            leaking=bool(new_fallbacks and (leaks or self.pending_error)),
            out_ok=all(isinstance(p, Replicate) for p in _flat(state.placement_of(out_node.args[0][0]))),
            conflicts=[c for c in state.param_conflicts(ctx.param_of) if c not in conflicts_before],
            padded_bad=any(self.padded.values()) and any(not dec[n].kind.startswith("vocab_") for n in sinks),
            dead=dead,
        )

    def _rejection(self, effects: _Effects) -> tuple[bool, str, list[str]]:
        """Why the trial was not kept (after it was undone), and the errors to raise if any."""
        ctx, node = self.ctx, self.group[0]
        errors = effects.errors or ([self.pending_error] if self.pending_error else [])
        if errors:
            return False, errors[0], errors
        if any(self.padded.values()) and effects.sinks:
            dim = out_features(ctx, node)
            return False, "", [
                f"{_describe(ctx, node)} has {dim} output features, not divisible by tp={ctx.tp}; "
                f"only a vocabulary (consumed by the cross-entropy) can be padded. "
                f"Use a tp that divides {dim} ({_divisors(dim)})"
            ]
        if effects.conflicts:
            return False, "its weight is also used unsharded elsewhere: " + "; ".join(effects.conflicts), []
        if effects.new_fallbacks:
            fb = effects.new_fallbacks[0]
            return False, f"its output reaches {_describe(ctx, fb)}, which would run replicated: " \
                          f"{effects.fallback_reason}", []
        if not effects.out_ok:
            return False, "its sharded output would reach the loss", []
        return False, "its output never reaches a row-parallel consumer", []


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
    conflicts = state.param_conflicts(ctx.param_of)
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

