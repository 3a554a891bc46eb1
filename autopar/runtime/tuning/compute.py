"""Timing one rank's kernels: GEMMs of given shapes and dtypes, a large copy (memory-bound
throughput), a tiny eager op (the per-op overhead an op-by-op chunk pays) and, on request, the call of
a tiny compiled function. Each figure is a median over repeats sized to a time budget; on a GPU the
device is synchronised around every timed call.
"""

from __future__ import annotations

import os
import platform
import statistics
import time
from collections.abc import Callable

import torch

__all__ = ["DTYPES", "sync", "median_seconds", "time_gemm", "copy_bandwidth", "eager_op_seconds",
           "compiled_call_seconds", "device_facts", "dtype_works"]

DTYPES: dict[str, torch.dtype] = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
"""The dtypes a GEMM can be timed in, by the names a profile uses."""


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def median_seconds(fn: Callable[[], object], device: torch.device, budget_s: float = 0.2,
                   min_repeat: int = 3, max_repeat: int = 50) -> float:
    """Median seconds of one call of ``fn``: one warm-up call, then as many timed calls as fit in
    ``budget_s`` (at least ``min_repeat``, at most ``max_repeat``)."""
    sync(device)
    t0 = time.perf_counter()
    fn()
    sync(device)
    first = time.perf_counter() - t0
    repeat = max(min_repeat, min(max_repeat, int(budget_s / max(first, 1e-7))))
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        sync(device)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def dtype_works(dtype: str, device: torch.device) -> bool:
    """Whether a small product in ``dtype`` runs on ``device`` (fp16 on some CPUs does not)."""
    try:
        x = torch.ones(8, 8, dtype=DTYPES[dtype], device=device)
        torch.matmul(x, x)
    except (RuntimeError, TypeError):
        return False
    return True


def time_gemm(shape: tuple[int, int, int, int], dtype: str, device: torch.device, budget_s: float = 0.2) -> float:
    """Median seconds of C (batch, M, N) = A (batch, M, K) B (batch, K, N) in ``dtype`` (``torch.matmul``)."""
    batch, m, n, k = shape
    gen = torch.Generator(device=device).manual_seed(0)
    a = torch.randn(batch, m, k, device=device, dtype=DTYPES[dtype], generator=gen)
    b = torch.randn(batch, k, n, device=device, dtype=DTYPES[dtype], generator=gen)
    if batch == 1:
        a, b = a[0], b[0]
    return median_seconds(lambda: torch.matmul(a, b), device, budget_s)


def copy_bandwidth(nbytes: int, device: torch.device, budget_s: float = 0.2) -> float:
    """Bytes/s a copy of ``nbytes`` of fp32 moves (each byte read once and written once)."""
    src = torch.ones(nbytes // 4, device=device)
    dst = torch.empty_like(src)
    return 2 * src.numel() * 4 / median_seconds(lambda: dst.copy_(src), device, budget_s)


def eager_op_seconds(device: torch.device, budget_s: float = 0.05) -> float:
    """Seconds of an eager add of two 8-element tensors: the dispatch (and, on a GPU, launch) cost each
    op of an op-by-op chunk pays whatever its size. Timed as 100 adds in a row, per add."""
    a, b = torch.ones(8, device=device), torch.ones(8, device=device)

    def hundred() -> None:
        for _ in range(100):
            torch.add(a, b)

    return median_seconds(hundred, device, budget_s) / 100


def compiled_call_seconds(device: torch.device, budget_s: float = 0.05) -> float:
    """Seconds of one call of a tiny ``torch.compile``d function (x * 2 + 1 over 8 elements): the per-call
    cost a compiled chunk pays on top of its kernels (guards, the wrapper, its launches)."""
    fn = torch.compile(lambda x: x * 2 + 1)
    x = torch.ones(8, device=device)
    fn(x)  # compiles
    return median_seconds(lambda: fn(x), device, budget_s)


def device_facts(device: torch.device, ranks_on_node: int) -> dict:
    """(kind, name, memory of one device in bytes, streaming multiprocessors) of ``device``; a CPU rank
    gets the machine's memory over the ``ranks_on_node`` ranks sharing it."""
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        return {"kind": "cuda", "name": props.name, "memory_bytes": float(props.total_memory),
                "sm_count": int(props.multi_processor_count)}
    try:
        total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        total = 16 * 2**30
    name = platform.processor() or platform.machine() or "cpu"
    return {"kind": "cpu", "name": f"CPU ({name}, {torch.get_num_threads()} thread(s) per rank)",
            "memory_bytes": float(total) / max(ranks_on_node, 1), "sm_count": 1}
