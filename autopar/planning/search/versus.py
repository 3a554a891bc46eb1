"""Two layouts side by side: the terms of their iteration times and the difference, the table of
``Plan.why()`` and of ``autopar plan --vs-tp/--vs-pp/...``.

The terms group ``Estimate.breakdown`` by what a user can act on: the compute (GEMMs and
memory-bound kernels), the bubble, the stage imbalance, and the communication of each kind of
parallelism, and the optimizer step. They sum to the iteration time (the breakdown's
critical-path seconds), so the differences sum to the difference of the iteration times.
"""

from __future__ import annotations

from dataclasses import dataclass

from autopar.planning.cost.step_estimate import Estimate

__all__ = ["TERMS", "TermRow", "term_rows", "term_lines"]

TERMS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("compute", ("gemm", "memory")),
    ("bubble", ("bubble",)),
    ("imbalance", ("imbalance",)),
    ("tensor-parallel communication", ("tp_comm",)),
    ("expert-parallel communication", ("ep_comm",)),
    ("context-parallel communication", ("cp_comm",)),
    ("pipeline communication", ("p2p",)),
    ("data-parallel communication", ("dp",)),
    ("optimizer", ("optimizer",)),
    ("runtime overheads", ("runtime", "runtime_step")),
)
"""(term, the breakdown keys it sums)."""


@dataclass(frozen=True)
class TermRow:
    """One term of two layouts' iterations, seconds."""

    term: str
    a: float
    b: float

    @property
    def difference(self) -> float:
        """a - b: negative where layout a is faster."""
        return self.a - self.b


def term_rows(a: Estimate, b: Estimate) -> list[TermRow]:
    """The terms of ``a`` and ``b`` in ``TERMS``' order, and the whole iteration last; the
    expert-parallel term only when one of them exchanges tokens (ep > 1), the context-parallel one only
    when one of them splits the sequence (cp > 1)."""
    rows = [TermRow(name, sum(a.breakdown.get(k, 0.0) for k in keys), sum(b.breakdown.get(k, 0.0) for k in keys))
            for name, keys in TERMS]
    rows = [r for r in rows if r.term != "expert-parallel communication" or max(a.layout.ep, b.layout.ep) > 1]
    rows = [r for r in rows if r.term != "context-parallel communication" or max(a.layout.cp, b.layout.cp) > 1]
    return rows + [TermRow("iteration", a.t_iter, b.t_iter)]


def term_lines(a: Estimate, b: Estimate, label_a: str = "A", label_b: str = "B") -> list[str]:
    """``term_rows`` as an aligned text table: seconds of each layout (milliseconds when both iterations
    take less than a second), their difference and its share of b's iteration, the layouts named in the
    header."""
    rows = term_rows(a, b)
    width = max(len(r.term) for r in rows)
    unit, k = ("ms", 1e3) if max(a.t_iter, b.t_iter) < 1.0 else ("s", 1.0)
    lines = [f"  {label_a}: {a.layout.short}", f"  {label_b}: {b.layout.short}",
             f"  {f'term ({unit})':<{width}}  {label_a:>9}  {label_b:>9}  {label_a + ' - ' + label_b:>9}  "
             f"{'of ' + label_b:>7}"]
    for r in rows:
        lines.append(f"  {r.term:<{width}}  {r.a * k:9.3f}  {r.b * k:9.3f}  {r.difference * k:+9.3f}  "
                     f"{r.difference / b.t_iter:+7.1%}")
    return lines
