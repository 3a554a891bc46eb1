"""The paper's closed-form formulas as sympy expressions (``FORMULAS``; a mixture-of-experts
model's in ``MOE_FORMULAS``), and ``explain``: each one with a layout's numbers substituted, for
``autopar plan --explain``.

Only this module of the performance model needs sympy.
"""

from __future__ import annotations

from dataclasses import dataclass

import sympy as sp

from autopar.core.config import Recompute
from autopar.planning.cost.step_estimate import Estimate
from autopar.planning.cost.zero_bubble_costs import ZB_IDLE_FORMULAS, zero_bubble_idle

__all__ = ["FORMULAS", "MOE_FORMULAS", "Explained", "explain"]


_sym = sp.symbols("B s l h V a t p d v m b n c T_F T_B T_pipe T_dp T_opt T_iter F", positive=True)
B_, s_, l_, h_, V_, a_, t_, p_, d_, v_, m_, b_, n_, c_, TF_, TB_, TP_, TDP_, TOPT_, TIT_, F_ = _sym

_P_EXPR = 12 * l_ * h_**2 * (1 + sp.Rational(13, 12) / h_ + (V_ + s_) / (12 * l_ * h_))

FORMULAS: dict[str, tuple[str, sp.Expr]] = {
    "P": ("parameters", _P_EXPR),
    "F": ("FLOPs per iteration, layer (the paper's full) recomputation (72 instead of 96 without)",
          96 * B_ * s_ * l_ * h_**2 * (1 + s_ / (6 * h_) + V_ / (16 * l_ * h_))),
    "m": ("microbatches per pipeline", B_ / (d_ * b_)),
    "bubble": ("pipeline bubble fraction (uniform chunks)", (p_ - 1) / (v_ * m_)),
    "tp_volume": ("TP all-reduce elements per layer per microbatch per GPU", 8 * b_ * s_ * h_ * (t_ - 1) / t_),
    "p2p_volume": ("elements per stage-to-stage send (scatter/gather)", b_ * s_ * h_ / t_),
    "T_pipe": ("pipeline time, closed form (c: one send)", (m_ * v_ + p_ - 1) * (TF_ + TB_ + 2 * c_)),
    "T_iter": ("iteration time (pipeline as simulated)", TP_ + TDP_ + TOPT_),
    "state": ("model-state bytes per GPU, mixed-precision Adam (approx.)", 16 * _P_EXPR / (t_ * p_)),
    "act_layer": ("activation bytes of one layer without recomputation",
                  s_ * b_ * h_ * (10 + 24 / t_ + 5 * a_ * s_ / (h_ * t_))),
    "act_layer_sp": ("the same with sequence parallelism (norms, dropout, residual on s/t tokens)",
                     s_ * b_ * h_ * (34 + 5 * a_ * s_ / h_) / t_),
    "act_ckpt": ("bytes a recomputed layer keeps (its input; /t with sequence parallelism)", 2 * s_ * b_ * h_),
    "act_ckpt_sp": ("the same with sequence parallelism", 2 * s_ * b_ * h_ / t_),
    "state_distopt": ("model-state bytes per GPU with the distributed optimizer (optimizer state / d)",
                      (2 + 2 + 12 / d_) * _P_EXPR / (t_ * p_)),
    "T_dp_distopt": ("distributed optimizer: reduce-scatter + all-gather elements per GPU (= the all-reduce's)",
                     2 * (d_ - 1) / d_ * _P_EXPR / (t_ * p_)),
    "X": ("TFLOP/s per GPU", F_ / (TIT_ * n_)),
}
_E, _k, _fe, _ep, _g = sp.symbols("E k f_e ep g", positive=True)
_S = _k * b_ * s_

MOE_FORMULAS: dict[str, tuple[str, sp.Expr]] = {
    "P_experts": ("routed-expert parameters per GPU per expert layer: E/ep experts of g h f_e each "
                  "(g = 3 gated, 2 plain), split t ways", _E / _ep * _g * h_ * _fe / t_),
    "S": ("rows a GPU sends per expert layer per microbatch (each token once per chosen expert)", _S),
    "expert_flops": ("expert GEMM FLOPs per GPU per expert layer, forward: its E/ep experts' share S of the "
                     "group's ep S rows", 2 * _g * _S * h_ * _fe / t_),
    "ep_ag_volume": ("'allgather' dispatch: elements each GPU puts on the wire per expert layer, forward "
                     "(all-gather + reduce-scatter of ep S rows of h; the backward the same)",
                     2 * (_ep - 1) * _S * h_),
    "ep_a2a_volume": ("'alltoall' dispatch: the same, (ep-1)/ep of S rows out and back (plus ep E counts)",
                      2 * (_ep - 1) / _ep * _S * h_),
    "expert_rows_held": ("rows of the grouped GEMMs' tensors per GPU: ep S with 'allgather', S with "
                         "'alltoall'", sp.Symbol("R", positive=True)),
}
"""A mixture-of-experts model's formulas, added to ``FORMULAS`` by ``explain``."""

