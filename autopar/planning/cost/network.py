"""Communication times: ring collectives and point-to-point messages, and which link
(NVLink inside a node, the NICs across nodes) a group of the layout uses.

Ranks are laid out tensor-parallel fastest, then data-parallel, then pipeline:
a tensor-parallel group stays inside a node while t divides the GPUs of a node
and spans t / G whole nodes beyond (``tp_allreduce_time``), a data-parallel
group spans nodes once d > GPUs per node / t, and adjacent pipeline stages are
t d ranks apart (``stage_link``). An expert group (``Layout.ep``) is ep consecutive
data-parallel replicas, ranks t apart: its collectives use the links a data-parallel group of
ep would (``ep_collective_time``); the replicas holding the same experts are t ep ranks apart
(``dp_link(hw, t * ep, d / ep)``). A context-parallel group (``Layout.cp``) sits between the
tensor- and the data-parallel one: cp ranks t apart, inside a node while t cp <= G
(``cp_ring_link``); the data-parallel peers are then t cp ranks apart, and the d cp ranks
reducing the same gradients form one group of ranks t apart (``dp_link(hw, t, d * cp)``).

A tuned profile (``Hardware.links``, measured by ``autopar tune``) replaces the links' data-sheet
figures by what its collectives measured: each function here then prices a call with the fit of
its op over its group size and placement, time = alpha + nbytes / beta (``measured_link``), and a
group the profile did not measure is refused (``ProfileCoverageError``, naming the command that
measures it). The ring formulas' (bandwidth, per-step latency) a caller gets from ``dp_link``,
``stage_link`` and ``cp_ring_link`` are then the fit's, rewritten so that the formula gives the fit's time
back (``_as_ring``).
"""

from __future__ import annotations

import math
from dataclasses import replace

from autopar.core.collectives import ALL_GATHER, ALL_REDUCE, REDUCE_SCATTER, wire_factor
from autopar.planning.cost.hardware import Hardware, MeasuredLink
from autopar.planning.errors import ProfileCoverageError

__all__ = ["intra_node_bw", "inter_node_bw", "allreduce_time", "allgather_time", "reduce_scatter_time", "p2p_time", "dp_link",
           "stage_link", "tp_allreduce_time", "tp_half_time", "flat_ring_allreduce_time",
           "hierarchical_allreduce_time", "alltoall_time", "ep_collective_time", "EP_KINDS", "cp_ring_link",
           "measured_link", "embedding_link", "RING_OPS"]

RING_OPS: dict[str, str] = {ALL_REDUCE: "all_reduce", ALL_GATHER: "all_gather", REDUCE_SCATTER: "reduce_scatter"}
"""The collective registry's kinds -> the names a tuned profile's links use."""


def measured_link(hw: Hardware, op: str, ranks: int, inter: bool) -> MeasuredLink | None:
    """The profile's fit of ``op`` over ``ranks`` ranks placed inside a node or across nodes (its
    bandwidth scaled as ``nvlink_bw`` / ``ib_bw`` were since it was measured); None for a preset,
    which measured nothing. A group the profile lacks is a ``ProfileCoverageError`` that says
    which groups it has and how to measure the missing one (a profile tuned in one process has none)."""
    if not hw.tuned:
        return None
    placement = "inter" if inter else "intra"
    for link in hw.links:
        if link.op == op and link.ranks == ranks and link.placement == placement:
            return replace(link, beta=link.beta * _link_scale(hw, inter))
    raise ProfileCoverageError(_coverage_message(hw, op, ranks, inter))


def _link_scale(hw: Hardware, inter: bool) -> float:
    now, then = (hw.ib_bw, hw.links_measured_at[1]) if inter else (hw.nvlink_bw, hw.links_measured_at[0])
    return now / then if then > 0 else 1.0


def _coverage_message(hw: Hardware, op: str, ranks: int, inter: bool) -> str:
    had = sorted({(link.ranks, link.placement) for link in hw.links if link.op == op})
    where = "across nodes" if inter else "inside one node"
    measured = ", ".join(f"{n} ranks {pl}-node" for n, pl in had) or "none"
    G = hw.gpus_per_node
    flags = hw.tune_command or "--model <the model>"
    if inter:
        how = (f"measure it across nodes: `torchrun --nnodes {max(2, math.ceil(ranks / G))} --nproc-per-node {G} "
               f"-m autopar.cli tune {flags}` (a layout puts a group across nodes once it outgrows a node's {G} "
               f"devices; on one bigger node run `autopar tune --nproc {ranks} {flags}` there instead)")
    else:
        how = f"measure it on one node: `autopar tune --nproc {ranks} {flags}`"
    return (f"hardware profile {hw.name!r} has no {op} over {ranks} ranks {where}, which this layout needs "
            f"(it measured {op} over: {measured}); {how}")


