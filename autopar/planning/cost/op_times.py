"""How long kernels take: a roofline per Op, and the per-phase sums of the model's pieces.

A GEMM runs at ``peak * gemm_efficiency(M, N, K)`` unless its bytes take
longer at the achieved HBM rate (on a tuned profile: at the measured rate of the nearest shape,
``measured_gemm_rate``); every other kernel is bytes / achieved HBM
bandwidth; both pay a launch gap. A tensor-parallel all-reduce is a ring over
NVLink inside a node, flat or hierarchical across nodes (``network.py``); an expert-parallel
exchange is priced over the expert group's links (``network.ep_collective_time``). ``layer_times``
caches the forward and backward of one layer (dense, and mixture-of-experts), the embedding and
the LM head per (model, hardware, b, t, ep, cp). A context-parallel ring's transfers
(``CP_KINDS``) overlap the attention's block computations: ``phase_time`` counts only what they
leave exposed (``ring_costs.ring_exposed_time``), over ``network.cp_ring_link``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache

from autopar.core.collectives import ALL_GATHER, REDUCE_SCATTER
from autopar.planning.cost.hardware import Hardware, MeasuredGemm, MeasuredLayer
from autopar.planning.cost.models import ModelSpec
from autopar.planning.cost.network import (
    EP_KINDS,
    cp_ring_link,
    ep_collective_time,
    p2p_time,
    tp_allreduce_time,
    tp_half_time,
)
from autopar.planning.cost.op_costs import Op
from autopar.planning.cost.ring_costs import ring_exposed_time
from autopar.planning.cost.transformer import embedding_ops, head_ops, layer_ops, replay_ops
from autopar.planning.errors import PlanError

__all__ = ["GEMM_TILES", "tile_fill", "gemm_efficiency", "measured_gemm_rate", "op_time", "PhaseTime", "phase_time", "layer_times",
           "NODE_TOLERANCE", "measures_layer_of", "measured_this_layer", "measured_layer", "layer_scale",
           "measured_recompute", "measured_split",
           "CP_KINDS", "ring_hop_time"]

CP_KINDS: tuple[str, ...] = ("cp_ring", "cp_ring_grad")
"""Op kinds of ring attention's transfers (``transformer.py``): the key/value blocks, and the backward's
dK/dV accumulators; each Op's bytes are all its cp-1 hops'."""


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


def measured_gemm_rate(hw: Hardware, shape: tuple[int, int, int, int]) -> float:
    """FLOP/s of a GEMM (batch, M, N, K) on a tuned profile: the rate of the measured shape nearest to
    it, distance |log(batch M / batch' M')| + |log(N / N')| + |log(K / K')| (``autopar tune`` measures the
    shapes of the model it is given, so the planner's shapes at the tuned micro-batch and tensor-parallel
    degrees are found as measured)."""
    b, m, n, k = shape

    def distance(g: MeasuredGemm) -> float:
        return abs(math.log(b * m / (g.batch * g.m))) + abs(math.log(n / g.n)) + abs(math.log(k / g.k))

    return min(hw.gemms, key=distance).flops


def ring_hop_time(nbytes: float, hw: Hardware, t: int, cp: int) -> float:
    """One hop of a ring transfer whose cp-1 hops carry ``nbytes`` together, over ``cp_ring_link``."""
    if cp <= 1 or not nbytes:
        return 0.0
    return p2p_time(nbytes / (cp - 1), *cp_ring_link(hw, t, cp))


def op_time(op: Op, hw: Hardware, t: int = 1, ep: int = 1, cp: int = 1) -> float:
    """Seconds for one Op on one GPU of a tensor-parallel group of t, an expert group of ep and a
    context-parallel group of cp (roofline for GEMMs, bandwidth otherwise; a ring transfer's cp-1 hops
    end to end, none hidden: ``phase_time`` prices their overlap)."""
    e = hw.eff
    if op.kind == "gemm" and hw.gemms:  # a tuned profile: the measured rate, memory traffic included
        return op.flops / (measured_gemm_rate(hw, op.gemm) * e.gemm) + e.kernel_overhead
    if op.kind == "gemm":
        b, m, n, k = op.gemm
        compute = op.flops / (hw.peak_flops * gemm_efficiency(m, n, k, hw, b))
        return max(compute, op.bytes / (hw.hbm_bw * e.hbm)) + e.kernel_overhead
    if op.kind == "memory":
        return op.bytes / (hw.hbm_bw * e.hbm) + e.kernel_overhead
    if op.kind == "tp_allreduce":
        return tp_allreduce_time(op.bytes, t, hw)
    if op.kind in ("tp_reduce_scatter", "tp_allgather"):  # each half of an all-reduce
        return tp_half_time(op.bytes, t, hw, REDUCE_SCATTER if op.kind == "tp_reduce_scatter" else ALL_GATHER)
    if op.kind in EP_KINDS:
        return ep_collective_time(op.kind, op.bytes, ep, t, hw)
    if op.kind in CP_KINDS:
        return (cp - 1) * ring_hop_time(op.bytes, hw, t, cp)
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
    cp: float = 0.0
    """Context-parallel ring transfers, the part the attention's blocks leave exposed."""
    runtime: float = 0.0
    """The runtime's own overheads beside the kernels (a tuned profile's ``Hardware.runtime``): its
    graph nodes' calls and autograd bookkeeping, its actions, its checkpointed regions' replays."""

    @property
    def total(self) -> float:
        return self.gemm + self.memory + self.comm + self.ep + self.cp + self.runtime

    def __add__(self, o: PhaseTime) -> PhaseTime:
        return PhaseTime(self.gemm + o.gemm, self.memory + o.memory, self.comm + o.comm, self.ep + o.ep,
                         self.cp + o.cp, self.runtime + o.runtime)

    def __mul__(self, k: float) -> PhaseTime:
        return PhaseTime(self.gemm * k, self.memory * k, self.comm * k, self.ep * k, self.cp * k, self.runtime * k)


