"""Contractions as einsum equations, decided by one rule (``contract``).

Every matmul-like op is an equation over subscript letters: ``mm`` is
``mk,kn->mn``, ``bmm`` ``bmk,bkn->bmn``, ``matmul`` the same with broadcast
batch letters, ``linear`` ``...k,nk->...n`` plus a bias ``n``, ``addmm`` and
``baddbmm`` a product plus an input (the *addend*), ``einsum`` its own. With
one letter split (on one or more operands, in the same segments):

- kept in the output: the output is split on it; replicated operands that
  carry it are sliced, those that do not (or broadcast along it) are read
  whole by every rank and get f if they require grad;
- summed over: every operand carrying it must be split already; each rank
  computes a partial sum and g adds them up (the row-parallel pattern); an
  addend is then added once, after g.

How an op family words its fallbacks, and which splits it accepts, is its
``Family``.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
import torch.fx as fx

from autopar.core.tensor_placement import Shard
from passes.rules.context import Ctx, Path, arg, arg_path, ndim, operand, shape
from passes.rules.decision import R, Decision, Operand, Rewrite, fallback
from passes.rules.registry import Placements

__all__ = ["Equation", "Family", "contract", "equation_of", "linear_equation", "MATMUL", "BADDBMM", "EINSUM"]

aten = torch.ops.aten


@dataclass(frozen=True)
class Equation:
    factors: tuple[tuple[Path, str], ...]
    """(operand path, its subscripts) of each factor of the product."""
    out: str
    """Subscripts of the output."""
    addend: tuple[Path, str] | None = None
    """(path, subscripts) of a value added to the product (a bias, addmm's or baddbmm's input),
    its subscripts those of the output it broadcasts along."""

    @staticmethod
    def parse(text: str, paths: list[Path]) -> "Equation":
        ins, out = text.replace(" ", "").split("->")
        return Equation(tuple(zip(paths, ins.split(","))), out)

    def __str__(self) -> str:
        text = ",".join(s for _, s in self.factors) + "->" + self.out
        return text + (f" + {self.addend[1]}" if self.addend else "")


@dataclass(frozen=True)
class Family:
    """How one family of ops states what ``contract`` finds."""

    mismatch: str
    """Fallback reason: operands split on different letters (or segments)."""
    one_sided: str
    """Fallback reason: a summed letter split on some of the operands that carry it only."""
    summed_kind: str = "sharded"
    """Decision kind of a product summed over the split letter (g after it)."""
    kept_only: str | None = None
    """Letters the output may be split on (None: any, and a summed split is fine)."""
    restricted: str = ""
    """Fallback reason for any other split when ``kept_only`` is set."""
    split_addend: str = ""
    """Fallback reason: the addend itself is split."""


MATMUL = Family("matmul operands sharded on incompatible dims", "contraction dim sharded on one operand only",
                summed_kind="row", split_addend="bias or input split unlike the product")
"""mm, bmm, matmul, linear, addmm."""
EINSUM = Family("einsum operands split on different subscripts",
                "einsum summing over a subscript split on one operand only")
BADDBMM = Family(MATMUL.mismatch, MATMUL.one_sided, summed_kind="row", kept_only="b",
                 restricted="baddbmm with its product split on rows, columns or the contraction",
                 split_addend="baddbmm of a split input")
"""beta * input + alpha * (b1 @ b2) (ALiBi's scores): split on the batch only (the input sliced the
same way, or read whole where it broadcasts)."""

_BATCH = "abcdefghij"  # batch letters (never m, k or n)


def linear_equation(node: fx.Node, x_path: Path, w_path: Path, w_spec: str, bias_path: Path | None) -> Equation:
    """x (..., k) times a weight read as ``w_spec`` (``nk``, ``kn``, or ``ekn`` for stacked experts),
    plus a bias broadcast along the output (..., n)."""
    batch = _BATCH[:ndim(operand(node, x_path)) - 1]
    out = batch + "n"
    given = bias_path is not None and (bias_path[0] == "a" or bias_path[1] in node.kwargs)
    bias = operand(node, bias_path) if given else None
    addend = (bias_path, out[len(out) - ndim(bias):]) if isinstance(bias, fx.Node) else None
    return Equation(((x_path, batch + "k"), (w_path, w_spec)), out, addend)


def equation_of(node: fx.Node) -> Equation | str:
    """The equation of a matmul-family or einsum node, or why it has none (a fallback reason)."""
    target = node.target
    if target == aten.mm.default:
        return Equation(((("a", 0), "mk"), (("a", 1), "kn")), "mn")
    if target == aten.bmm.default:
        return Equation(((("a", 0), "bmk"), (("a", 1), "bkn")), "bmn")
    if target == aten.matmul.default:
        na, nb = ndim(node.args[0]), ndim(node.args[1])
        if na < 2 or nb < 2:
            return "1-D matmul"
        batch = _BATCH[:max(na, nb) - 2]
        a, b = batch[len(batch) - (na - 2):] + "mk", batch[len(batch) - (nb - 2):] + "kn"
        return Equation(((("a", 0), a), (("a", 1), b)), batch + "mn")
    if target == aten.linear.default:
        return linear_equation(node, ("a", 0), ("a", 1), "nk", arg_path(node, 2, "bias"))
    if target == aten.addmm.default:
        return linear_equation(node, ("a", 1), ("a", 2), "kn", ("a", 0))
    if target == aten.baddbmm.default:
        return Equation(((("a", 1), "bmk"), (("a", 2), "bkn")), "bmn", (("a", 0), "bmn"[3 - ndim(node.args[0]):]))
    if target == aten.einsum.default:
        text = node.args[0]
        if "..." in text or "->" not in text:
            return "einsum with an ellipsis or an implicit output"
        return Equation.parse(text, [("a", 1, i) for i in range(len(node.args[1]))])
    return f"no einsum equation for {target}"


def contract(ctx: Ctx, node: fx.Node, pl: Placements, eq: Equation, family: Family,
             override: dict | None = None) -> Decision:
    """The decision for ``node`` computing ``eq``, from its operands' placements (``override``:
    placements to use instead for some operands, by node: a weight as the linear will split it)."""
    override = override or {}
    place = lambda a: override.get(a, pl[a])  # noqa: E731
    factors = [(path, spec, operand(node, path)) for path, spec in eq.factors]
    shards = [(path, place(a)) for path, _, a in factors if isinstance(place(a), Shard)]
    addend = operand(node, eq.addend[0]) if eq.addend else None
    addend_split = addend is not None and isinstance(place(addend), Shard)
    if not shards:
        return fallback([(eq.addend[0], place(addend))], family.split_addend) if addend_split else Decision(R)
    letters = {(spec[place(a).dim], place(a).segments) for _, spec, a in factors if isinstance(place(a), Shard)}
    if len(letters) != 1:
        return fallback(shards, family.restricted if family.kept_only is not None else family.mismatch)
    (letter, segs), = letters
    if family.kept_only is not None and letter not in family.kept_only:
        return fallback(shards, family.restricted)
    if addend_split:
        pa = place(addend)
        if letter not in eq.out or eq.addend[1][pa.dim] != letter or pa.segments != segs:
            return fallback(shards + [(eq.addend[0], pa)], family.split_addend)
    scatter, copy = [], []
    for path, spec, a in factors + ([(eq.addend[0], eq.addend[1], addend)] if addend is not None else []):
        if isinstance(place(a), Shard):
            continue
        if letter in spec and shape(a)[spec.index(letter)] != 1:
            if letter not in eq.out:  # summed over: every factor carrying it must be split already
                return fallback(shards, family.one_sided)
            scatter.append((path, Shard(spec.index(letter), segs)))
        elif a.name in ctx.requires_grad and not (a is addend and letter not in eq.out):
            copy.append(path)  # read whole (or broadcast) by every rank: its gradient is partial
    if letter in eq.out:
        return Decision(Shard(eq.out.index(letter), segs, shards[0][1].origin), kind="sharded",
                        copy_in=tuple(copy), scatter_in=tuple(scatter))
    if addend is None:
        return Decision(R, kind=family.summed_kind, reduce_out=True, copy_in=tuple(copy))
    return _add_after_reduce(node, eq, shards, Decision(R, kind=family.summed_kind, reduce_out=True,
                                                        copy_in=tuple(copy)))


def _add_after_reduce(node: fx.Node, eq: Equation, shards, dec: Decision) -> Decision:
    """A product summed over the split letter, plus an addend: the op without its addend, g, then
    the addend once (linear; addmm with beta and alpha 1)."""
    if node.target == aten.linear.default:
        rewrite = Rewrite(aten.linear.default, (Operand(("a", 0)), Operand(("a", 1))), in_place=True)
    elif node.target == aten.addmm.default and arg(node, 3, "beta", 1) == 1 and arg(node, 4, "alpha", 1) == 1:
        rewrite = Rewrite(aten.mm.default, (Operand(("a", 1)), Operand(("a", 2))), in_place=True)
    else:
        return fallback(shards, f"{node.target} scaling a product summed over the split dim")
    return replace(dec, rewrite=rewrite, add_after_reduce=eq.addend[0])