def _as_ring(link: MeasuredLink, op: str, n: int) -> tuple[float, float]:
    """(bus bandwidth, per-step latency) that make the ring formula of ``op`` over n ranks
    (wire factor x nbytes / bw + steps x latency) equal the fit alpha + nbytes / beta."""
    steps = 2 * (n - 1) if op == ALL_REDUCE else n - 1
    return wire_factor(op, n) * link.beta, link.alpha / steps


def intra_node_bw(hw: Hardware) -> float:
    """NCCL bus bandwidth over NVLink, bytes/s (line rate x measured efficiency)."""
    return hw.nvlink_bw * hw.nvlink_efficiency


def inter_node_bw(hw: Hardware) -> float:
    """NCCL bus bandwidth of one NIC, bytes/s (line rate x measured efficiency)."""
    return hw.ib_bw * hw.ib_efficiency


def allreduce_time(nbytes: float, n: int, bw: float, latency: float) -> float:
    """Ring all-reduce of ``nbytes`` over n ranks: 2 (n-1)/n * bytes / bw + 2 (n-1) latency
    (the wire factor is the collective registry's, ``autopar.core.collectives.wire_factor``)."""
    if n <= 1:
        return 0.0
    return wire_factor(ALL_REDUCE, n) * nbytes / bw + 2 * (n - 1) * latency


def allgather_time(nbytes: float, n: int, bw: float, latency: float) -> float:
    """Ring all-gather of a tensor of ``nbytes`` in total: (n-1)/n * bytes / bw + (n-1) latency."""
    if n <= 1:
        return 0.0
    return wire_factor(ALL_GATHER, n) * nbytes / bw + (n - 1) * latency


def reduce_scatter_time(nbytes: float, n: int, bw: float, latency: float) -> float:
    """Ring reduce-scatter of a tensor of ``nbytes`` in total: the first half of a ring all-reduce,
    priced as an all-gather of the same tensor ((n-1)/n * bytes / bw + (n-1) latency)."""
    return allgather_time(nbytes, n, bw, latency)