FORWARD_SHARE = 1 / 3
"""The forward's part of a graph node's overhead in a training step (``RuntimeOverheads.node_s`` is
forward and backward together): the backward runs about two ops per forward op (a GEMM's dA and dB,
an element-wise op's gradient and its accumulation)."""


def node_overheads(spec: ModelSpec, hw: Hardware) -> dict[str, PhaseTime]:
    """The runtime's per-node overhead of a layer's, the embedding's and the head's forward and backward
    (``layer_f`` ... ``head_b``) on a tuned profile that measured it, from the model's graph node counts
    (``ModelSpec.graph_nodes``; without them, the layer and ends of the tiny GPT the profile measured);
    zeros otherwise."""
    keys = ("layer_f", "layer_b", "emb_f", "emb_b", "head_f", "head_b")
    rt = hw.runtime
    if rt is None:
        return {k: PhaseTime() for k in keys}
    emb, layer, head = spec.graph_nodes or (0, rt.layer_nodes, rt.end_nodes)
    out = {}
    for name, nodes in (("layer", layer), ("emb", emb), ("head", head)):
        out[f"{name}_f"] = PhaseTime(runtime=rt.node_s * nodes * FORWARD_SHARE)
        out[f"{name}_b"] = PhaseTime(runtime=rt.node_s * nodes * (1 - FORWARD_SHARE))
    return out


def phase_time(ops: tuple[Op, ...], hw: Hardware, t: int, ep: int = 1, cp: int = 1,
               causal: bool = True) -> PhaseTime:
    """The Ops' seconds on one of t tensor-parallel GPUs (of an expert group of ep), summed by kind.
    A context-parallel ring's transfers (of a group of cp, ``causal`` or not) count what the phase's
    attention kernels (``Op.attention``), split into the ring's blocks, leave exposed
    (``ring_costs.ring_exposed_time``)."""
    g = m = c = x_ep = attention = 0.0
    ring = {kind: 0.0 for kind in CP_KINDS}
    for op in ops:
        if op.kind in CP_KINDS:
            ring[op.kind] += op.bytes
            continue
        x = op_time(op, hw, t, ep, cp)
        if op.attention:
            attention += x
        if op.kind == "gemm":
            g += x
        elif op.kind == "memory":
            m += x
        elif op.kind in EP_KINDS:
            x_ep += x
        else:
            c += x
    x_cp = 0.0
    if any(ring.values()):
        x_cp = ring_exposed_time(ring_hop_time(ring["cp_ring"], hw, t, cp), attention, cp, causal,
                                 ring_hop_time(ring["cp_ring_grad"], hw, t, cp))
    return PhaseTime(g, m, c, x_ep, x_cp)


