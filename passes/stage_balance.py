"""The pipeline cut balanced per stage: the layers cut into chunks so that the stages' totals are even.

A stage runs every chunk it holds, so what a pipeline waits for is the stage
with the most work, not the chunk. With one chunk per stage the two are the
same and ``balance`` (min-max over chunks) is the answer. With several, the
placement decides which chunks add up: interleaved stage ``s`` holds chunks
``s, s + p, ...``; ZB-V's V holds ``s`` and ``2p - 1 - s``, so stage 0 holds
both the first chunk (embedding) and the last (head and loss).

``balance_stages`` cuts a V exactly: the smallest largest stage total, then,
among those cuts, the smallest largest chunk (a chunk's forward is one step of
the schedule: an outsized one stalls its neighbours). Each bound is found by
bisection over a feasibility test that walks the V from the outside in (stage
``s`` takes chunk ``s`` from the left of what is left and chunk ``2p - 1 - s``
from the right), keeping every interval a stage can leave. Interleaved
placements keep ``balance``'s min-max chunk cut: their stages run the chunks
in lock-step rounds, one chunk's work per round, so the largest chunk is what
a round waits for. Tested against every cut of small sequences
(``tests/passes/test_stage_balance.py``).
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Sequence

from autopar.core.errors import AutoparError

__all__ = ["balance", "balance_stages", "stage_totals", "BalanceError"]


class BalanceError(AutoparError, ValueError):
    """More runs asked for than there are items to cut."""


def balance(costs: Sequence[float], k: int) -> list[int]:
    """Min-max partition of ``costs`` into ``k`` contiguous non-empty runs; returns run start indices."""
    n = len(costs)
    if k > n:
        raise BalanceError(f"cannot cut {n} items into {k} non-empty runs")
    prefix = _prefix(costs)
    inf = float("inf")
    # best[j][i]: min over partitions of the first i items into j runs of the max run cost
    best = [[inf] * (n + 1) for _ in range(k + 1)]
    cut = [[0] * (n + 1) for _ in range(k + 1)]
    best[0][0] = 0.0
    for j in range(1, k + 1):
        for i in range(j, n - (k - j) + 1):
            for s in range(j - 1, i):
                v = max(best[j - 1][s], prefix[i] - prefix[s])
                if v < best[j][i] - 1e-12 * max(1.0, v):
                    best[j][i], cut[j][i] = v, s
    starts, i = [], n
    for j in range(k, 0, -1):
        s = cut[j][i]
        starts.append(s)
        i = s
    return starts[::-1]


def stage_totals(costs: Sequence[float], starts: Sequence[int], chunk_stages: Sequence[int]) -> list[float]:
    """Each stage's total cost when chunk ``c`` (items ``starts[c]`` up to the next start) lives on
    stage ``chunk_stages[c]``."""
    prefix = _prefix(costs)
    ends = list(starts[1:]) + [len(costs)]
    totals = [0.0] * (max(chunk_stages) + 1)
    for c, (s, e) in enumerate(zip(starts, ends)):
        totals[chunk_stages[c]] += prefix[e] - prefix[s]
    return totals


def balance_stages(costs: Sequence[float], chunk_stages: Sequence[int]) -> list[int]:
    """Start indices of ``len(chunk_stages)`` contiguous non-empty runs of ``costs``, chunk ``c`` on
    stage ``chunk_stages[c]``: for a V placement, the cut with the smallest largest stage total and,
    among those, the smallest largest chunk; otherwise ``balance``'s min-max cut over chunks."""
    k = len(chunk_stages)
    if k > len(costs):
        raise BalanceError(f"cannot cut {len(costs)} items into {k} non-empty runs")
    if not _is_v(chunk_stages):
        return balance(costs, k)
    prefix = _prefix(costs)
    even = balance(costs, k)  # feasible; no cut has a smaller largest chunk
    chunk_least = max(_chunk_costs(prefix, even))
    p = k // 2
    stage_bound = _least(lambda t: _v_cut(prefix, p, t, prefix[-1]) is not None,
                         max(prefix[-1] / p, max(costs)), max(stage_totals(costs, even, chunk_stages)))
    chunk_bound = _least(lambda c: _v_cut(prefix, p, stage_bound, c) is not None, chunk_least, stage_bound)
    return _v_cut(prefix, p, stage_bound, chunk_bound)


