"""Communication times: ring collectives and point-to-point messages, and which link
(NVLink inside a node, the NICs across nodes) a group of the layout uses.

Ranks are laid out tensor-parallel fastest, then data-parallel, then pipeline:
a tensor-parallel group stays inside a node, a data-parallel group spans
nodes once d > GPUs per node / t, and adjacent pipeline stages are t d ranks
apart.
"""

from __future__ import annotations

from autopar.core.collectives import ALL_GATHER, ALL_REDUCE, wire_factor
from autopar.planning.hardware import Hardware

__all__ = ["intra_node_bw", "inter_node_bw", "allreduce_time", "allgather_time", "reduce_scatter_time", "p2p_time", "dp_link",
           "stage_link"]


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


def p2p_time(nbytes: float, bw: float, latency: float) -> float:
    """One point-to-point message."""
    return nbytes / bw + latency


def dp_link(hw: Hardware, t: int, d: int) -> tuple[float, float]:
    """(bytes/s, latency) of one data-parallel group's ring.

    Ranks are laid out tp fastest, then dp: a node holds k = G / t members of a
    DP group. If the whole group fits in a node it runs over NVLink; otherwise
    each ring crosses nodes through the group's k NICs (k x ib_bw), and NVLink
    is never the bottleneck.
    """
    G = hw.gpus_per_node
    k = max(1, G // t)
    if d <= k:
        return intra_node_bw(hw), hw.nvlink_latency
    return min(intra_node_bw(hw), k * inter_node_bw(hw)), hw.ib_latency


def stage_link(hw: Hardware, t: int, d: int) -> tuple[float, float]:
    """(bytes/s, latency) between adjacent pipeline stages: a pp peer is t*d ranks
    away, so it is on another node once t*d >= GPUs per node."""
    if t * d >= hw.gpus_per_node:
        return inter_node_bw(hw), hw.ib_latency
    return intra_node_bw(hw), hw.nvlink_latency