NODE_TOLERANCE = 0.1
"""How far a measured layer's graph node count may be from the model's (a share of it): the same model
traced on the meta device (``autopar plan --hf-config``) can show a constant or two fewer than traced
with its weights (``autopar tune``, the engine), a node of another layer kind tens more."""


def measures_layer_of(signature: str, nodes: int, spec: ModelSpec) -> bool:
    """Whether a measurement of a layer of ``signature`` and ``nodes`` graph nodes (0: not known) is of
    ``spec``'s layer: the same ``ModelSpec.layer_signature``, node counts within ``NODE_TOLERANCE``."""
    ours = spec.graph_nodes[1] if spec.graph_nodes else 0
    return signature == spec.layer_signature and (not nodes or not ours
                                                  or abs(nodes - ours) <= NODE_TOLERANCE * max(nodes, ours))


def measured_this_layer(spec: ModelSpec, hw: Hardware) -> bool:
    """Whether ``autopar tune`` measured ``spec``'s own layer in ``hw`` (on autopar's eager chunks: a plan
    that prices them, op by op, uses it)."""
    return any(measures_layer_of(x.signature, x.nodes, spec) for x in hw.layers)


def measured_layer(spec: ModelSpec, hw: Hardware, b: int, t: int, sequence_parallel: bool = False,
                   fused: bool = False, cp: int = 1) -> MeasuredLayer | None:
    """The layer ``autopar tune`` measured for this model (``Hardware.layers``) that prices its layer at
    micro-batch b on one of t ranks: the same layer signature (``ModelSpec.layer_signature``) and graph
    node count where both are known, the same t and sequence parallelism, the nearest micro-batch; None
    when there is none, or for what the measurement did not run (fused kernels: a compiled chunk; context
    parallelism)."""
    if fused or cp > 1 or not hw.layers:
        return None
    sp = sequence_parallel and t > 1
    found = [x for x in hw.layers if measures_layer_of(x.signature, x.nodes, spec) and x.tp == t
             and x.sequence_parallel == sp]
    return min(found, key=lambda x: (abs(math.log(x.micro_batch / b)), x.micro_batch)) if found else None


@lru_cache(maxsize=8192)
def layer_scale(spec: ModelSpec, hw: Hardware, b: int, t: int, sequence_parallel: bool = False,
                fused: bool = False, cp: int = 1) -> float:
    """What a dense layer's priced forward and backward are multiplied by: the measured layer's seconds
    (``measured_layer``) over the priced layer's at its micro-batch (its kernels, graph nodes and
    tensor-parallel collectives, ``layer_times`` unscaled); 1 without a measured layer. A ratio carries
    to a micro-batch that was not measured better than a time does."""
    near = measured_layer(spec, hw, b, t, sequence_parallel, fused, cp)
    if near is None:
        return 1.0
    f, bw = _dense_layer(spec, hw, near.micro_batch, t, sequence_parallel, fused, cp)
    return near.seconds / (f.total + bw.total)


def measured_recompute(spec: ModelSpec, hw: Hardware, b: int, t: int, sequence_parallel: bool = False,
                       fused: bool = False, cp: int = 1) -> PhaseTime | None:
    """What recomputing one dense layer adds to its backward, from the layer ``autopar tune`` measured
    recomputed (``MeasuredLayer.recompute_seconds``, at this t or else at t = 1): the priced replay
    (``transformer.replay_ops``, a checkpointed region's bookkeeping and its nodes' forward share) scaled
    by measured over priced at the measured micro-batch and t. Measured at t = 1 only, the replay keeps
    t = 1's measured-over-priced relative to the layer's there, and takes the layer's own at this t
    (``layer_scale``: its collectives' waits included): r_1 / k_1 x k_t. None without one."""
    near = measured_layer(spec, hw, b, t, sequence_parallel, fused, cp)
    if near is None or hw.runtime is None:
        return None
    if not near.recompute_seconds:  # measured at t = 1 only: its ratio carries to t
        near = measured_layer(spec, hw, b, 1, False, fused, cp)
        if near is None or not near.recompute_seconds:
            return None
    region = PhaseTime(runtime=hw.runtime.checkpoint_s)
    priced = _replay(spec, hw, near.micro_batch, near.tp, near.sequence_parallel, fused, cp) + region
    here = _replay(spec, hw, b, t, sequence_parallel, fused, cp) + region
    ratio = near.recompute_seconds / priced.total
    if (near.tp, near.sequence_parallel) == (t, sequence_parallel):
        return here * ratio
    k_near = layer_scale(spec, hw, near.micro_batch, near.tp, near.sequence_parallel, fused, cp)
    return here * (ratio / k_near * layer_scale(spec, hw, b, t, sequence_parallel, fused, cp))


