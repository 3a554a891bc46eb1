"""Start local ranks: one process each, a real process group (gloo on CPU, NCCL on GPU).

``spawn(fn, nprocs, args)`` runs ``fn(*args)`` on every rank with the default
process group initialised on 127.0.0.1 and returns the ranks' results in rank
order. On the CPU (gloo) the ranks are forked from a server process that
imported torch, autopar's compiler and runtime and transformers once
(``RANK_PRELOAD``), so a rank starts in a fraction of a second instead of
importing them again; NCCL ranks start fresh (``spawn``), so no rank inherits
anything of CUDA. ``spawn(..., inherit=True)`` forks CPU ranks from the calling
process itself, so a program compiled there once runs on every rank (a
program cannot be pickled). Either way a rank sees this process's environment, working
directory, ``sys.path``, stdout and stderr as they are at the call, and a forked rank
freezes the heap it inherited (``gc.freeze``): its garbage collections never walk, and
so never copy page by page, the objects of the process it was forked from.
A rank that raises makes ``spawn`` raise ``RankError`` with that rank's
traceback after stopping the others; a rank that hangs is stopped after
``timeout_s``. Ranks that fail because another did report that rank's failure
(``ActionError.root_rank``): ``spawn`` reports the root one. Ctrl-C (SIGINT) or
SIGTERM stops the ranks and exits with 130 (143) after one line. Under
``torchrun`` (``RANK``/``WORLD_SIZE`` set) nothing is spawned: ``fn`` runs in
this process on the existing group.

``join_from_env()`` is what ``materialize()`` calls when no process group
exists: a process started by ``autopar run`` or torchrun (which set
``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR``, ``MASTER_PORT``)
joins the group itself, on ``cuda:LOCAL_RANK`` with NCCL where GPUs exist,
on the CPU with gloo elsewhere; the group is destroyed when the process exits.
"""

from __future__ import annotations

import atexit
import contextlib
import gc
import os
import pickle
import signal
import socket
import subprocess
import sys
import threading
import time
import traceback
import warnings
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from multiprocessing import forkserver, reduction

from autopar.core.errors import AutoparError

__all__ = ["spawn", "RankError", "LaunchError", "init_from_env", "join_from_env", "launched_world", "free_port",
           "restart_count", "RESTART_VAR"]

LAUNCH_VARS = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
"""What ``autopar run`` and torchrun set for every rank they start."""


class RankError(AutoparError, RuntimeError):
    """A rank failed; the message holds its rank and traceback."""


class LaunchError(AutoparError, ValueError):
    """Ranks asked for in a way they cannot start (the message says how they can)."""


RANK_PRELOAD = ("torch", "torch.distributed", "autopar.api", "autopar.runtime.engine", "autopar.reference.models",
                "transformers")
"""What the server that forks CPU ranks imports once, before any rank starts (what every rank would
import itself). None of it initialises CUDA; a module that is not installed is skipped."""

ROOT_WAIT_S = 5.0
"""How long ``spawn`` waits for the report of the rank whose failure another rank reported."""
STOP_GRACE_S = 5.0
"""How long stopped ranks get to exit after SIGTERM before SIGKILL."""


@contextlib.contextmanager
def _interrupts():
    """While ranks run: SIGINT and SIGTERM recorded (the list yielded) instead of raising, so the
    launcher stops its ranks and says so in one line. Only in the main thread (where handlers live)."""
    caught: list[int] = []
    if threading.current_thread() is not threading.main_thread():
        yield caught
        return
    previous = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}

    def record(signum, frame):
        caught.append(signum)

    for s in previous:
        signal.signal(s, record)
    try:
        yield caught
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)


def _interrupted_line(signum: int, stopped: int) -> str:
    return f"{'interrupted' if signum == signal.SIGINT else 'terminated'}: stopped {stopped} rank{'s' * (stopped != 1)}"


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


def _leave_together() -> None:
    """A barrier before the ranks leave: a rank that leaves early closes its peers' connections, and rank 0
    takes the process group's store with it while a slower peer may still need it (a new connection
    to it, such as an engine's failure board makes, would wait the group's whole timeout). Bounded under
    gloo, once an engine ran, by its failure timeout (``AUTOPAR_FAILURE_TIMEOUT``): a rank that stopped
    answering after the engine's last call fails the others here, named by gloo's monitored barrier,
    instead of holding them for the group's timeout. Skipped where a failure stopped this rank's
    communication: its groups are closed, and the store's host waits at exit until its peers read the
    failure. The board's module is asked only if an engine loaded it."""
    if not dist.is_initialized():  # the function ended the group itself
        return
    board = sys.modules.get("autopar.runtime.engine.failure_board")
    if board is not None and board.communication_stopped():
        return
    if board is not None and str(dist.get_backend()) == "gloo" and dist.get_world_size() > 1:
        dist.monitored_barrier(timeout=timedelta(seconds=board.failure_timeout()))
    else:
        dist.barrier()


