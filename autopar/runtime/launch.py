"""Start local ranks: one process each, a real process group (gloo on CPU, NCCL on GPU).

``spawn(fn, nprocs, args)`` runs ``fn(*args)`` on every rank with the default
process group initialised on 127.0.0.1 and returns the ranks' results in rank
order. A rank that raises makes ``spawn`` raise ``RankError`` with that rank's
traceback after stopping the others; a rank that hangs is stopped after
``timeout_s``. Under ``torchrun`` (``RANK``/``WORLD_SIZE`` set) nothing is
spawned: ``fn`` runs in this process on the existing group.

``join_from_env()`` is what ``materialize()`` calls when no process group
exists: a process started by ``autopar run`` or torchrun (which set
``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR``, ``MASTER_PORT``)
joins the group itself, on ``cuda:LOCAL_RANK`` with NCCL where GPUs exist,
on the CPU with gloo elsewhere; the group is destroyed when the process exits.
"""

from __future__ import annotations

import atexit
import os
import pickle
import socket
import time
import traceback
import warnings
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

__all__ = ["spawn", "RankError", "init_from_env", "join_from_env", "launched_world", "free_port"]

LAUNCH_VARS = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
"""What ``autopar run`` and torchrun set for every rank they start."""


class RankError(RuntimeError):
    """A rank failed; the message holds its rank and traceback."""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def default_backend(ranks_per_node: int = 1) -> str:
    """NCCL when this node has a GPU for each of its ranks, else gloo (NCCL refuses two ranks on one GPU)."""
    return "nccl" if torch.cuda.is_available() and torch.cuda.device_count() >= ranks_per_node else "gloo"


def _node_backend() -> str:
    """The backend for the ranks a launcher started on this node (``LOCAL_WORLD_SIZE`` of them): NCCL
    when each has a GPU; gloo on the CPU otherwise, said aloud where GPUs exist but are too few."""
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", 1))
    backend = default_backend(local_world)
    if backend == "gloo" and torch.cuda.is_available():
        warnings.warn(f"{local_world} ranks on this node but {torch.cuda.device_count()} GPU(s): the ranks run "
                      f"on the CPU with gloo; start at most {torch.cuda.device_count()} ranks per node to use "
                      f"the GPUs", stacklevel=3)
    return backend


def init_from_env(backend: str | None = None, timeout_s: float = 300.0) -> tuple[int, int]:
    """Initialise the default process group from torchrun's environment; returns (rank, world)."""
    if not dist.is_initialized():
        backend = backend or _node_backend()
        if backend == "nccl":
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
        dist.init_process_group(backend, timeout=timedelta(seconds=timeout_s))
    return dist.get_rank(), dist.get_world_size()


def launched_world() -> int | None:
    """The world size ``autopar run`` or torchrun started this process in, or None if neither did."""
    if all(v in os.environ for v in LAUNCH_VARS):
        return int(os.environ["WORLD_SIZE"])
    return None


def join_from_env(timeout_s: float = 1800.0) -> bool:
    """Join the process group a launcher set up in the environment, if there is one and this
    process is not in a group yet; returns whether it joined. The GPU of ``LOCAL_RANK`` becomes
    the current device under NCCL."""
    if dist.is_initialized() or launched_world() is None:
        return False
    backend = _node_backend()
    if backend == "nccl":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    dist.init_process_group(backend, timeout=timedelta(seconds=timeout_s))
    atexit.register(_leave)
    return True


def _leave() -> None:
    if dist.is_initialized():
        try:
            dist.destroy_process_group()
        except Exception:  # noqa: BLE001 - peers may be gone already
            pass


def _worker(rank: int, world: int, port: int, backend: str, threads: int, timeout_s: float,
            fn: Callable, args: tuple, results) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world), LOCAL_RANK=str(rank))
    torch.set_num_threads(threads)
    try:
        if backend == "nccl":
            torch.cuda.set_device(rank % torch.cuda.device_count())
        dist.init_process_group(backend, rank=rank, world_size=world, timeout=timedelta(seconds=timeout_s))
        out = fn(*args)
        # plain pickle bytes: tensors pickled by value (not in shared memory), so they outlive this process
        results.put((rank, True, pickle.dumps(out)))
    except BaseException as e:  # noqa: BLE001 - reported to the parent with the traceback
        results.put((rank, False, f"{type(e).__name__}: {e}\n{traceback.format_exc()}"))
    finally:
        if dist.is_initialized():
            try:
                dist.destroy_process_group()
            except Exception:  # noqa: BLE001 - peers may be gone already
                pass


