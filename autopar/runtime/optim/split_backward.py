"""A chunk's backward in two halves: B, the gradients of its inputs, and W, the gradients of its weights.

Zero-bubble pipelines (Qi et al., ICLR 2024) run B as soon as the next stage
sends the output gradients (the previous stage waits for them) and W later, in
what would otherwise be the pipeline's bubble. ``SplitBackward`` splits any
chunk's autograd graph at run time; nothing about the ops is assumed.

Why at run time, from the autograd graph, and not from the chunk's fx graph:
a graph rewrite needs a weight-gradient formula per op with a parameter
(linear, matmul, embedding, norms, conv, bias adds, each under autocast, each
rule to keep in step with the sharding rules); the autograd graph already holds
every op's backward, and each built-in backward node computes only the
gradients a call asks for. So B asks for the input gradients only, and W runs
the weight-gradient side of the same nodes later.

The split, on the graph of nodes reachable from the outputs:

- the B side: nodes that lead to a chunk input or to a custom autograd function
  (the tensor-parallel collectives of ``core/comm`` are ones: B runs them all,
  W none of them; under sequence parallelism W does all-gather again the 1/t
  slices a column-parallel GEMM kept, which B dropped after unpacking them, and
  a chunk's last W sums the norm weights' partial gradients over tp, as a last
  B does without the split); every other node leading to a weight is on the W side;
- entries: edges from the B side into the W side. The B-side node of an entry
  that is a weight GEMM (``GEMM_NODES``: mm, addmm, bmm, convolution) is
  *deferred*: B runs it for its input gradient only and keeps the gradient
  flowing into it; W runs it again for its weight edges only. Other entries
  (a norm's or an embedding's weight gradient: a cheap reduction whose inputs W
  would otherwise keep; a custom function's; one into W-side nodes another
  entry also reaches, as a second run could not be limited to one node) are
  computed in B, and W starts from their gradients (``defer="all"`` defers
  every built-in node's instead);
- B runs what its engine call runs: a W-side node below an entry computed in B
  that leads to another such entry (a router's top-k above the residual add
  into the same hidden state, both reached from a MoE layer's B side) is run
  by ``torch.autograd.grad`` on its way to the lower entry, so it is moved to
  the B side (and the entries found again) rather than run a second time in W;
- W: each deferred node once (its weight GEMM), then one backward from every
  entry into the weights' ``.grad``, accumulating as ``loss.backward()`` does
  (microbatches, tied weights, the data-parallel reduction read ``.grad``).

What stays alive from B to W: the forward is recorded into a
``SavedTensorStore`` (``core/saved_tensors.py``); B runs with the graph
retained, and every saved tensor that a node other than a deferred one reads
is released as it is read. What W keeps is what the deferred nodes saved (the
weight GEMMs' inputs, the norms' statistics) and the gradients flowing into
them. Checkpointed regions replay once, in B; W reads the replay's slots.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import torch
from torch.autograd.graph import GradientEdge, Node, get_gradient_edge

from autopar.core.saved_tensors import SavedTensorStore
from autopar.runtime.optim.errors import OptimizerError, StepOrderError

__all__ = ["SplitBackward", "BackwardSplitPlan", "plan_split"]

EdgeKey = tuple[Node, int]

GEMM_NODES = frozenset({"MmBackward0", "AddmmBackward0", "BmmBackward0", "BaddbmmBackward0",
                        "ConvolutionBackward0", "MkldnnConvolutionBackward0"})
"""Autograd nodes whose weight gradient is a GEMM (or a convolution): the work W is for."""


def _is_custom(node: Node) -> bool:
    """A custom autograd function: its backward computes every output and may communicate."""
    return isinstance(node, torch.autograd.function.BackwardCFunction)


def _children(node: Node) -> list[EdgeKey]:
    return [(child, nr) for child, nr in node.next_functions if child is not None]


def _topological(roots: Iterable[Node]) -> list[Node]:
    """Every node reachable from ``roots``, each before all the nodes it leads to."""
    order, seen = [], set()
    for root in roots:
        if root in seen:
            continue
        seen.add(root)
        stack = [(root, iter(_children(root)))]
        while stack:
            node, it = stack[-1]
            for child, _ in it:
                if child not in seen:
                    seen.add(child)
                    stack.append((child, iter(_children(child))))
                    break
            else:
                order.append(node)
                stack.pop()
    return order[::-1]


def _leading_to(order: list[Node], targets: set[Node]) -> set[Node]:
    """The nodes of ``order`` (topological) that are in ``targets`` or lead to one of them."""
    hit: set[Node] = set()
    for node in reversed(order):
        if node in targets or any(child in hit for child, _ in _children(node)):
            hit.add(node)
    return hit


@dataclass
class BackwardSplitPlan:
    """Where one graph splits: what B runs and keeps, and what W starts from."""

    b_side: set[Node]
    """Nodes B runs: those leading to a chunk input or to a custom autograd function."""
    w_side: set[Node]
    """Nodes only W runs: those leading to weights and to no input or custom function."""
    deferred: dict[Node, list[EdgeKey]]
    """B-side node -> its entries W computes by running it again (its weight edges)."""
    captured: list[EdgeKey]
    """Entries B computes (custom functions', shared ones'); W starts from their gradients."""

    def counts(self) -> dict[str, int]:
        """The split as numbers: nodes on each side, deferred nodes, entries computed in B."""
        return {"b_side": len(self.b_side), "w_side": len(self.w_side), "deferred": len(self.deferred),
                "captured": len(self.captured)}


def plan_split(roots: Sequence[Node], input_nodes: set[Node], defer: str = "gemm") -> BackwardSplitPlan:
    """The split of the graph under ``roots`` (the outputs' gradient nodes) given the chunk
    inputs' gradient accumulators ``input_nodes``; ``defer``: which B-side nodes W runs again,
    'gemm' (``GEMM_NODES``) or 'all' (every built-in one)."""
    if defer not in ("gemm", "all"):
        raise OptimizerError(f"defer must be 'gemm' or 'all', got {defer!r}")
    order = _topological(roots)
    leaves = {n for n in order if not _children(n) and hasattr(n, "variable")}
    relevant = _leading_to(order, leaves)
    custom = {n for n in relevant if _is_custom(n)}
    b_side = _leading_to(order, (input_nodes & relevant) | custom)
    while True:
        plan = _entries_split(order, roots, relevant, b_side, defer)
        ran = _run_by_b(order, plan)
        if not ran:
            return plan
        b_side = b_side | ran


def _run_by_b(order: list[Node], plan: BackwardSplitPlan) -> set[Node]:
    """The W-side nodes B's engine call would run: those below an entry that lead to a captured
    entry's node other than themselves.

    ``torch.autograd.grad`` runs every node on a path from its roots to one of its targets, and a
    captured entry is a target; a target is only read, not run, unless a path from it leads to
    another. So when one captured node lies below another (a residual stream's add under a
    router's top-k, both reached from the B side), B runs the nodes between them: they read (and
    release) their saved tensors in B, and their gradients reach the lower entry in B. W, starting
    from the upper entry again, would run them a second time: a released slot read, or, without
    the release, their contribution counted twice. ``plan_split`` moves such nodes to the B side,
    which is where the engine runs them, until none is left."""
    captured = {v for v, _ in plan.captured}
    if not captured:
        return set()
    above = _leading_to(order, captured)
    reached = set(captured)  # the W-side nodes B's gradients can reach (a deferred entry's node is
    for node in order:       # never above a captured one: it would be shared, and not deferred)
        if node in reached:
            reached.update(c for c, _ in _children(node) if c in plan.w_side)
    return {n for n in reached if any(c in above for c, _ in _children(n))}


def _entries_split(order: list[Node], roots: Sequence[Node], relevant: set[Node], b_side: set[Node],
                   defer: str) -> BackwardSplitPlan:
    """The plan for a given B side: its entries into the W side, each deferred or captured."""
    w_side = relevant - b_side
    entries = [(u, (v, nr)) for u in order if u in b_side for v, nr in _children(u) if v in w_side]
    owners = _owners(order, w_side, entries, [r for r in roots if r in w_side])
    shared = _shared_below(order, w_side, owners)
    deferred: dict[Node, list[EdgeKey]] = {}
    captured: list[EdgeKey] = []
    by_node: dict[Node, list[EdgeKey]] = {}
    for u, edge in entries:
        by_node.setdefault(u, []).append(edge)
    for u, edges in by_node.items():
        wanted = defer == "all" or u.name() in GEMM_NODES
        if wanted and not _is_custom(u) and not any(shared[v] for v, _ in edges):
            deferred[u] = list(dict.fromkeys(edges))
        else:
            captured += edges
    return BackwardSplitPlan(b_side, w_side, deferred, list(dict.fromkeys(captured)))


def _owners(order: list[Node], w_side: set[Node], entries, w_roots: list[Node]) -> dict[Node, set]:
    """W-side node -> the sources (B-side nodes, or an output whose node is on the W side) whose
    gradients reach it."""
    owners: dict[Node, set] = {n: set() for n in w_side}
    for u, (v, _) in entries:
        owners[v].add(u)
    for root in w_roots:
        owners[root].add(("output", root))
    for node in order:
        if node in w_side:
            for child, _ in _children(node):
                if child in w_side:
                    owners[child] |= owners[node]
    return owners


def _shared_below(order: list[Node], w_side: set[Node], owners: dict[Node, set]) -> dict[Node, bool]:
    """W-side node -> whether it, or a node it leads to, gets gradients from two entry sources."""
    shared: dict[Node, bool] = {}
    for node in reversed(order):
        if node in w_side:
            shared[node] = len(owners[node]) > 1 or any(shared[c] for c, _ in _children(node) if c in w_side)
    return shared


class SplitBackward:
    """One chunk and microbatch's backward as B (``input_grads``) then W (``weight_grads``).

    Use: ``with split.recording(): outs = chunk(*args)``, then
    ``split.input_grads(outs, grad_outs, inputs)`` when the output gradients
    arrive, and ``split.weight_grads()`` any time after (before the optimizer
    step). ``param_ptrs``: storage addresses of the weights, left out of the
    byte counts; ``defer``: see ``plan_split``.
    """

    def __init__(self, param_ptrs: Iterable[int] = (), defer: str = "gemm") -> None:
        self.store = SavedTensorStore(set(param_ptrs))
        self.defer = defer
        """Which B-side nodes W runs again: 'gemm' (the weight GEMMs) or 'all' (``plan_split``)."""
        self.counts: dict[str, int] = {}
        """The last split's ``BackwardSplitPlan.counts()`` (the plan itself is dropped after B)."""
        self._pending: list[tuple[Node, tuple, list[EdgeKey]]] | None = None
        self._entry_grads: dict[EdgeKey, torch.Tensor] = {}
        self._done = False

    def recording(self):
        """The forward to split runs inside this block (its saved tensors go to ``self.store``)."""
        return self.store.recording()

    def input_grads(self, outputs: Sequence[torch.Tensor], grad_outputs: Sequence[torch.Tensor | None],
                    inputs: Sequence[torch.Tensor]) -> list[torch.Tensor | None]:
        """B: the gradients of ``inputs`` (None where none flows); ``grad_outputs`` None for a scalar
        loss. Runs every collective of the backward; keeps for W only what its nodes read."""
        if not self.store.recorded:
            raise StepOrderError("SplitBackward.input_grads: the forward was not recorded; run the chunk inside "
                               "`with split.recording():` so B can release what W does not need")
        if self._pending is not None:
            raise StepOrderError("SplitBackward.input_grads ran twice for one forward")
        pairs = [(get_gradient_edge(o), g if g is not None else torch.ones_like(o))
                 for o, g in zip(outputs, grad_outputs) if o.requires_grad]
        wanted = [i for i, x in enumerate(inputs) if x.requires_grad]
        input_nodes = {get_gradient_edge(inputs[i]).node for i in wanted}
        plan = plan_split([e.node for e, _ in pairs], input_nodes, self.defer)
        self.counts = plan.counts()
        for edge, g in pairs:
            if edge.node in plan.w_side:  # no B-side node above it: W starts right there
                self._add(edge.node, edge.output_nr, g)
        b_roots = [(e, g) for e, g in pairs if e.node in plan.b_side]
        captured_in = {}
        hooks = [node.register_prehook(lambda grads, node=node: captured_in.__setitem__(node, grads))
                 for node in plan.deferred]
        deferred = set(plan.deferred)
        self.store.release = lambda slot: torch._C._current_autograd_node() not in deferred
        try:
            got = self._run_b(b_roots, [inputs[i] for i in wanted], plan.captured)
        finally:
            for hook in hooks:
                hook.remove()
        for (node, nr), g in zip(plan.captured, got[len(wanted):]):
            self._add(node, nr, g)
        self._pending = [(node, captured_in[node], edges) for node, edges in plan.deferred.items()
                         if node in captured_in]
        self.store.replay_pending()  # a region B did not need (all its nodes on the W side): replayed now
        result: list[torch.Tensor | None] = [None] * len(inputs)
        for i, g in zip(wanted, got):
            result[i] = g
        return result

    @staticmethod
    def _run_b(roots, inputs: list[torch.Tensor], captured: list[EdgeKey]) -> list[torch.Tensor | None]:
        targets = list(inputs) + [GradientEdge(node, nr) for node, nr in captured]
        if not roots or not targets:
            return [None] * len(targets)
        return list(torch.autograd.grad([e for e, _ in roots], targets, [g for _, g in roots],
                                        retain_graph=True, allow_unused=True))

    def _add(self, node: Node, nr: int, grad: torch.Tensor | None) -> None:
        if grad is None:
            return
        key = (node, nr)
        self._entry_grads[key] = grad if key not in self._entry_grads else self._entry_grads[key] + grad

    def weight_grads(self) -> None:
        """W: the weights' gradients, accumulated into their ``.grad``. No collective, no replay."""
        if self._pending is None:
            raise StepOrderError("SplitBackward.weight_grads before input_grads: W needs B's gradients")
        if self._done:
            raise StepOrderError("SplitBackward.weight_grads ran twice for one backward")
        self._done = True
        pending, self._pending = self._pending, []
        for node, grads, edges in pending:
            roots = [(GradientEdge(node, i), g) for i, g in enumerate(grads) if g is not None]
            if not roots:
                continue
            got = torch.autograd.grad([e for e, _ in roots], [GradientEdge(v, nr) for v, nr in edges],
                                      [g for _, g in roots], allow_unused=True)
            for (v, nr), g in zip(edges, got):
                self._add(v, nr, g)
        entries, self._entry_grads = self._entry_grads, {}
        if entries:
            torch.autograd.backward([GradientEdge(v, nr) for v, nr in entries], list(entries.values()))

    def held_bytes(self) -> int:
        """Activation bytes held for W now: the store's live slots and the gradients kept at B."""
        grads = list(self._entry_grads.values())
        for _, gs, _ in self._pending or []:
            grads += [g for g in gs if g is not None]
        return self.store.held_bytes() + sum(g.numel() * g.element_size() for g in grads)