def _stop_watches() -> None:
    """Stop the engines' failure watches before the process group goes (each thread may be reading
    the group's store): the board's module is asked only if an engine loaded it."""
    board = sys.modules.get("autopar.runtime.engine.failure_board")
    if board is not None:
        board.close_watches()


def _leave() -> None:
    _stop_watches()
    if dist.is_initialized():
        try:
            dist.destroy_process_group()
        except Exception:  # noqa: BLE001 - peers may be gone already
            pass


def _worker(rank: int, world: int, port: int, backend: str, threads: int, timeout_s: float,
            fn: Callable, args: tuple, results, environ: dict[str, str], forked: bool,
            streams: tuple[int | None, int | None] | None) -> None:
    if forked:  # what the rank inherited out of the collector's reach: a full collection would walk
        gc.freeze()  # (and so copy, page by page) the parent's whole heap, seconds in a process of a few GB
    if streams is not None:  # forked by the server: write where the parent writes now
        for fd, target in zip(streams, (1, 2)):
            if fd is not None and fd != target:
                os.dup2(fd, target)
                os.close(fd)
    if forked:  # fresh random numbers, and only this rank's own exit handlers (see the end)
        torch.seed()
        atexit._clear()
    os.environ.clear()
    os.environ.update(environ)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world), LOCAL_RANK=str(rank))
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the parent, which stops the ranks
    torch.set_num_threads(threads)
    try:
        if backend == "nccl":
            torch.cuda.set_device(rank % torch.cuda.device_count())
        dist.init_process_group(backend, rank=rank, world_size=world, timeout=timedelta(seconds=timeout_s))
        out = fn(*args)
        _leave_together()
        # plain pickle bytes: tensors pickled by value (not in shared memory), so they outlive this process
        results.put((rank, True, pickle.dumps(out), None))
    except BaseException as e:  # noqa: BLE001 - reported to the parent with the traceback
        # root_rank: the rank whose failure this one saw (an engine's ActionError), else this one
        results.put((rank, False, f"{type(e).__name__}: {e}\n{traceback.format_exc()}",
                     getattr(e, "root_rank", rank)))
    finally:
        _stop_watches()
        if dist.is_initialized():
            try:
                dist.destroy_process_group()
            except Exception:  # noqa: BLE001 - peers may be gone already
                pass
        if forked:
            # a forked process ends in os._exit, which skips the exit handlers a fresh interpreter runs
            # (the store's host waiting until every rank has read a failure it holds): run them here
            atexit._run_exitfuncs()


def spawn(fn: Callable, nprocs: int, args: tuple = (), backend: str | None = None,
          timeout_s: float = 600.0, threads_per_rank: int = 1, inherit: bool = False) -> list[Any]:
    """Run ``fn(*args)`` on ``nprocs`` local ranks; return their results in rank order.

    ``inherit`` (gloo only): fork the ranks from this process itself, so they
    inherit what it holds, such as a program compiled here once for all of
    them (``fn`` and ``args`` are not pickled). Fork only from a process
    whose other threads hold no locks (no data loader or checkpoint writer
    running): a forked rank has this thread alone.
    """
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ and not dist.is_initialized():
        init_from_env(backend, timeout_s)
        torch.set_num_threads(threads_per_rank)
        try:
            out = fn(*args)
            _leave_together()
        finally:
            _stop_watches()
            if dist.is_initialized():  # a failed engine under NCCL aborted (and removed) its groups
                dist.destroy_process_group()
        return [out]
    backend = backend or default_backend(nprocs)
    if inherit and backend != "gloo":
        raise LaunchError(f"spawn(inherit=True) forks CPU ranks; {backend} ranks start fresh (no CUDA state "
                          "inherited): compile the program in each rank, or use backend='gloo'")
    ctx = mp.get_context("fork") if inherit else _rank_context(backend)
    start = ctx.get_start_method()
    streams = tuple(_ParentFd.of(fd) for fd in (1, 2)) if start == "forkserver" else None
    results = ctx.SimpleQueue()
    port = free_port()
    procs = [
        ctx.Process(target=_worker, args=(r, nprocs, port, backend, threads_per_rank, timeout_s, fn, args, results,
                                          dict(os.environ), start != "spawn", streams),
                    daemon=True)
        for r in range(nprocs)
    ]
    for p in procs:
        p.start()
    out: dict[int, Any] = {}
    failure: tuple[int, str] | None = None
    reported: dict[int, tuple[str, int]] = {}
    """Failed ranks: (report, the rank whose failure they saw)."""
    deadline = time.monotonic() + timeout_s
    with _interrupts() as caught:
        try:
            failure = _collect(procs, results, out, reported, nprocs, deadline, timeout_s, caught)
        finally:
            stopped = sum(p.is_alive() for p in procs)
            for p in procs:
                p.join(timeout=0 if failure or caught else 10)
                if p.is_alive():
                    p.terminate()
                    p.join(STOP_GRACE_S)
                    if p.is_alive():
                        p.kill()
    if caught:
        print(_interrupted_line(caught[0], stopped), file=sys.stderr, flush=True)
        raise SystemExit(128 + caught[0])
    if failure is not None:
        rank, text = failure
        raise RankError(f"rank {rank} of {nprocs} failed: {text}")
    return [out[r] for r in range(nprocs)]