def spawn(fn: Callable, nprocs: int, args: tuple = (), backend: str | None = None,
          timeout_s: float = 600.0, threads_per_rank: int = 1) -> list[Any]:
    """Run ``fn(*args)`` on ``nprocs`` local ranks; return their results in rank order."""
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ and not dist.is_initialized():
        init_from_env(backend, timeout_s)
        torch.set_num_threads(threads_per_rank)
        try:
            out = fn(*args)
            dist.barrier()  # leave together: a rank exiting early closes its peers' connections
        finally:
            dist.destroy_process_group()
        return [out]
    backend = backend or default_backend(nprocs)
    ctx = mp.get_context("spawn")
    results = ctx.SimpleQueue()
    port = free_port()
    procs = [
        ctx.Process(target=_worker, args=(r, nprocs, port, backend, threads_per_rank, timeout_s, fn, args, results),
                    daemon=True)
        for r in range(nprocs)
    ]
    for p in procs:
        p.start()
    out: dict[int, Any] = {}
    failure: tuple[int, str] | None = None
    deadline = time.monotonic() + timeout_s
    try:
        while len(out) < nprocs and failure is None:
            if not results.empty():
                rank, ok, value = results.get()
                if ok:
                    out[rank] = pickle.loads(value)  # noqa: S301 - bytes from the ranks this call started
                else:
                    failure = (rank, value)
                continue
            dead = [r for r, p in enumerate(procs) if not p.is_alive() and p.exitcode not in (0, None) and r not in out]
            if dead and results.empty():
                time.sleep(0.2)
                if results.empty():
                    failure = (dead[0], f"process exited with code {procs[dead[0]].exitcode}")
                continue
            if time.monotonic() > deadline:
                missing = [r for r in range(nprocs) if r not in out]
                failure = (missing[0], f"ranks {missing} did not finish within {timeout_s:.0f}s")
                continue
            time.sleep(0.01)
    finally:
        for p in procs:
            p.join(timeout=0 if failure else 10)
            if p.is_alive():
                p.terminate()
                p.join(5)
                if p.is_alive():
                    p.kill()
    if failure is not None:
        rank, text = failure
        raise RankError(f"rank {rank} of {nprocs} failed: {text}")
    return [out[r] for r in range(nprocs)]


def run_script(nproc: int, script: str, script_args: list[str], timeout_s: float | None = None) -> int:
    """``autopar run --nproc N script.py ...``: start N ranks of a script, torchrun-style.

    Each rank gets RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT
    (so ``autopar.spawn`` inside the script runs in place). When one rank
    exits with an error, the others are stopped and its exit code returned.
    """
    import subprocess
    import sys

    port = free_port()
    procs = []
    for rank in range(nproc):
        env = dict(os.environ, RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(nproc),
                   LOCAL_WORLD_SIZE=str(nproc), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                   OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"))
        procs.append(subprocess.Popen([sys.executable, script, *script_args], env=env))
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    failed: tuple[int, int] | None = None
    try:
        while True:
            codes = [p.poll() for p in procs]
            bad = [(r, c) for r, c in enumerate(codes) if c not in (None, 0)]
            if bad:
                failed = bad[0]
                break
            if all(c == 0 for c in codes):
                return 0
            if deadline is not None and time.monotonic() > deadline:
                failed = (next(r for r, c in enumerate(codes) if c is None), 124)
                break
            time.sleep(0.05)
    finally:
        for p in procs:
            if p.poll() is None:
                p.terminate()
        for p in procs:
            try:
                p.wait(10)
            except subprocess.TimeoutExpired:
                p.kill()
    rank, code = failed
    print(f"autopar run: rank {rank} of {nproc} exited with code {code}; stopped the others", file=sys.stderr)
    return code
