"""Expert parallelism's token exchange: rows sorted by expert travel to the rank holding their expert.

A mixture-of-experts layer sorts its token rows by expert (each token once per
chosen expert) and multiplies each expert's run of rows by that expert's
weights: a grouped matmul whose group offsets ``offs`` (E,) are the cumulative
rows per expert. Under expert parallelism the E experts are split into ``ep``
blocks of E/ep whole experts, one per rank of the expert group (data-parallel
replicas, each with its own tokens), and the expert computation between the
sorted rows and the last grouped matmul runs on the rank that holds the
expert (``passes/expert_parallel.py`` rewrites the graph around it):

- ``expert_route(tp, offs, ...)``       every rank's ``offs``, all-gathered: (ep, E), the
                                        routing every other function reads;
- ``expert_dispatch(tp, x, route, ...)`` the rows of this rank's experts from every rank
                                        of the group, grouped by expert;
- ``expert_offsets(tp, route, ...)``    the group offsets of those rows over the local experts;
- ``expert_combine(tp, y, route, ...)`` the results sent back to the ranks the rows came
                                        from, in their sorted order.

Whole experts under tensor parallelism (``expert_tp=1``): the t ranks of a
replica hold the same sorted rows; each keeps its 1/t block of them
(``scatter_to_tp``, zero rows padding the last), its offsets cut to the block
(``expert_tp_offsets``), and sends those; the results are gathered back over
tp (``gather_from_tp``). The expert groups then run over the stage's t*d ranks.

Gradients: an expert weight's gradient sums the rows its expert group sent,
and is then averaged over the ``edp`` ranks holding the same experts; to be
the mean over all d replicas, as a dense weight's, it is scaled by
``split / ep``, where ``split`` is how many ranks share a replica's rows (1, or
t with whole experts): the holders together saw every replica's rows once,
and are ``split * d / ep`` in number. The combine's backward scales the
gradient entering the expert region by that and the dispatch's backward by
its inverse, so only the expert weights (which the region alone reads) keep
it (exact for powers of two). Inside the region nothing else changes, so this
holds under ``torch.compile`` and with the backward split into B and W.

Two dispatchers (``dispatcher``):

- ``'allgather'``: all rows of the group are all-gathered (ep*S, H); this rank's
  experts' rows are moved to the front, the rest zeros; the grouped matmuls
  compute only the rows their offsets cover; the results go back by a
  reduce-scatter, where each row is summed with zeros from every other rank:
  its value exactly. Every shape is static (ep*S rows).
- ``'alltoall'``: the counts come with the route; each rank sends each peer
  exactly the rows of the peer's experts (one all-to-all), and gets the
  results back the same way. The rows a rank holds vary with the routing.

Both are exact: every row is computed once, by the rank holding its expert,
with the model's own code. The backward of each is its conjugate (an
all-gather's is a reduce-scatter, an all-to-all's the reverse all-to-all).

An inspection group (no process group: the compiler's shape propagation)
returns zeros of the shapes a run has (for 'alltoall', S rows: the balanced
share) without communicating.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from autopar.core.comm.group import TPGroup, all_gather_dim
from autopar.core.collectives import CollectiveError

__all__ = ["expert_route", "expert_dispatch", "expert_offsets", "expert_combine", "expert_tp_offsets", "ExpertLoad",
           "EXPERT_LOAD"]


def _group(tp: TPGroup, ep: int) -> TPGroup:
    """The expert group the rank program runs over: the engine's, or an inspection group of ``ep``."""
    if tp.ep is not None:
        if tp.ep.size != ep:
            raise CollectiveError(f"the program splits experts ep={ep} ways, but this rank's expert group has "
                                  f"{tp.ep.size} ranks: run it on the mesh it was compiled for")
        return tp.ep
    return TPGroup(0, ep, None)


class ExpertLoad:
    """Rows each expert received, per layer, summed over the training forwards since the last ``take``
    (the engine takes it after each step): this rank's expert group's tokens, as ``expert_route``
    saw them (a recomputed forward and an evaluation step are not counted)."""

    def __init__(self):
        self._rows: dict[str, torch.Tensor] = {}

    def add(self, site: str, rows_per_expert: torch.Tensor) -> None:
        prev = self._rows.get(site)
        rows = rows_per_expert.detach().to("cpu", torch.int64)
        self._rows[site] = rows if prev is None else prev + rows

    def take(self) -> dict[str, list[int]]:
        out = {site: rows.tolist() for site, rows in self._rows.items()}
        self._rows.clear()
        return out


EXPERT_LOAD = ExpertLoad()
"""This process's count of the rows routed to each expert (one engine runs per process)."""


# ----------------------------------------------------------------------------- the route


