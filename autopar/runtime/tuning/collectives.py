"""Timing collectives over a group of ranks, and point-to-point messages between two.

Every rank of the world calls ``time_group`` for every group (``dist.new_group`` is collective), the
members time their op at each size and the others only wait at the closing barrier. A size's time is
the median of ``rounds`` rounds, each a barrier then ``calls`` back-to-back calls (the mean per call);
a point-to-point message's is half a round trip (the sender sends, the receiver sends the tensor back).

Byte counts follow the network model (``planning.cost.network``): an all-reduce's tensor, an all-gather's
whole output, a reduce-scatter's whole input, what each rank holds before an all-to-all, one message.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import torch
import torch.distributed as dist

from autopar.runtime.tuning.compute import sync

__all__ = ["COLLECTIVES", "time_group", "time_pair"]


def _all_reduce(x: torch.Tensor, pg, n: int) -> Callable[[], object]:
    return lambda: dist.all_reduce(x, group=pg)


def _all_gather(x: torch.Tensor, pg, n: int) -> Callable[[], object]:
    part = x[: x.numel() // n]
    return lambda: dist.all_gather_single(x, part, group=pg)


def _reduce_scatter(x: torch.Tensor, pg, n: int) -> Callable[[], object]:
    out = torch.empty(x.numel() // n, device=x.device, dtype=x.dtype)
    return lambda: dist.reduce_scatter_single(out, x, group=pg)


def _all_to_all(x: torch.Tensor, pg, n: int) -> Callable[[], object]:
    out = torch.empty_like(x)
    return lambda: dist.all_to_all_single(out, x, group=pg)


def _tp_all_reduce(x: torch.Tensor, pg, n: int) -> Callable[[], object]:
    """The runtime's tensor-parallel all-reduce (``core.comm.group.all_reduce``), as the layers call it."""
    from autopar.core.comm.group import TPGroup, all_reduce  # noqa: PLC0415

    group = TPGroup.of(pg, tuple(dist.get_process_group_ranks(pg)))
    return lambda: all_reduce(x, group)


COLLECTIVES: dict[str, Callable] = {"all_reduce": _all_reduce, "all_gather": _all_gather,
                                    "reduce_scatter": _reduce_scatter, "all_to_all": _all_to_all,
                                    "tp_all_reduce": _tp_all_reduce}
"""Profile op name -> a maker of one call of it on a buffer of the size's bytes."""


def _elements(nbytes: int, n: int) -> int:
    """fp32 elements of a buffer of about ``nbytes``, a multiple of n (the ranks' equal parts)."""
    return max(n, (nbytes // 4) // n * n)


def time_group(ops: tuple[str, ...], ranks: tuple[int, ...], sizes: list[int], device: torch.device,
               rounds: int = 3, calls: int = 4) -> dict[str, tuple[list[int], list[float]]]:
    """op -> (bytes, median seconds per call) of each of ``ops`` over the group of ``ranks`` at each of
    ``sizes``; {} on a rank outside the group. Every rank of the world must call it, in the same order."""
    pg = dist.new_group(list(ranks))
    rank, n = dist.get_rank(), len(ranks)
    measured: dict[str, tuple[list[int], list[float]]] = {}
    if rank in ranks:
        for op in ops:
            measured[op] = ([], [])
            for nbytes in sizes:
                x = torch.ones(_elements(nbytes, n), device=device)
                call = COLLECTIVES[op](x, pg, n)
                call()  # warm-up: the connection and buffers
                per_round = []
                for _ in range(rounds):
                    dist.barrier(group=pg)
                    sync(device)
                    t0 = time.perf_counter()
                    for _ in range(calls):
                        call()
                    sync(device)
                    per_round.append((time.perf_counter() - t0) / calls)
                measured[op][0].append(x.numel() * 4)
                measured[op][1].append(statistics.median(per_round))
    dist.barrier()
    return measured


def time_pair(src: int, dst: int, sizes: list[int], device: torch.device, rounds: int = 5) -> tuple[list[int], list[float]]:
    """(bytes, median seconds of one message) from ``src`` to ``dst`` at each of ``sizes``: half a round
    trip; ([], []) on the other ranks. Every rank of the world must call it."""
    rank = dist.get_rank()
    measured: tuple[list[int], list[float]] = ([], [])
    if rank in (src, dst):
        peer = dst if rank == src else src
        for nbytes in sizes:
            x = torch.ones(_elements(nbytes, 1), device=device)
            trips = []
            for i in range(rounds + 1):  # the first round warms up
                sync(device)
                t0 = time.perf_counter()
                if rank == src:
                    dist.send(x, peer)
                    dist.recv(x, peer)
                else:
                    dist.recv(x, peer)
                    dist.send(x, peer)
                sync(device)
                if i:
                    trips.append((time.perf_counter() - t0) / 2)
            measured[0].append(x.numel() * 4)
            measured[1].append(statistics.median(trips))
    dist.barrier()
    return measured
