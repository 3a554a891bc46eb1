"""How long kernels take: a roofline per Op, and the per-phase sums of the model's pieces.

A GEMM runs at ``peak * gemm_efficiency(M, N, K)`` unless its bytes take
longer at the achieved HBM rate; every other kernel is bytes / achieved HBM
bandwidth; both pay a launch gap. A tensor-parallel all-reduce is a ring over
NVLink inside a node, flat or hierarchical across nodes (``network.py``); an expert-parallel
exchange is priced over the expert group's links (``network.ep_collective_time``). ``layer_times``
caches the forward and backward of one layer (dense, and mixture-of-experts), the embedding and
the LM head per (model, hardware, b, t, ep).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache

from autopar.planning.cost.hardware import Hardware
from autopar.planning.cost.models import ModelSpec
from autopar.planning.cost.network import EP_KINDS, ep_collective_time, tp_allreduce_time, tp_half_time
from autopar.planning.cost.op_costs import Op
from autopar.planning.cost.transformer import embedding_ops, head_ops, layer_ops
from autopar.planning.errors import PlanError

__all__ = ["GEMM_TILES", "tile_fill", "gemm_efficiency", "op_time", "PhaseTime", "phase_time", "layer_times"]


GEMM_TILES: tuple[tuple[int, int], ...] = ((256, 128), (128, 256), (128, 128))
"""The CTA output tiles cuBLAS's large fp16 kernels offer, (rows, columns). Its heuristic picks,
per shape, the kernel that finishes first, which is the tile with the best wave fill: a
128x128 tile still loads 32 FMAs' worth per byte from L2 (tm tn / (2 (tm + tn))), above the
A100's 21.6 its tensor cores need (1024 FMA per clock per SM x 108 SMs over 5120 bytes per
clock of L2, NVIDIA A100 whitepaper), so on the profiles here the three run at the same
per-SM rate and only their fill differs."""


def tile_fill(m: int, n: int, hw: Hardware, batch: int = 1, tile: tuple[int, int] = (256, 128)) -> float:
    """The useful fraction of the SM-waves a GEMM with output (batch, M, N) runs in ``tile``s:
    batch M N / (waves * sm_count * tile area), padding of partial tiles and the idle SMs of
    the last wave wasted (wave quantisation)."""
    tm, tn = tile
    tiles = batch * math.ceil(m / tm) * math.ceil(n / tn)
    waves = math.ceil(tiles / hw.sm_count)
    return batch * m * n / (waves * hw.sm_count * tm * tn)


def gemm_efficiency(m: int, n: int, k: int, hw: Hardware, batch: int = 1) -> float:
    """Fraction of peak a GEMM (batch, M, N, K) reaches.

    eff = eff_gemm * fill * K / (K + K0), where
      - fill: the output is cut into tiles that run in waves of ``sm_count``; the
        last wave and the padding of partial tiles are wasted; the best of
        ``GEMM_TILES`` (cuBLAS picks its kernel per shape);
      - K / (K + K0): each tile pays a fixed prologue/epilogue worth K0 steps
        of its K loop (matters for the K = head_dim attention matmul).
    """
    fill = max(tile_fill(m, n, hw, batch, tile) for tile in GEMM_TILES)
    return hw.eff.gemm * fill * k / (k + hw.eff.gemm_k_overhead)


def op_time(op: Op, hw: Hardware, t: int = 1, ep: int = 1) -> float:
    """Seconds for one Op on one GPU of a tensor-parallel group of t and an expert group of ep
    (roofline for GEMMs, bandwidth otherwise)."""
    e = hw.eff
    if op.kind == "gemm":
        b, m, n, k = op.gemm
        compute = op.flops / (hw.peak_flops * gemm_efficiency(m, n, k, hw, b))
        return max(compute, op.bytes / (hw.hbm_bw * e.hbm)) + e.kernel_overhead
    if op.kind == "memory":
        return op.bytes / (hw.hbm_bw * e.hbm) + e.kernel_overhead
    if op.kind == "tp_allreduce":
        return tp_allreduce_time(op.bytes, t, hw)
    if op.kind in ("tp_reduce_scatter", "tp_allgather"):  # each half of an all-reduce
        return tp_half_time(op.bytes, t, hw)
    if op.kind in EP_KINDS:
        return ep_collective_time(op.kind, op.bytes, ep, t, hw)
    raise PlanError(f"unknown op kind {op.kind!r} for {op.name}")


@dataclass(frozen=True)
class PhaseTime:
    """Seconds of a list of Ops, by kind: GEMMs, memory-bound kernels, tensor-parallel all-reduces,
    expert-parallel row exchanges."""

    gemm: float = 0.0
    memory: float = 0.0
    comm: float = 0.0
    """Tensor-parallel collectives."""
    ep: float = 0.0
    """Expert-parallel exchanges (the routed rows and their counts, over the expert group)."""

    @property
    def total(self) -> float:
        return self.gemm + self.memory + self.comm + self.ep

    def __add__(self, o: PhaseTime) -> PhaseTime:
        return PhaseTime(self.gemm + o.gemm, self.memory + o.memory, self.comm + o.comm, self.ep + o.ep)

    def __mul__(self, k: float) -> PhaseTime:
        return PhaseTime(self.gemm * k, self.memory * k, self.comm * k, self.ep * k)


def phase_time(ops: tuple[Op, ...], hw: Hardware, t: int, ep: int = 1) -> PhaseTime:
    """The Ops' seconds on one of t tensor-parallel GPUs (of an expert group of ep), summed by kind."""
    g = m = c = x_ep = 0.0
    for op in ops:
        x = op_time(op, hw, t, ep)
        if op.kind == "gemm":
            g += x
        elif op.kind == "memory":
            m += x
        elif op.kind in EP_KINDS:
            x_ep += x
        else:
            c += x
    return PhaseTime(g, m, c, x_ep)


@lru_cache(maxsize=8192)
def layer_times(spec: ModelSpec, hw: Hardware, b: int, t: int, sequence_parallel: bool = False,
                fused: bool = True, ep: int = 1, dispatch: str = "allgather") -> dict[str, PhaseTime]:
    """Forward and backward times of one layer (``layer_f``, ``layer_b``), the embedding
    (``emb_f``, ``emb_b``) and the LM head (``head_f``, ``head_b``) for micro-batch b at t,
    the layer's with or without sequence parallelism, its element-wise kernels fused or op by op;
    for a mixture-of-experts model also one of its expert layers (``moe_f``, ``moe_b``) on a rank
    of an expert group of ``ep`` exchanging rows by ``dispatch``."""
    lay, emb, head = layer_ops(spec, b, t, sequence_parallel, fused), embedding_ops(spec, b, t), head_ops(spec, b, t)
    out = {
        "layer_f": phase_time(lay.forward, hw, t), "layer_b": phase_time(lay.backward, hw, t),
        "emb_f": phase_time(emb.forward, hw, t), "emb_b": phase_time(emb.backward, hw, t),
        "head_f": phase_time(head.forward, hw, t), "head_b": phase_time(head.backward, hw, t),
    }
    if spec.is_moe:
        moe = layer_ops(spec, b, t, sequence_parallel, fused, moe=True, ep=ep, dispatch=dispatch)
        out["moe_f"], out["moe_b"] = phase_time(moe.forward, hw, t, ep), phase_time(moe.backward, hw, t, ep)
    return out