def expert_tp_offsets(tp: TPGroup, offs: torch.Tensor, block: int) -> torch.Tensor:
    """The group offsets of this tp rank's block of the sorted rows (rows [rank * block, (rank + 1) *
    block), as ``scatter_to_tp`` cuts them): each cumulative count shifted to the block and clamped
    to it, in ``offs``' dtype."""
    return (offs - tp.first_index(block)).clamp(0, block).to(offs.dtype)


def expert_route(tp: TPGroup, offs: torch.Tensor, experts: int, ep: int, site: str = "") -> torch.Tensor:
    """Every rank's cumulative rows per expert (``offs``, (E,)), gathered over the expert group:
    (ep, E) int64, the same on every rank of the group. Counts the load under ``site``."""
    group = _group(tp, ep)
    offs = offs.reshape(1, experts).to(torch.int64)
    if group.pg is None:
        return offs.expand(ep, experts).clone()
    route = all_gather_dim(offs, group, 0)
    _count_load(site, route)
    return route


@torch.compiler.disable(reason="expert load: counted on the host at every run of a compiled chunk too")
def _count_load(site: str, route: torch.Tensor) -> None:
    """Add the route's rows per expert to ``EXPERT_LOAD``: in training forwards only (not in a
    recomputation, which runs inside the backward, nor in an evaluation, which runs without grad)."""
    if torch.is_grad_enabled() and torch._C._current_graph_task_id() == -1:
        EXPERT_LOAD.add(site, _counts(route).sum(0))


def _counts(route: torch.Tensor) -> torch.Tensor:
    """(ep, E) rows per (source rank, expert) from the cumulative offsets."""
    return torch.diff(route, dim=1, prepend=route.new_zeros(route.shape[0], 1))


@dataclass(frozen=True)
class _Plan:
    """Where rank ``me``'s experts' rows are, read from the route (plain integers: one host copy)."""

    order: torch.Tensor
    """Indices into the arriving rows (all-gathered, or received by the all-to-all) that put them
    grouped by local expert, then by source rank."""
    local_offsets: torch.Tensor
    """(E/ep,) int32: cumulative rows per local expert over the whole group."""
    send: list[int]
    """'alltoall': rows this rank sends to each peer (its rows of the peer's experts)."""
    recv: list[int]
    """'alltoall': rows this rank receives from each peer (the peer's rows of its experts)."""
    held: int
    """Rows of this rank's experts over the group."""


def _plan(route: torch.Tensor, group: TPGroup, rows: int, dispatcher: str) -> _Plan:
    ep, experts = route.shape
    per = experts // ep
    me = group.rank
    offs = route.tolist()
    first = [[0] + o[:-1] for o in offs]  # each (source, expert)'s first row in the source's sorted rows
    counts = [[o[e] - first[s][e] for e in range(experts)] for s, o in enumerate(offs)]
    mine = range(me * per, (me + 1) * per)
    pieces, held_per_expert = [], []
    if dispatcher == "allgather":  # the arriving rows are every source's S rows, source by source
        for e in mine:
            for s in range(ep):
                pieces.append((s * rows + first[s][e], counts[s][e]))
            held_per_expert.append(sum(counts[s][e] for s in range(ep)))
        send = recv = []
    else:  # the arriving rows are each source's rows of my experts, source by source, expert by expert
        recv = [sum(counts[s][e] for e in mine) for s in range(ep)]
        send = [sum(counts[me][e] for e in range(q * per, (q + 1) * per)) for q in range(ep)]
        starts = [sum(recv[:s]) for s in range(ep)]
        for e in mine:
            for s in range(ep):
                pieces.append((starts[s] + first[s][e] - first[s][me * per], counts[s][e]))
            held_per_expert.append(sum(counts[s][e] for s in range(ep)))
    order = torch.cat([torch.arange(start, start + n) for start, n in pieces]) if pieces else torch.zeros(0, dtype=torch.int64)
    local = torch.tensor(held_per_expert, dtype=torch.int64).cumsum(0).to(torch.int32)
    return _Plan(order.to(route.device), local.to(route.device), send, recv, int(sum(held_per_expert)))


# ----------------------------------------------------------------------------- autograd pieces


def _gather_rows(x: torch.Tensor, group: TPGroup) -> torch.Tensor:
    """Every rank's rows, rank by rank, in a new tensor (never a view: the model may add to it in place)."""
    x = x.contiguous()
    out = x.new_empty((x.shape[0] * group.size, *x.shape[1:]))
    dist.all_gather_single(out, x, group=group.pg)
    return out