def _is_v(chunk_stages: Sequence[int]) -> bool:
    """Two chunks per stage in a V: chunk ``c`` and chunk ``2p - 1 - c`` on stage ``c`` (``c < p``)."""
    k = len(chunk_stages)
    return k % 2 == 0 and list(chunk_stages) == list(range(k // 2)) + list(range(k // 2))[::-1] and k > 1


def _least(feasible, lo: float, hi: float) -> float:
    """The least bound in [lo, hi] that ``feasible`` accepts (``feasible(hi)`` must hold), to a
    relative 1e-6 (costs are estimates): bisection on a monotone predicate."""
    if feasible(lo):
        return lo
    while hi - lo > 1e-6 * max(1.0, hi):
        mid = (lo + hi) / 2
        if feasible(mid):
            hi = mid
        else:
            lo = mid
    return hi


def _v_cut(prefix: list[float], p: int, stage_bound: float, chunk_bound: float) -> list[int] | None:
    """A cut of the items into 2p chunks in a V with every stage's total <= ``stage_bound`` and every
    chunk <= ``chunk_bound``, or None if there is none.

    Outside in: stage ``s`` takes chunk ``s`` from the left end of what is left and chunk
    ``2p - 1 - s`` from the right end, so what is left after it is an interval ``[a, b)``. Every
    interval a stage can leave is kept (a narrower one is not always better: each chunk needs an
    item); the innermost stage takes the last interval as chunks ``p - 1`` and ``p``. The cut is
    then read back from the innermost stage out.
    """
    n = len(prefix) - 1
    bounds = (stage_bound, chunk_bound, 1e-9 * max(1.0, prefix[-1]))
    layers = [{(0, n)}]
    for s in range(p - 1):
        layers.append(_next_intervals(prefix, layers[-1], 2 * (p - 1 - s), bounds))
        if not layers[-1]:
            return None
    for a, b in sorted(layers[-1]):
        middle = _middle_cut(prefix, a, b, *bounds)
        if middle is not None:
            return _read_back(prefix, layers, (a, b), middle, bounds)
    return None


def _moves(prefix, interval: tuple[int, int], need: int, bounds) -> list[tuple[int, int, int]]:
    """(a2, lowest b2, highest b2): the outer stage of ``interval = [a, b)`` takes ``[a, a2)`` and
    ``[b2, b)`` for any b2 in the range, leaving ``[a2, b2)`` with at least ``need`` items."""
    stage_bound, chunk_bound, slack = bounds
    a, b = interval
    out = []
    for a2 in range(a + 1, b - need):
        left = prefix[a2] - prefix[a]
        if left > min(chunk_bound, stage_bound) + slack:
            break
        room = min(chunk_bound, stage_bound - left)
        lowest = max(bisect_left(prefix, prefix[b] - room - slack), a2 + need)
        if lowest < b:
            out.append((a2, lowest, b - 1))
    return out


def _next_intervals(prefix, intervals: set, need: int, bounds) -> set[tuple[int, int]]:
    """Every interval one more stage can leave from one of ``intervals``."""
    reached: set[tuple[int, int]] = set()
    for interval in intervals:
        for a2, lowest, highest in _moves(prefix, interval, need, bounds):
            reached.update((a2, b2) for b2 in range(lowest, highest + 1))
    return reached


def _middle_cut(prefix, a: int, b: int, stage_bound: float, chunk_bound: float, slack: float) -> int | None:
    """Where the innermost stage's interval ``[a, b)`` splits into chunks ``p - 1`` and ``p``, or None."""
    if b - a < 2 or prefix[b] - prefix[a] > stage_bound + slack:
        return None
    for m in range(a + 1, b):
        if prefix[m] - prefix[a] <= chunk_bound + slack and prefix[b] - prefix[m] <= chunk_bound + slack:
            return m
    return None


def _read_back(prefix, layers: list[set], last: tuple[int, int], middle: int, bounds) -> list[int]:
    """The chunk starts of a chain of intervals, one per stage, that ends at ``last``."""
    chain = [last]
    for s in range(len(layers) - 2, -1, -1):
        need = 2 * (len(layers) - 1 - s)
        a2, b2 = chain[-1]
        chain.append(next(iv for iv in sorted(layers[s]) if any(
            m[0] == a2 and m[1] <= b2 <= m[2] for m in _moves(prefix, iv, need, bounds))))
    chain.reverse()  # (0, n), then what each stage leaves
    lefts = [a for a, _ in chain]  # starts of chunks 0 .. p-1
    rights = [b for _, b in reversed(chain[1:])]  # starts of chunks p+1 .. 2p-1
    return lefts + [middle] + rights


def _chunk_costs(prefix: list[float], starts: Sequence[int]) -> list[float]:
    ends = list(starts[1:]) + [len(prefix) - 1]
    return [prefix[e] - prefix[s] for s, e in zip(starts, ends)]


def _prefix(costs: Sequence[float]) -> list[float]:
    prefix = [0.0]
    for c in costs:
        prefix.append(prefix[-1] + c)
    return prefix
