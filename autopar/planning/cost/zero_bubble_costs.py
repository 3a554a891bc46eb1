"""What the zero-bubble schedules (ZB-H1, ZB-V) cost: a backward split into B and W, their
pipeline's idle time, and what a microbatch keeps while it waits for its W.

The split follows the runtime's (``runtime/optim/split_backward.py``): W runs the weight-gradient
GEMMs (each linear's ``dB``, marked ``Op.weight_grad``: as many FLOPs as its ``dA``); B runs
everything else, the input-gradient GEMMs, attention's score and softmax backward, the
elementwise kernels, the norms' and the embedding's small weight gradients and every
tensor-parallel collective, and, with recomputation, the recomputed forward. So
``T_W = sum of the dB GEMMs`` and ``T_B = t_b - T_W`` with ``t_b`` the whole backward.

Idle time per stage (no schedule runs one chunk's actions faster than this; docs/schedules.md):

- ZB-H1: ``(p-1)(max(t_f + t_b - 2 t_w, t_f) + 2c)`` for ``t_w <= t_f``, the paper's
  ``(p-1)(T_F + T_B - T_W)``: exact against the simulator with ``c = 0``; with
  ``t_w > t_f`` the delayed W's outgrow the cool-down's gaps, which adds ``(p-1)(t_w - t_f)``,
  an upper bound (at most 14% over the simulated step on a random grid, tested);
- ZB-V: ``max(p-1, 2(2p-1-m))`` chunk slots of ``max(t_f, t_b - t_w, t_w) + 2c``, plus
  ``(p-1)(max - min)`` of the three: exact for ``t_f = t_b - t_w = t_w`` and ``c = 0`` (the
  generator's idle formula), otherwise an upper bound (tested on a random grid).

Where a bound is not exact, ``estimate(simulate=True)`` runs the schedule simulator instead.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

from autopar.core.config import SPLIT_BACKWARD_SCHEDULES
from autopar.planning.cost.hardware import Hardware
from autopar.planning.cost.models import ModelSpec
from autopar.planning.cost.op_costs import Op
from autopar.planning.cost.op_times import PhaseTime, phase_time
from autopar.planning.cost.transformer import head_ops, layer_ops
from autopar.planning.errors import PlanError
from autopar.schedules import in_flight_bound

__all__ = ["weight_grad_times", "weight_grad_kept_elements", "zero_bubble_idle", "Held", "held_bounds",
           "held_peak_bytes", "ZB_IDLE_FORMULAS"]

ZB_IDLE_FORMULAS: dict[str, str] = {
    "zb-h1": "(p-1)(max(t_F + t_B - 2 t_W, t_F) + 2c) + (p-1) max(0, t_W - t_F)",
    "zbv": "max(p-1, 2(2p-1-m)) (max(t_F, t_B - t_W, t_W) + 2c) + (p-1)(max - min of t_F, t_B - t_W, t_W)",
}
"""Each zero-bubble schedule's idle time per stage, as ``autopar plan --explain`` prints it
(``t_B`` the whole backward of a chunk, ``t_W`` its weight-gradient part, ``c`` one send)."""


def _weight_ops(ops: tuple[Op, ...]) -> tuple[Op, ...]:
    return tuple(op for op in ops if op.weight_grad)


@lru_cache(maxsize=4096)
def weight_grad_times(spec: ModelSpec, hw: Hardware, b: int, t: int,
                      sequence_parallel: bool = False, ep: int = 1,
                      dispatch: str = "allgather", cp: int = 1) -> dict[str, PhaseTime]:
    """The W part of one layer's backward (``layer_w``) and of the LM head's (``head_w``):
    their weight-gradient GEMMs, as ``op_times.layer_times`` prices them (on s/cp tokens under
    context parallelism; the ring's transfers are B's). The embedding's
    weight gradient (a scatter-add) runs in B, as in the runtime: it has no W part. A
    mixture-of-experts model adds its expert layer's (``moe_w``: router, shared and routed experts')."""
    layer = layer_ops(spec, b, t, sequence_parallel, cp=cp)
    head = head_ops(spec, b, t, cp)
    out = {"layer_w": phase_time(_weight_ops(layer.backward), hw, t),
           "head_w": phase_time(_weight_ops(head.backward), hw, t)}
    if spec.is_moe:
        moe = layer_ops(spec, b, t, sequence_parallel, moe=True, ep=ep, dispatch=dispatch, cp=cp)
        out["moe_w"] = phase_time(_weight_ops(moe.backward), hw, t, ep)
    return out


def weight_grad_kept_elements(ops: tuple[Op, ...]) -> float:
    """Elements a microbatch keeps between its B and its W for ``ops`` (a backward): each
    weight-gradient GEMM's inputs, dW (K, N) = X^T (K, M) dY (M, N): the layer input X and
    the gradient dY of its output."""
    total = 0.0
    for op in _weight_ops(ops):
        batch, k, n, m = op.gemm
        total += batch * (k * m + m * n)
    return total


def zero_bubble_idle(name: str, p: int, m: int, t_f: float, t_b: float, t_w: float,
                     c: float) -> tuple[float, bool]:
    """(idle seconds per stage, exact) of zero-bubble schedule ``name`` with per-chunk forward
    ``t_f``, whole backward ``t_b`` of which ``t_w`` is W, and ``c`` per send (the module's
    docstring). ``exact``: the simulator gives the same step with these costs and ``c = 0``;
    otherwise the idle time is an upper bound."""
    if name not in SPLIT_BACKWARD_SCHEDULES:
        raise PlanError(f"{name!r} is not a zero-bubble schedule ({', '.join(SPLIT_BACKWARD_SCHEDULES)})")
    if not 0.0 <= t_w <= t_b:
        raise PlanError(f"the weight-gradient part t_w={t_w} must lie in [0, t_b={t_b}]")
    if p == 1:
        return 0.0, True
    t_in = t_b - t_w  # B: the input gradient
    if name == "zb-h1":
        idle = (p - 1) * (max(t_f + t_in - t_w, t_f) + 2 * c) + (p - 1) * max(0.0, t_w - t_f)
        return idle, t_w <= t_f and c == 0
    hi, lo = max(t_f, t_in, t_w), min(t_f, t_in, t_w)
    idle = max(p - 1, 2 * (2 * p - 1 - m)) * (hi + 2 * c) + (p - 1) * (hi - lo)
    return idle, hi == lo and c == 0


@dataclass(frozen=True)
class Held:
    """(chunk, microbatch) activations one stage holds at most: all of them (F run, W not),
    those whose B has not run yet (they keep what the backward needs), and those whose B ran
    and whose W has not (they keep what ``weight_grad_kept_elements`` counts)."""

    total: int
    until_b: int
    awaiting_w: int


def held_bounds(name: str, p: int, v: int, m: int, stage: int) -> Held:
    """The most activations ``stage`` of schedule ``name`` holds, by what they wait for.

    ``total`` is ``in_flight_bound``. ZB-H1: ``min(p - r, m)`` until B (1F1B's) and at most
    ``min(r + 1, m)`` awaiting W (stage ``r`` delays its W's ``r`` rounds, plus the one whose B
    just ran); both exact for every stage (tested). ZB-V: every held activation may still wait for
    its B (``until_b = total``) and at most ``min(2r + 1, total)`` wait for their W, a bound
    (exact for ``m >= 2p - 1``; smaller microbatch counts hold fewer; tested). Other schedules run
    whole backwards: nothing awaits a W.
    """
    total = in_flight_bound(name, p, v, m, stage)
    if name == "zb-h1":
        return Held(total, min(p - stage, m), min(stage + 1, m))
    if name == "zbv":
        return Held(total, total, min(2 * stage + 1, total))
    return Held(total, total, 0)


def held_peak_bytes(held: Held, until_b_bytes: float, awaiting_w_bytes: float) -> float:
    """The most bytes ``held`` activations keep if one waiting for its B keeps ``until_b_bytes``
    and one waiting for its W ``awaiting_w_bytes``: the largest ``n_b * until_b_bytes + n_w *
    awaiting_w_bytes`` with ``n_b <= until_b``, ``n_w <= awaiting_w``, ``n_b + n_w <= total``.
    Conservative: the schedule may never reach that mix (it does for ZB-H1's stage 0)."""
    if until_b_bytes >= awaiting_w_bytes:
        n_b = min(held.until_b, held.total)
        n_w = min(held.awaiting_w, held.total - n_b)
    else:
        n_w = min(held.awaiting_w, held.total)
        n_b = min(held.until_b, held.total - n_w)
    return n_b * until_b_bytes + n_w * awaiting_w_bytes