def _scatter_rows(x: torch.Tensor, group: TPGroup) -> torch.Tensor:
    """The rows summed over the ranks, this rank's 1/size block kept, in a new tensor."""
    x = x.contiguous()
    out = x.new_empty((x.shape[0] // group.size, *x.shape[1:]))
    dist.reduce_scatter_single(out, x, group=group.pg)
    return out


def _scaled_conjugates(name: str, forward, backward) -> type[torch.autograd.Function]:
    """An autograd Function running ``forward(x, group)``, and in the backward ``backward(grad, group)``
    times ``scale`` (its conjugate: an all-gather's is a reduce-scatter, and the converse)."""

    def fwd(ctx, x, group, scale):
        ctx.group, ctx.scale = group, scale
        return forward(x, group)

    def bwd(ctx, grad):
        return backward(grad, ctx.group) * ctx.scale, None, None

    return type(name, (torch.autograd.Function,), {"forward": staticmethod(fwd), "backward": staticmethod(bwd)})


_GatherRows = _scaled_conjugates("_GatherRows", _gather_rows, _scatter_rows)
"""All-gather along rows; backward: reduce-scatter of the gradient (each rank's rows summed), times scale."""
_ScatterRows = _scaled_conjugates("_ScatterRows", _scatter_rows, _gather_rows)
"""Reduce-scatter along rows; backward: all-gather of the gradient, times scale."""


def _all_to_all(x: torch.Tensor, group: TPGroup, out_rows: list[int], in_rows: list[int]) -> torch.Tensor:
    x = x.contiguous()
    out = x.new_empty((sum(out_rows), *x.shape[1:]))
    dist.all_to_all_single(out, x, output_split_sizes=out_rows, input_split_sizes=in_rows, group=group.pg)
    return out


class _Exchange(torch.autograd.Function):
    """All-to-all of rows (``send`` to each peer, ``recv`` from each); backward: the reverse exchange,
    times ``scale``."""

    @staticmethod
    def forward(ctx, x, group, recv, send, scale):
        ctx.args = (group, recv, send, scale)
        return _all_to_all(x, group, recv, send)

    @staticmethod
    def backward(ctx, grad):
        group, recv, send, scale = ctx.args
        return _all_to_all(grad, group, send, recv) * scale, None, None, None, None


# ----------------------------------------------------------------------------- the exchange


@torch.compiler.disable(reason="expert dispatch: the rows each rank holds depend on the routing")
def expert_dispatch(tp: TPGroup, x: torch.Tensor, route: torch.Tensor, ep: int, dispatcher: str,
                    split: int = 1) -> torch.Tensor:
    """The rows of this rank's experts from every rank of the expert group, grouped by local expert
    (then by source rank). ``x``: this rank's S rows sorted by expert. 'allgather': (ep*S, ...), the
    held rows first, zeros after; 'alltoall': exactly the held rows. ``split``: ranks sharing a
    replica's rows (the gradient scale, module docstring)."""
    group = _group(tp, ep)
    rows = x.shape[0]
    if group.pg is None:
        return x.new_zeros((rows * ep if dispatcher == "allgather" else rows, *x.shape[1:]))
    plan = _plan(route, group, rows, dispatcher)
    if dispatcher == "allgather":
        gathered = _GatherRows.apply(x, group, ep / split)
        held = gathered.index_select(0, plan.order)
        return torch.cat([held, held.new_zeros((ep * rows - plan.held, *x.shape[1:]))])
    sent = x.narrow(0, 0, sum(plan.send))  # rows past the last offset go to no expert
    return _Exchange.apply(sent, group, plan.recv, plan.send, ep / split).index_select(0, plan.order)


@torch.compiler.disable(reason="expert dispatch: the rows each rank holds depend on the routing")
def expert_offsets(tp: TPGroup, route: torch.Tensor, ep: int, dispatcher: str, rows: int) -> torch.Tensor:
    """Group offsets of the dispatched rows over this rank's E/ep experts ((E/ep,) int32)."""
    group = _group(tp, ep)
    experts = route.shape[1]
    if group.pg is None:
        return route.new_zeros(experts // ep, dtype=torch.int32)
    return _plan(route, group, rows, dispatcher).local_offsets


@torch.compiler.disable(reason="expert dispatch: the rows each rank holds depend on the routing")
def expert_combine(tp: TPGroup, y: torch.Tensor, route: torch.Tensor, ep: int, dispatcher: str,
                   rows: int, split: int = 1) -> torch.Tensor:
    """This rank's experts' results ``y`` (rows as ``expert_dispatch`` gave them) sent back to the
    ranks their rows came from: (S, ...) in this rank's sorted order, zeros on rows no expert took."""
    group = _group(tp, ep)
    if group.pg is None:
        return y.new_zeros((rows, *y.shape[1:]))
    plan = _plan(route, group, rows, dispatcher)
    held = y.narrow(0, 0, plan.held)
    if dispatcher == "allgather":
        spread = held.new_zeros((ep * rows, *y.shape[1:])).index_copy(0, plan.order, held)
        return _ScatterRows.apply(spread, group, split / ep)
    back = held.new_zeros((sum(plan.recv), *y.shape[1:])).index_copy(0, plan.order, held)
    mine = _Exchange.apply(back, group, plan.send, plan.recv, split / ep)
    return torch.cat([mine, mine.new_zeros((rows - mine.shape[0], *y.shape[1:]))])