def _rank_context(backend: str):
    """How ranks start: forked from the preloading server for gloo where the platform has one; a fresh
    interpreter each (``spawn``) for NCCL, so that nothing of CUDA is inherited."""
    if backend == "nccl" or "forkserver" not in mp.get_all_start_methods():
        return mp.get_context("spawn")
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(list(RANK_PRELOAD))
    _start_forkserver()
    return ctx


def _start_forkserver() -> None:
    """Start the fork server if it is not running, importing from this process's ``sys.path``: it starts as
    a fresh interpreter, which would otherwise preload the installed autopar instead of the one in use here
    (ranks get this process's ``sys.path`` only after the preload)."""
    saved = os.environ.get("PYTHONPATH")
    os.environ["PYTHONPATH"] = os.pathsep.join(os.path.abspath(p) for p in sys.path)
    try:
        forkserver.ensure_running()
    finally:
        if saved is None:
            del os.environ["PYTHONPATH"]
        else:
            os.environ["PYTHONPATH"] = saved


class _ParentFd:
    """A file descriptor of the spawning process, sent to a forked rank (which would otherwise write
    to the fork server's stdout and stderr, those of the moment the server started)."""

    def __init__(self, fd: int):
        self.fd = fd

    @classmethod
    def of(cls, fd: int) -> _ParentFd | None:
        """``fd`` to send, or None where this process has it closed (the rank keeps the server's)."""
        try:
            os.fstat(fd)
        except OSError:
            return None
        return cls(fd)

    def __reduce__(self):
        return _received_fd, (reduction.DupFd(self.fd),)


def _received_fd(dup) -> int:
    return dup.detach()


def _collect(procs, results, out: dict, reported: dict, nprocs: int, deadline: float, timeout_s: float,
             caught: list) -> tuple[int, str] | None:
    """Read the ranks' reports until all succeeded, one failed (the rank whose failure the others saw,
    waited for ``ROOT_WAIT_S``), a rank died or hung, or a signal came; returns the failure to report."""
    root_wait: float | None = None
    while not caught:
        if len(out) + len(reported) == nprocs and reported:
            return _root_report(reported)
        if len(out) == nprocs:
            return None
        if not results.empty():
            rank, ok, value, root = results.get()
            if ok:
                out[rank] = pickle.loads(value)  # noqa: S301 - bytes from the ranks this call started
                continue
            reported[rank] = (value, root)
            if root == rank or root in reported:
                return _root_report(reported)
            root_wait = root_wait or time.monotonic() + ROOT_WAIT_S
            continue
        if root_wait is not None and time.monotonic() > root_wait:
            return _root_report(reported)
        if root_wait is None:
            dead = [r for r, p in enumerate(procs)
                    if not p.is_alive() and p.exitcode not in (0, None) and r not in out and r not in reported]
            if dead and results.empty():
                time.sleep(0.2)
                if results.empty():
                    return dead[0], f"process exited with code {procs[dead[0]].exitcode}"
                continue
            if time.monotonic() > deadline:
                missing = [r for r in range(nprocs) if r not in out]
                return missing[0], f"ranks {missing} did not finish within {timeout_s:.0f}s"
        time.sleep(0.01)
    return None


def _root_report(reported: dict[int, tuple[str, int]]) -> tuple[int, str]:
    """The failure to report: the rank the others' failures name as the root, when it reported."""
    for rank, (text, root) in reported.items():
        if root in reported:
            return root, reported[root][0]
    rank, (text, _) = next(iter(reported.items()))
    return rank, text


