"""The zero-bubble schedules of Qi et al. (ICLR 2024): ZB-H1 and ZB-V.

Both split each backward into B (the input gradient, which the previous chunk
waits for) and W (the weight gradient, which only the optimizer step waits
for), and use the freedom to run W late to fill the pipeline's bubbles. Costs
below are per chunk, ``t_b`` the whole backward and ``t_w`` its W part.

ZB-H1 (one chunk per stage, interleaved placement, ``m >= p``)
    Stage ``r`` runs 1F1B's warm-up (``p - r - 1`` forwards), then steady
    rounds of one F and one B, and its W's ``r`` rounds late; the cool-down
    runs B then the next W, and the ``r`` delayed W's close the step. The W's
    fill the cool-down bubbles and take no part in the B chain, so the idle
    time per stage drops from 1F1B's ``(p-1)(t_f + t_b)`` to
    ``(p-1)(t_f + t_b - 2 t_w)``: ``p - 1`` with F = B = W = 1. Stage ``r`` holds
    1F1B's ``p - r`` activations between F and B, plus up to ``r`` waiting for
    their W: at most ``p`` on every stage, 1F1B's peak.
ZB-V (two chunks per stage in a V, ``m >= p``)
    Stage ``r`` holds chunks ``r`` and ``2p - 1 - r`` (``placement.py``). It runs
    ``2(p - r) - 1`` forwards of its first chunk, ``r`` pairs of forwards of
    both, then ``p - r`` rounds (F, B, W) of its second chunk; the steady state
    alternates (F, B, W) of the first chunk and of the second; the cool-down
    runs the remaining B's and, in the gaps, W's. This is PyTorch's
    ``ScheduleZBVZeroBubble`` order, laid out for ``max(m, 2p - 1)``
    microbatches with those ``>= m`` dropped. With equal chunk costs
    F = B = W = 1 the idle time per stage is ``max(p - 1, 2(2p - 1 - m))``
    (tested for every ``p <= 8``, ``p <= m <= 32``): ``p - 1`` (a forward of one
    chunk, half a stage's, per hop) once ``m >= (3p - 1) / 2``, the least any
    schedule can reach, since the last stage's first forward cannot start
    before ``p - 1`` hops; below that the dropped microbatches leave holes.
    Each stage holds at most ``2p`` chunk activations, ``p`` stages' worth:
    1F1B's peak.

ZB-H2 (more warm-up forwards, twice the memory) is not generated: under a
step that ends with a synchronous optimizer update, as autopar's does, the
last stage cannot start before ``(p-1) t_f``, so no schedule's idle time is
below ``(p-1) t_f``; ZB-H1 already reaches it when ``t_b = 2 t_w = 2 t_f``,
and ZB-H2's ``(p-1)(t_f + t_b - 2 t_w)`` needs the paper's bypass of the
optimizer's synchronisation, which overlaps consecutive steps.
"""

from __future__ import annotations

from collections.abc import Callable

from autopar.schedules.actions import Action, Kind
from autopar.schedules.chunk_placement import Placement
from autopar.schedules.schedule import Schedule

__all__ = ["zb_h1", "zb_v"]


def zb_h1(p: int, m: int) -> Schedule:
    """ZB-H1 (see the module's docstring): 1F1B with each backward split and stage ``r``'s
    W's delayed ``r`` rounds. Needs ``m >= p``. Not validated here (``generate`` does)."""
    return Schedule("zb-h1", p, 1, m, {r: _zb_h1_stage(p, m, r) for r in range(p)})


def _zb_h1_stage(p: int, m: int, r: int) -> list[Action]:
    """Stage ``r``'s actions: warm-up forwards, rounds (F, B, late W), cool-down (B, W), the rest of the W's."""
    warmup = min(p - r - 1, m)
    order = [Action(Kind.F, r, i) for i in range(warmup)]
    weights = 0  # W's run so far; W i runs ``r`` rounds after B i
    for k in range(m):  # round k: the forward (if any is left) and backward k
        if warmup + k < m:
            order.append(Action(Kind.F, r, warmup + k))
        order.append(Action(Kind.B, r, k))
        if k >= r:
            order.append(Action(Kind.W, r, weights))
            weights += 1
    return order + [Action(Kind.W, r, i) for i in range(weights, m)]


def zb_v(p: int, m: int) -> Schedule:
    """ZB-V (see the module's docstring): two chunks per stage in a V. Needs ``m >= p``.
    Not validated here (``generate`` does)."""
    stages = {r: _zb_v_stage(p, m, r) for r in range(p)}
    return Schedule("zbv", p, 2, m, stages, placement=Placement.V)


class _Counter:
    """Next microbatch of each (kind, chunk) on one stage; emits actions into ``order``,
    dropping those of microbatches >= m (the V is laid out for at least 2p - 1)."""

    def __init__(self, m: int) -> None:
        self.m, self.order, self.next = m, [], {}

    def emit(self, kind: Kind, chunk: int) -> None:
        i = self.next.get((kind, chunk), 0)
        self.next[(kind, chunk)] = i + 1
        if i < self.m:
            self.order.append(Action(kind, chunk, i))

    def count(self, kind: Kind, chunk: int) -> int:
        return self.next.get((kind, chunk), 0)


def _zb_v_stage(p: int, m: int, r: int) -> list[Action]:
    """Stage ``r``'s actions: warm-up, steady state and cool-down of the V (PyTorch's order)."""
    n = max(2 * p - 1, m)  # microbatches the V is laid out for; those >= m are dropped
    first, second = r, 2 * p - 1 - r
    run = _Counter(m)
    f, b, w = Kind.F, Kind.B, Kind.W
    _repeat(2 * (p - r) - 1, lambda: run.emit(f, first))
    _repeat(r, lambda: (run.emit(f, second), run.emit(f, first)))
    _repeat(p - r, lambda: (run.emit(f, second), run.emit(b, second), run.emit(w, second)))
    while run.count(f, second) < run.count(f, first) or run.count(f, first) < n:
        if run.count(f, first) < n:
            run.emit(f, first)
        run.emit(b, first)
        run.emit(w, first)
        run.emit(f, second)
        run.emit(b, second)
        run.emit(w, second)
    _repeat(r, lambda: (run.emit(b, first), run.emit(b, second)))
    _repeat(p - r, lambda: (run.emit(b, first), run.emit(w, first)))
    for chunk in (second, first):
        while run.count(w, chunk) < n:
            run.emit(w, chunk)
    return run.order


def _repeat(times: int, step: Callable[[], object]) -> None:
    for _ in range(times):
        step()