_UNITS = {"P": "", "F": "FLOP", "m": "", "bubble": "", "tp_volume": "elements", "p2p_volume": "elements",
          "T_pipe": "s", "T_iter": "s", "state": "B", "act_layer": "B", "X": "TFLOP/s",
          "act_layer_sp": "B", "act_ckpt": "B", "act_ckpt_sp": "B", "state_distopt": "B", "T_dp_distopt": "elements",
          "P_experts": "", "S": "rows", "expert_flops": "FLOP", "ep_ag_volume": "elements",
          "ep_a2a_volume": "elements", "expert_rows_held": "rows"}


@dataclass(frozen=True)
class Explained:
    key: str
    description: str
    expr: sp.Expr
    value: float
    unit: str = ""


def explain(est: Estimate) -> list[Explained]:
    """Every formula of ``FORMULAS`` with this layout's numbers substituted, plus
    the simulated bubble when the estimate ran the schedule."""
    spec, lay, cl = est.spec, est.layout, est.cluster
    subs = {B_: cl.global_batch, s_: spec.seq_len, l_: spec.layers, h_: spec.hidden, V_: spec.vocab,
            a_: spec.heads, t_: lay.t, p_: lay.p, d_: lay.d, v_: lay.v, b_: lay.b, m_: est.m,
            n_: cl.gpus, c_: est.t_p2p, TF_: est.t_chunk_f, TB_: est.t_chunk_b,
            TP_: est.t_pipeline, TDP_: est.t_dp_exposed + est.t_emb_sync, TOPT_: est.t_optimizer,
            TIT_: est.t_iter, F_: est.flops}
    out = []
    for key, (desc, expr) in FORMULAS.items():
        if key == "F" and lay.recompute is not Recompute.LAYER:
            expr = 72 * B_ * s_ * l_ * h_**2 * (1 + s_ / (6 * h_) + V_ / (12 * l_ * h_))
        val = float(expr.subs(subs))
        if key == "X":
            val /= 1e12
        out.append(Explained(key, desc, expr, val, _UNITS[key]))
    if spec.is_moe:
        subs |= {_E: spec.experts, _k: spec.top_k, _fe: spec.expert_ffn_size, _ep: lay.ep,
                 _g: 3 if spec.gated_mlp else 2}
        held = lay.ep if lay.ep > 1 and lay.expert_dispatch == "allgather" else 1
        for key, (desc, expr) in MOE_FORMULAS.items():
            if key == "expert_rows_held":
                expr = held * _S
            out.append(Explained(key, desc, expr, float(expr.subs(subs)), _UNITS[key]))
    if lay.schedule in ZB_IDLE_FORMULAS and lay.p > 1:
        out.insert(4, _zero_bubble_idle(est))
    if est.sim is not None:
        idle, busy = sp.symbols("idle busy", positive=True)
        out.insert(4, Explained("bubble_sim", "bubble as simulated (idle / compute, worst stage; "
                                "includes the LM head's imbalance)", idle / busy, est.bubble))
    return out


def _zero_bubble_idle(est: Estimate) -> Explained:
    """The zero-bubble schedule's idle time per stage (``zero_bubble_costs.ZB_IDLE_FORMULAS``)
    with the layout's chunk times, in seconds; the bubble fraction is it over m v (t_F + t_B)."""
    lay = est.layout
    idle, exact = zero_bubble_idle(lay.schedule, lay.p, est.m, est.t_chunk_f, est.t_chunk_b, est.t_chunk_w,
                                   est.t_p2p)
    formula = ZB_IDLE_FORMULAS[lay.schedule]
    how = "exact" if exact else "an upper bound; the simulated bubble below is the schedule's"
    desc = (f"{lay.schedule} idle time per stage, {formula} (t_W = {est.t_chunk_w * 1e3:.3g} ms of "
            f"t_B = {est.t_chunk_b * 1e3:.3g} ms: the weight-gradient GEMMs; {how})")
    return Explained("idle_zb", desc, sp.Symbol("T_idle_zb", positive=True), idle, "s")