RESTART_VAR = "TORCHELASTIC_RESTART_COUNT"
"""How many times the launcher restarted the ranks before this start (torchrun's variable, which
``autopar run --max-restarts`` sets too): a script resumes from its newest checkpoint when it is > 0."""


def restart_count() -> int:
    """How many times ``autopar run --max-restarts`` or torchrun restarted this job's ranks (0: first start)."""
    return int(os.environ.get(RESTART_VAR, "0") or 0)


def run_script(nproc: int, script: str, script_args: list[str], timeout_s: float | None = None,
               max_restarts: int = 0, module: bool = False) -> int:
    """``autopar run --nproc N script.py ...``: start N ranks of a script, torchrun-style (of a module,
    ``python -m script``, with ``module``: how ``autopar tune --nproc N`` starts its ranks).

    Each rank gets RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT
    (so ``autopar.spawn`` inside the script runs in place). When one rank
    exits with an error, the others are stopped and, while fewer than
    ``max_restarts`` restarts were made, all N are started again (on a new
    port, ``TORCHELASTIC_RESTART_COUNT`` counting the restarts, as torchrun
    does); else its exit code is returned. Each rank runs in a process group of
    its own, so a terminal's Ctrl-C reaches the launcher alone: it stops the
    ranks (SIGTERM to each group, SIGKILL after ``STOP_GRACE_S``), prints
    ``interrupted: stopped N ranks`` and returns 130 (SIGTERM: 143); it is never
    restarted.
    """
    if max_restarts < 0:
        raise LaunchError(f"--max-restarts {max_restarts}: the number of restarts is 0 or more")
    for restart in range(max_restarts + 1):
        code, failed = _run_once(nproc, script, script_args, timeout_s, restart, module)
        if failed is None or restart == max_restarts:
            return code
        rank, _ = failed
        print(f"autopar run: rank {rank} of {nproc} exited with code {code}; stopped the others; restarting all "
              f"{nproc} ranks ({restart + 1} of {max_restarts} restarts)", file=sys.stderr, flush=True)
    return code


def _run_once(nproc: int, script: str, script_args: list[str], timeout_s: float | None, restart: int,
              module: bool) -> tuple[int, tuple[int, int] | None]:
    """One start of the N ranks: (the exit code to return, (rank, code) of the failed rank or None when
    none failed or the launcher was interrupted)."""
    port = free_port()
    procs: list[subprocess.Popen] = []
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    failed: tuple[int, int] | None = None
    with _interrupts() as caught:
        try:
            for rank in range(nproc):
                env = dict(os.environ, RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(nproc),
                           LOCAL_WORLD_SIZE=str(nproc), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                           OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"), **{RESTART_VAR: str(restart)})
                target = ["-m", script] if module else [script]
                procs.append(subprocess.Popen([sys.executable, *target, *script_args], env=env,
                                              start_new_session=True))
            while not caught:
                codes = [p.poll() for p in procs]
                bad = [(r, c) for r, c in enumerate(codes) if c not in (None, 0)]
                if bad:
                    failed = bad[0]
                    break
                if all(c == 0 for c in codes):
                    return 0, None
                if deadline is not None and time.monotonic() > deadline:
                    failed = (next(r for r, c in enumerate(codes) if c is None), 124)
                    break
                time.sleep(0.05)
        finally:
            stopped = _stop_groups(procs, STOP_GRACE_S if caught else 10.0)
    if caught:
        print(f"autopar run: {_interrupted_line(caught[0], stopped)}", file=sys.stderr, flush=True)
        return 128 + caught[0], None
    rank, code = failed
    print(f"autopar run: rank {rank} of {nproc} exited with code {code}; stopped the others", file=sys.stderr)
    return code, failed


def _stop_groups(procs: list[subprocess.Popen], grace_s: float) -> int:
    """Stop the ranks still running: SIGTERM to each one's process group (the rank and what it
    started), SIGKILL to those left after ``grace_s``. Returns how many were running."""
    running = [p for p in procs if p.poll() is None]
    for p in running:
        _signal_group(p, signal.SIGTERM)
    end = time.monotonic() + grace_s
    for p in running:
        try:
            p.wait(max(0.0, end - time.monotonic()))
        except subprocess.TimeoutExpired:
            _signal_group(p, signal.SIGKILL)
            p.wait()
    for p in running:  # what a stopped rank started and left behind in its group
        _signal_group(p, signal.SIGKILL)
    return len(running)


def _signal_group(p: subprocess.Popen, sig: int) -> None:
    try:
        os.killpg(p.pid, sig)
    except (ProcessLookupError, PermissionError):
        pass