def alltoall_time(nbytes: float, n: int, hw: Hardware, t: int = 1) -> float:
    """An all-to-all over n ranks, t apart (an expert group), in which each rank sends 1/n of its
    ``nbytes`` to each peer (keeping its own 1/n): (n-1)/n of them leave the rank.

    A node holds k = min(n, G/t) members of the group: the k-1 peers in the node are reached over
    NVLink, the n-k others through the rank's own NIC (one per GPU, the t ranks of a node's
    tensor-parallel groups running their own exchanges on their own NICs), both at once:
    max((k-1)/n bytes / NVLink bus bandwidth, (n-k)/n bytes / NIC bandwidth), plus n-1 steps of
    latency (pairwise exchange). A tuned profile: its measured all-to-all over n ranks."""
    if n <= 1:
        return 0.0
    k = min(n, max(1, hw.gpus_per_node // t))
    if (link := measured_link(hw, "all_to_all", n, n > k)) is not None:
        return link.time(nbytes)
    inside = (k - 1) / n * nbytes / intra_node_bw(hw)
    across = (n - k) / n * nbytes / inter_node_bw(hw)
    return max(inside, across) + (n - 1) * (hw.ib_latency if n > k else hw.nvlink_latency)


EP_KINDS: tuple[str, ...] = ("ep_allgather", "ep_reduce_scatter", "ep_alltoall")
"""Op kinds of expert parallelism's token exchange (``transformer.py``), priced over the expert group."""


def ep_collective_time(kind: str, nbytes: float, ep: int, t: int, hw: Hardware) -> float:
    """An expert group's collective: ``ep_allgather`` / ``ep_reduce_scatter`` of a tensor of
    ``nbytes`` in total (ring, over the links of a data-parallel group of ep: ``dp_link``), or
    ``ep_alltoall`` of ``nbytes`` held by each rank (``alltoall_time``)."""
    if ep <= 1:
        return 0.0
    if kind == "ep_alltoall":
        return alltoall_time(nbytes, ep, hw, t)
    bw, lat = dp_link(hw, t, ep, ALL_GATHER if kind == "ep_allgather" else REDUCE_SCATTER)
    return allgather_time(nbytes, ep, bw, lat)


def p2p_time(nbytes: float, bw: float, latency: float) -> float:
    """One point-to-point message."""
    return nbytes / bw + latency


def flat_ring_allreduce_time(nbytes: float, n: int, hw: Hardware) -> float:
    """One ring over n ranks that span n / G whole nodes, as NCCL builds it: G rings (channels),
    each carrying 1/G of the tensor and leaving each node through its own NIC, so a node's G
    NICs carry the inter-node hops in parallel. Every step of a ring waits for its slowest hop:
    bus bandwidth min(NVLink, G NICs), and each of the 2 (n-1) steps pays the InfiniBand latency.
    """
    bw = min(intra_node_bw(hw), hw.gpus_per_node * inter_node_bw(hw))
    return allreduce_time(nbytes, n, bw, hw.ib_latency)


def hierarchical_allreduce_time(nbytes: float, n: int, hw: Hardware) -> float:
    """The two-level all-reduce over n ranks on N = n / G nodes (Jia et al. 2018, "Highly Scalable
    Deep Learning Training System with Mixed-Precision", section 3.3; Horovod's and NCCL's tree
    variants do the same): a reduce-scatter inside each node over NVLink (each GPU then holds
    1/G of the sum of its node), an all-reduce of that 1/G across the N nodes, each GPU through
    its own NIC, and an all-gather inside the node. The three run one after the other."""
    G = hw.gpus_per_node
    inside = allgather_time(nbytes, G, intra_node_bw(hw), hw.nvlink_latency)
    across = allreduce_time(nbytes / G, n // G, inter_node_bw(hw), hw.ib_latency)
    return 2 * inside + across


def tp_allreduce_time(nbytes: float, t: int, hw: Hardware) -> float:
    """A tensor-parallel all-reduce of ``nbytes`` over t ranks: a ring over NVLink while t
    divides the GPUs of a node; across nodes the faster of the flat ring and the hierarchical
    all-reduce (NCCL's tuner picks, per call, the algorithm its own cost model says is fastest).
    The flat ring wins for large tensors at a few nodes (all links busy at once); the
    hierarchical one when the NICs are the bottleneck or latency dominates (2 (N-1) slow steps
    instead of 2 (t-1)). A tuned profile: the measured all-reduce over t ranks (the runtime's own,
    ``tp_all_reduce``, where measured), its latency the one measured inside a step at t = 2
    (``RuntimeOverheads.tp_collective_s``) where the profile has it."""
    if t > 1 and (link := _tp_reduce_link(hw, t)) is not None:
        return _in_step(hw, t, link, nbytes)
    if t <= hw.gpus_per_node:
        return allreduce_time(nbytes, t, intra_node_bw(hw), hw.nvlink_latency)
    return min(flat_ring_allreduce_time(nbytes, t, hw), hierarchical_allreduce_time(nbytes, t, hw))


def _in_step(hw: Hardware, t: int, link: MeasuredLink, nbytes: float) -> float:
    """A tensor-parallel collective of ``nbytes`` priced by ``link``: its latency the one a step sees
    (``RuntimeOverheads.tp_collective_s``, measured on a t = 2 engine: the peer's late arrival and the
    wake-up beside the exchange) where the profile has it for this t, else the lone call's alpha."""
    if hw.runtime is not None and hw.runtime.tp_collective_s > 0 and t == 2:
        return hw.runtime.tp_collective_s + nbytes / link.beta
    return link.time(nbytes)


def _tp_reduce_link(hw: Hardware, t: int) -> MeasuredLink | None:
    """The tuned profile's fit of the runtime's own tensor-parallel all-reduce over t ranks
    (``tp_all_reduce``) when it measured it, else of ``dist.all_reduce``; None for a preset."""
    inter = t > hw.gpus_per_node
    if hw.tuned and any(x.op == "tp_all_reduce" and x.ranks == t for x in hw.links):
        return measured_link(hw, "tp_all_reduce", t, inter)
    return measured_link(hw, "all_reduce", t, inter)


def tp_half_time(nbytes: float, t: int, hw: Hardware, kind: str = ALL_GATHER) -> float:
    """A tensor-parallel reduce-scatter or all-gather (``kind``) of a tensor of ``nbytes`` (sequence
    parallelism, scatter/gather sends): half of ``tp_allreduce_time``'s bytes and steps; a tuned
    profile: the measured ``kind`` over t ranks, its latency the one a step sees where measured."""
    if t > 1 and (link := measured_link(hw, RING_OPS[kind], t, t > hw.gpus_per_node)) is not None:
        return _in_step(hw, t, link, nbytes)
    if t <= hw.gpus_per_node:
        return allgather_time(nbytes, t, intra_node_bw(hw), hw.nvlink_latency)
    return tp_allreduce_time(nbytes, t, hw) / 2


def dp_link(hw: Hardware, t: int, d: int, kind: str = ALL_REDUCE) -> tuple[float, float]:
    """(bytes/s, latency) of one data-parallel group's ring, for a ``kind`` collective.

    Ranks are laid out tp fastest, then dp: a node holds k = G / t members of a
    DP group. If the whole group fits in a node it runs over NVLink; otherwise
    each ring crosses nodes through the group's k NICs (k x ib_bw), and NVLink
    is never the bottleneck. A tuned profile: the measured ``kind`` over d ranks, as a ring's
    (bandwidth, latency) (``_as_ring``).
    """
    G = hw.gpus_per_node
    k = max(1, G // t)
    if d > 1 and (link := measured_link(hw, RING_OPS[kind], d, d > k)) is not None:
        return _as_ring(link, kind, d)
    if d <= k:
        return intra_node_bw(hw), hw.nvlink_latency
    return min(intra_node_bw(hw), k * inter_node_bw(hw)), hw.ib_latency


def stage_link(hw: Hardware, t: int, d: int, p: int = 2) -> tuple[float, float]:
    """(bytes/s, latency) of the slowest link between adjacent pipeline stages.

    A pp peer is t d ranks away: on another node once t d >= GPUs per node. With
    t d < G several stages share a node, but a pipeline of t d p > G ranks still
    crosses a node boundary between some stages, and with sends that block their
    sender (Megatron-LM 2021) every stage waits, in the steady state, for the
    slowest boundary: the pipeline is paced by the InfiniBand hop. A tuned profile: its measured
    point-to-point message inside or across nodes."""
    if (link := measured_link(hw, "p2p", 2, t * d * p > hw.gpus_per_node)) is not None:
        return link.beta, link.alpha
    if t * d * p > hw.gpus_per_node:
        return inter_node_bw(hw), hw.ib_latency
    return intra_node_bw(hw), hw.nvlink_latency


def cp_ring_link(hw: Hardware, t: int, cp: int) -> tuple[float, float]:
    """(bytes/s, latency) of one hop of a context-parallel ring: cp ranks t apart, so the ring stays
    inside a node while t cp <= G (NVLink); beyond, some hops cross nodes, each through the sending
    rank's own NIC (the t rings of a node's tensor-parallel ranks cross on t different NICs), and
    every step of the ring waits for its slowest hop. A tuned profile: its measured point-to-point
    message inside or across nodes."""
    if (link := measured_link(hw, "p2p", 2, t * cp > hw.gpus_per_node)) is not None:
        return link.beta, link.alpha
    if t * cp <= hw.gpus_per_node:
        return intra_node_bw(hw), hw.nvlink_latency
    return inter_node_bw(hw), hw.ib_latency


def embedding_link(hw: Hardware, t: int, d: int, p: int) -> tuple[float, float]:
    """(bytes/s, latency) of the tied embedding's gradient all-reduce between the first and the last
    stage: across nodes (a NIC) on the data sheet; a tuned profile: its measured all-reduce over 2
    ranks, placed as the pipeline's stages are (``stage_link``), as a ring's (bandwidth, latency)."""
    if (link := measured_link(hw, "all_reduce", 2, t * d * p > hw.gpus_per_node)) is not None:
        return _as_ring(link, ALL_REDUCE, 2)
    return inter_node_bw(hw), hw.ib_latency