def _replay(spec: ModelSpec, hw: Hardware, b: int, t: int, sequence_parallel: bool, fused: bool,
            cp: int) -> PhaseTime:
    """A dense layer's priced replay: its ops (``replay_ops``) and its nodes' forward overhead."""
    return (phase_time(replay_ops(spec, b, t, sequence_parallel, fused, cp), hw, t, 1, cp, spec.causal)
            + node_overheads(spec, hw)["layer_f"])


def measured_split(spec: ModelSpec, hw: Hardware, b: int, t: int, sequence_parallel: bool = False,
                   fused: bool = False, cp: int = 1) -> float | None:
    """Seconds splitting one dense layer's backward into B and W adds (``MeasuredLayer.split_seconds``,
    measured at t = 1: autograd's bookkeeping, which tensor parallelism does not change), at the nearest
    measured micro-batch; None without one."""
    near = measured_layer(spec, hw, b, t, sequence_parallel, fused, cp)
    if near is None or not near.split_seconds:
        near = measured_layer(spec, hw, b, 1, False, fused, cp)
    return near.split_seconds if near is not None and near.split_seconds else None


def _dense_layer(spec: ModelSpec, hw: Hardware, b: int, t: int, sequence_parallel: bool, fused: bool,
                 cp: int) -> tuple[PhaseTime, PhaseTime]:
    """A dense layer's priced forward and backward: its Ops and its graph nodes' overhead."""
    lay = layer_ops(spec, b, t, sequence_parallel, fused, cp=cp)
    nodes = node_overheads(spec, hw)
    return (phase_time(lay.forward, hw, t, 1, cp, spec.causal) + nodes["layer_f"],
            phase_time(lay.backward, hw, t, 1, cp, spec.causal) + nodes["layer_b"])


@lru_cache(maxsize=8192)
def layer_times(spec: ModelSpec, hw: Hardware, b: int, t: int, sequence_parallel: bool = False,
                fused: bool = True, ep: int = 1, dispatch: str = "allgather", cp: int = 1) -> dict[str, PhaseTime]:
    """Forward and backward times of one layer (``layer_f``, ``layer_b``), the embedding
    (``emb_f``, ``emb_b``) and the LM head (``head_f``, ``head_b``) for micro-batch b at t,
    the layer's with or without sequence parallelism, its element-wise kernels fused or op by op;
    for a mixture-of-experts model also one of its expert layers (``moe_f``, ``moe_b``) on a rank
    of an expert group of ``ep`` exchanging rows by ``dispatch``; each on a rank of a context-parallel
    group of ``cp`` (s/cp tokens, ring attention). The dense layer's are scaled to the layer ``autopar
    tune`` measured for this model where the profile has one (``layer_scale``)."""
    emb, head = embedding_ops(spec, b, t, cp), head_ops(spec, b, t, cp)
    layer_f, layer_b = _dense_layer(spec, hw, b, t, sequence_parallel, fused, cp)
    k = layer_scale(spec, hw, b, t, sequence_parallel, fused, cp)

    def timed(ops: tuple[Op, ...], ep: int = 1) -> PhaseTime:
        return phase_time(ops, hw, t, ep, cp, spec.causal)

    nodes = node_overheads(spec, hw)
    out = {
        "layer_f": layer_f * k, "layer_b": layer_b * k,
        "emb_f": timed(emb.forward) + nodes["emb_f"], "emb_b": timed(emb.backward) + nodes["emb_b"],
        "head_f": timed(head.forward) + nodes["head_f"], "head_b": timed(head.backward) + nodes["head_b"],
    }
    if spec.is_moe:
        moe = layer_ops(spec, b, t, sequence_parallel, fused, moe=True, ep=ep, dispatch=dispatch, cp=cp)
        out["moe_f"] = timed(moe.forward, ep) + nodes["layer_f"]
        out["moe_b"] = timed(moe.backward, ep) + nodes["layer_b"]
    return out
