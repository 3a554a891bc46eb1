"""When one rank's step fails, every rank of the engine raises the same root cause, and none hangs.

A rank whose action raises publishes the failure (``Failure``: its rank,
(pp, dp, tp), the action, the original exception's type and message) on the
engine's *board*: one key of the process group's c10d store, written once
(the first failure published is the root cause; later ones read it). Then it
stops its own communication (``stop_communication``), which breaks its peers
out of the waits they have on it:

- gloo: a receive that times out closes every connection of its group, so
  one timed-out receive per group makes every pending operation of a peer
  with this rank fail ("Connection closed by peer") at once;
- NCCL: ``_abort_process_group()`` aborts this rank's communicators (a peer's
  NCCL kernels are not interrupted by it: each peer's watch, below, aborts its
  own).

A rank whose communication fails reads the board and raises the published
root cause as its own error, saying where it saw it; it stops its own
communication too, so the ranks waiting on it are freed in turn. During a
step a *watch* thread on each rank polls the board (``poll_s``): a failure
published elsewhere stops this rank's communication even while it is blocked
in a collective. The watch also bounds every wait: an action that makes no
progress for ``timeout_s`` (``engine.failure_timeout_s``, default
``AUTOPAR_FAILURE_TIMEOUT`` or 300 s, well under torch's 30 minutes) is
published as this rank's failure, a ``TimeoutError`` naming the action.

Once an engine ran its first collective call, each rank's watch also writes
a *heartbeat* on the board every poll (``beat``: the wall-clock time and what
the rank runs: a step's action, another collective call of the engine, or its
own code between calls). A rank that stops answering (stopped with SIGSTOP,
its host frozen) stops beating while its threads stand still; the rank whose
wait times out reads every heartbeat and names, in its failure, the ranks
silent for longer than ``silent_s`` and what each was last running, or, when
every rank still answers (one stuck in another collective), what each of them
is running. The watch runs over every collective call of the engine, not only
its steps (``StepFailures.watched``).

A failed engine refuses every further step (``EngineFailedError``): its
state (sends in flight, partial gradients) and its process groups are gone.

The store lives in rank 0's process (``MASTER_ADDR``): a rank 0 that stopped
for a failure waits at exit (up to ``exit_wait_s``) until every rank has read
the root cause, so a peer slower to notice still finds it (every rank but those
whose heartbeat fell silent). A rank 0 that stops answering would hold every
store call forever (a TCPStore client's read has no timeout once connected):
the board makes its calls on a thread of its own, each waited for at most
``STORE_TIMEOUT_S``, and after one times out it calls the store no more and
names rank 0 as the rank that stopped answering.
"""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import queue
import sys
import threading
import time
import weakref
from collections.abc import Callable
from dataclasses import asdict, dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from autopar.core.errors import AutoparError
from autopar.core.mesh import forget_groups
from autopar.runtime.engine.errors import EngineUsageError

__all__ = ["Failure", "FailureBoard", "EngineFailedError", "stop_communication", "failure_timeout", "close_watches",
           "TIMEOUT_ENV", "DEFAULT_TIMEOUT_S", "communication_stopped"]

TIMEOUT_ENV = "AUTOPAR_FAILURE_TIMEOUT"
"""Environment variable: the default ``engine.failure_timeout_s``, in seconds."""
DEFAULT_TIMEOUT_S = 300.0
_CLOSE_TAG = 2**30 + 611
"""The tag of the receive that times out on purpose (no engine message uses it)."""
_STOPPED: list = []
"""The process groups ``stop_communication`` closed or aborted (held, so an id is never reused)."""
_READERS: list[tuple["FailureBoard", str, float]] = []
"""(board, key of its readers' count, seconds) of the failures this process's store holds: waited for at exit."""


def failure_timeout() -> float:
    """Seconds an action may make no progress before its rank fails it: ``AUTOPAR_FAILURE_TIMEOUT`` or 300."""
    value = os.environ.get(TIMEOUT_ENV)
    if value is None:
        return DEFAULT_TIMEOUT_S
    try:
        seconds = float(value)
    except ValueError:
        raise EngineUsageError(f"{TIMEOUT_ENV}={value!r} is not a number of seconds") from None
    if seconds <= 0:
        raise EngineUsageError(f"{TIMEOUT_ENV}={value!r}: the failure timeout must be positive seconds")
    return seconds


@dataclass(frozen=True)
class Failure:
    """One rank's failure in a step, as published on the board."""

    rank: int
    coords: tuple[int, int, int]
    """(pp, dp, tp) of the rank."""
    what: str
    """The action(s) (``F0.1``, ``RF1.0 SB1.0``) or the part of the step (``the step's end ...``)."""
    where: str
    """``stage s, step t`` for actions; empty otherwise."""
    error: str
    """``Type: message`` of the original exception."""
    step: int
    """The engine's step number (train and eval steps counted together, from 1)."""
    kind: str
    """``train_step`` or ``eval_step``."""
    marks: tuple[tuple[int, int], ...] = ()
    """(stage, index in the stage's action list) of the failing actions."""

    def headline(self, marked: bool = False) -> str:
        """``rank 1 (pp=0, dp=0, tp=1) failed running F0.1 (stage 0, step 2): IndexError: ...``."""
        pp, dp, tp = self.coords
        where = self.where + (", marked [..] below" if marked and self.marks else "")
        verb = "failed running" if self.marks else "failed in"
        return (f"rank {self.rank} (pp={pp}, dp={dp}, tp={tp}) {verb} {self.what}"
                f"{f' ({where})' if where else ''}: {self.error}")

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, text: str | bytes) -> "Failure":
        d = json.loads(text)
        return cls(d["rank"], tuple(d["coords"]), d["what"], d["where"], d["error"], d["step"], d["kind"],
                   tuple(tuple(m) for m in d["marks"]))


class EngineFailedError(AutoparError, RuntimeError):
    """A step (or other collective call) on an engine that failed earlier: refused before any work.
    ``root`` is the failure that stopped it (``Failure``)."""

    def __init__(self, message: str, root: Failure) -> None:
        super().__init__(message)
        self.root = root

    def __reduce__(self):
        return type(self), (str(self), self.root)


def stop_communication() -> None:
    """Stop this process's communication so that no peer waits on it, and no wait of its own
    stays blocked: NCCL's communicators aborted (every group), gloo's connections closed (one
    receive that times out per group). The groups are unusable afterwards: the next engine
    makes new ones."""
    if not dist.is_initialized():
        return
    forget_groups()
    c10d = dist.distributed_c10d
    _STOPPED.extend(c10d._world.pg_map)
    backends = {}
    for pg in list(c10d._world.pg_map):
        try:
            backends[pg] = str(dist.get_backend(pg))
        except Exception:  # noqa: BLE001 - destroyed meanwhile
            pass
    if any("nccl" in b for b in backends.values()):
        try:
            c10d._abort_process_group()  # all groups, inside one NCCL group call (no abort deadlock)
        except Exception:  # noqa: BLE001 - already aborted or destroyed
            pass
        return
    for pg, backend in backends.items():
        if backend == "gloo":
            _close_gloo_group(pg)


def communication_stopped() -> bool:
    """``stop_communication`` ran in this process on the current default group: its collectives fail."""
    world = dist.group.WORLD if dist.is_initialized() else None
    return world is not None and any(pg is world for pg in _STOPPED)


def _close_gloo_group(pg) -> None:
    """Close every connection of a gloo group: a receive that times out closes its context's pairs,
    and each peer's pending operation with this rank fails with "Connection closed by peer"."""
    try:
        if pg.size() < 2:
            return
        work = pg.recv([torch.empty(1)], (pg.rank() + 1) % pg.size(), _CLOSE_TAG)
        work.wait(timedelta(milliseconds=1))
    except Exception:  # noqa: BLE001 - the expected timeout, or connections closed already
        pass


STUCK_EXIT_S = 3.0
"""How long a watched call may go on after this rank's communication was stopped for a failure, the store's
host silent, before the watch ends the process (``Watch._end_if_stuck``): a call whose collectives failed
ends within milliseconds, and a wait for an asynchronous save gives up sooner (``SaveHandle.wait``)."""

STORE_TIMEOUT_S = 3.0
"""How long one of the board's store calls may wait: the store lives in rank 0's process, and a rank
0 that stopped answering (SIGSTOP, a frozen host) must not hold every other rank in the very calls that
would report it (a TCPStore client's read has no timeout of its own then: the connection stays open and
nothing comes)."""


def _own_client(store):
    """A connection of this process's own to ``store``, the default group's (the group's connection stays
    free for everything else, and one of the board's calls left hanging holds only this one). Made on the
    board's calls thread: a clone connects anew, and a store whose host is gone would hold the connect for
    the group's whole timeout."""
    try:
        store = store.clone()
        store.set_timeout(timedelta(seconds=STORE_TIMEOUT_S))
    except Exception:  # noqa: BLE001 - a store without clone(): the group's own connection, as before
        pass
    return store


class _StoreCalls:
    """The board's store calls, made one at a time on a daemon thread of their own and each waited for
    at most ``timeout_s``: a call that does not return by then is left behind (its thread stays blocked
    on a store that no longer answers) and the board stops calling the store. The thread connects to the
    store at its first call (``connect()``), within that call's bound."""

    def __init__(self, timeout_s: float, connect: Callable[[], object]) -> None:
        self.timeout_s = timeout_s
        self._connect = connect
        self._client = None
        self.silent = False
        """A call timed out: the store's host stopped answering."""
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._thread: threading.Thread | None = None

    def call(self, method: str, *args):
        """The store's ``method(*args)`` on the calls' thread: its value, or its exception;
        ``TimeoutError`` after ``timeout_s`` (or as soon as another call timed out)."""
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="autopar-failure-store", daemon=True)
            self._thread.start()
        done, box = threading.Event(), []
        self._jobs.put((method, args, box, done))
        end = time.monotonic() + self.timeout_s
        while not done.wait(0.05):
            if self.silent or time.monotonic() > end:
                self.silent = True
                raise TimeoutError(f"the store did not answer within {self.timeout_s:g} s")
        ok, value = box[0]
        if ok:
            return value
        raise value

    def _run(self) -> None:
        while True:
            method, args, box, done = self._jobs.get()
            try:
                if self._client is None:
                    self._client = self._connect()
                box.append((True, getattr(self._client, method)(*args)))
            except Exception as e:  # noqa: BLE001 - handed to the caller
                box.append((False, e))
            done.set()


class FailureBoard:
    """The failures of one engine's steps, shared by its ranks through the default group's store.

    Without peers (one rank, no process group) nothing is shared: ``shared`` is False and
    a failure stays this rank's own.
    """

    def __init__(self, key: str, world: int) -> None:
        self.key = key
        """The store key: per engine (a token rank 0 drew when the engine was made)."""
        self.shared = world > 1 and dist.is_initialized()
        """Peers share this board through the default group's store (else a failure stays this rank's)."""
        self.world = world
        self.hosts_store = self.shared and dist.get_rank() == 0
        """Rank 0: the process that serves the store (``MASTER_ADDR``'s port)."""
        self.poll_s = 0.2 * max(1.0, world / 64)
        """How often a watch reads the board (less often in large worlds: one store serves all)."""
        self.exit_wait_s = 30.0
        """How long rank 0 waits at exit for every rank to read a failure."""
        self.root: Failure | None = None
        """The root cause once this rank knows it (kept: the store may be gone later)."""
        self._stopped = False
        self._lock = threading.Lock()
        self._watch: Watch | None = None
        default = dist.distributed_c10d._get_default_store() if self.shared else None
        self._calls = _StoreCalls(STORE_TIMEOUT_S, lambda: _own_client(default))
        self.store_silent = False
        """A store call timed out or failed: rank 0, which serves the store, stopped answering; later
        calls are skipped (each would wait ``STORE_TIMEOUT_S`` again)."""

    @property
    def stopped(self) -> bool:
        """This rank's communication was stopped for a failure (its own, a peer's, or a timeout)."""
        return self._stopped

    def _call(self, method: str, *args):
        """The store's ``method(*args)``, unless it stopped answering (then, and on a timeout, raise
        ``_StoreSilent``)."""
        if self.store_silent or self._calls.silent:
            self.store_silent = True
            raise _StoreSilent()
        try:
            return self._calls.call(method, *args)
        except Exception:
            self.store_silent = True
            raise _StoreSilent() from None

    def publish(self, failure: Failure) -> Failure:
        """Publish ``failure`` unless one is published already; returns the one published (the root)."""
        if self.root is not None:
            return self.root
        if not self.shared:
            return failure
        try:
            self.root = Failure.from_json(self._call("compare_set", self.key, "", failure.to_json()))
        except Exception:  # noqa: BLE001 - the store's host is gone: this rank's failure is all there is
            self.root = failure
        return self.root

    def read(self) -> Failure | None:
        """The failure published for this engine, if any (one store round trip)."""
        if self.root is not None or not self.shared:
            return self.root
        try:
            if self._call("check", [self.key]):
                self.root = Failure.from_json(self._call("get", self.key))
        except Exception:  # noqa: BLE001 - the store's host is gone: nothing more can be learnt
            pass
        return self.root

    def stop(self) -> None:
        """``stop_communication()``, once (a second caller waits until the first is done); counts
        this rank among those that read the root cause (rank 0 waits for all of them at exit)."""
        with self._lock:
            if self._stopped:
                return
            self._stopped = True
            stop_communication()
        if not self.shared:
            return
        try:
            self._call("add", self.key + "/read", 1)
        except Exception:  # noqa: BLE001 - the store's host is gone
            return
        if self.hosts_store:
            if not _READERS:
                atexit.register(_wait_for_readers)
            _READERS.append((self, self.key + "/read", self.exit_wait_s))

    def watch(self, timeout_s: float, progress: Callable[[], float], on_timeout: Callable[[float], Failure | None],
              doing: Callable[[], str] = lambda: "", beat_now: bool = False):
        """A watch over one collective call (a context manager): ``progress()`` is the
        ``time.monotonic()`` of the call's last progress, ``on_timeout(seconds)`` this rank's failure
        after ``timeout_s`` without any (None: not a failure yet, and ``progress()`` moved on), ``doing()``
        what this rank runs (its heartbeat says it); ``beat_now``: a heartbeat at the call's start (a
        step: one shorter than a poll is heard too)."""
        if self._watch is None:
            self._watch = Watch(self)
        return self._watch.over(timeout_s, progress, on_timeout, doing, beat_now)

    @property
    def silent_s(self) -> float:
        """A rank whose last heartbeat is older than this has stopped answering (beats come every poll)."""
        return max(2.0, 10 * self.poll_s)

    def beat(self, doing: str) -> None:
        """This rank's heartbeat: now (wall clock) and what it runs."""
        if not self.shared:
            return
        try:
            self._call("set", f"{self.key}/beat/{dist.get_rank()}", json.dumps([time.time(), doing]))
        except Exception:  # noqa: BLE001 - the store's host is gone: the failure path says so
            pass

    def heartbeats(self) -> dict[int, tuple[float, str] | None]:
        """Every rank's last heartbeat (seconds since it, what it ran then), None for a rank never heard
        from since its engine's first collective call."""
        out: dict[int, tuple[float, str] | None] = {}
        now = time.time()
        for rank in range(self.world):
            key = f"{self.key}/beat/{rank}"
            if not self._call("check", [key]):
                out[rank] = None
                continue
            at, doing = json.loads(self._call("get", key))
            out[rank] = (max(0.0, now - at), doing)
        return out

    def silent_peers(self, me: int) -> list[int]:
        """The ranks other than ``me`` whose heartbeat is older than ``silent_s`` (or never came); [0]
        when the store's host does not answer. One store round trip per rank."""
        if not self.shared:
            return []
        try:
            beats = self.heartbeats()
        except _StoreSilent:
            return [0]
        return [r for r, b in beats.items() if r != me and (b is None or b[0] > self.silent_s)]

    def store_note(self, coords: Callable[[int], tuple[int, int, int]]) -> str:
        """When the store's host stopped answering this rank: a sentence naming it (no failure could be
        shared through the store); else empty."""
        if not self.store_silent:
            return ""
        pp, dp, tp = coords(0)
        return (f"rank 0 (pp={pp}, dp={dp}, tp={tp}), which serves the group's store, does not answer "
                f"within {STORE_TIMEOUT_S:g} s: stopped or hung (SIGSTOP, a frozen host, a hung kernel)")

    def silence(self, me: int, coords: Callable[[int], tuple[int, int, int]]) -> str:
        """What the heartbeats say when a wait timed out on rank ``me``: the ranks that stopped
        answering and what each last ran; else (every rank answers) what each runs now."""
        if not self.shared:
            return ""
        try:
            beats = self.heartbeats()
        except _StoreSilent:
            return self.store_note(coords)
        silent = [(r, b) for r, b in beats.items() if r != me and (b is None or b[0] > self.silent_s)]

        def who(r: int) -> str:
            pp, dp, tp = coords(r)
            return f"rank {r} (pp={pp}, dp={dp}, tp={tp})"

        if silent:
            parts = [f"{who(r)} never answered in this engine's collective calls" if b is None else
                     f"{who(r)} has not answered for {b[0]:.0f} s (last heard while running {b[1] or 'a collective call'})"
                     for r, b in silent[:8]]
            more = f" and {len(silent) - 8} more" if len(silent) > 8 else ""
            return "; ".join(parts) + more + ": stopped or hung (SIGSTOP, a frozen host, a hung kernel)"
        running = [f"rank {r}: {b[1] or '-'}" for r, b in sorted(beats.items()) if b is not None][:8]
        return "every rank still answers, each waiting in: " + "; ".join(running)


class _StoreSilent(AutoparError, RuntimeError):
    """The store's host did not answer a heartbeat read in time."""


_WATCHES: "weakref.WeakSet[Watch]" = weakref.WeakSet()
"""The live watches of this process (engines that ran a step), closed at exit."""


def close_watches() -> None:
    """At exit (before the launcher's handler destroys the process group, registered earlier and so
    run later): stop every watch thread, so none is inside a store call while the store goes."""
    for watch in list(_WATCHES):
        watch.close()


def _wait_for_readers() -> None:
    """At exit of the store's host: wait until every rank has read each failure it holds (bounded),
    every rank but those whose heartbeat fell silent (a stopped rank reads nothing until continued)."""
    for board, key, seconds in _READERS:
        end = time.monotonic() + seconds
        expected, asked = board.world, time.monotonic()
        while time.monotonic() < end:
            try:
                if board._call("add", key, 0) >= expected:
                    break
                if time.monotonic() - asked > board.silent_s:  # the ranks that stopped answering read nothing
                    expected, asked = board.world - len(board.silent_peers(dist.get_rank())), time.monotonic()
            except Exception:  # noqa: BLE001
                break
            time.sleep(0.05)


class Watch:
    """The board's watch: one daemon thread, started at the engine's first collective call, that
    every ``poll_s`` during a call (``with board.watch(...):``) reads the board and stops this rank's
    communication when a failure is published, or publishes this rank's timeout when the call has
    made no progress for ``timeout_s``. Every poll, in a call or between calls, it writes this rank's
    heartbeat, so a peer can tell a rank that stopped answering from one busy with its own code. A
    call pays no thread start."""

    def __init__(self, board: FailureBoard) -> None:
        self.board = board
        self.seen: Failure | None = None
        """What the watch found published (a peer's failure, or this rank's timeout)."""
        self._step: tuple[float, Callable[[], float], Callable[[float], Failure | None], Callable[[], str]] | None = None
        """(timeout_s, progress, on_timeout, doing) while a collective call runs."""
        self.last = ""
        """What the last call ran (the heartbeat between calls says it)."""
        self._closing = False
        self._thread = threading.Thread(target=self._run, name="autopar-failure-watch", daemon=True)
        self._thread.start()
        if not _WATCHES:
            atexit.register(close_watches)
        _WATCHES.add(self)

    def close(self) -> None:
        """Stop the thread and wait for it (bounded): at exit, before the process group and its store
        go, so the thread is never inside a store call while they are torn down."""
        self._closing = True
        self._thread.join(timeout=2 * self.board.poll_s + 5.0)

    @contextlib.contextmanager
    def over(self, timeout_s: float, progress: Callable[[], float], on_timeout: Callable[[float], Failure | None],
             doing: Callable[[], str] = lambda: "", beat_now: bool = False):
        if beat_now:
            self.board.beat(doing())
        self._step = (timeout_s, progress, on_timeout, doing)
        try:
            yield self
        finally:
            self._step = None
            with contextlib.suppress(Exception):  # noqa: BLE001 - read while the call's state is dropped
                self.last = doing()

    def _run(self) -> None:
        try:
            while self.seen is None and not self._closing:
                time.sleep(self.board.poll_s)
                step = self._step
                if self._closing:
                    continue
                if step is None:
                    self.board.beat(f"its own code between the engine's calls (after {self.last or 'none'})")
                    continue
                timeout_s, progress, on_timeout, doing = step
                self.board.beat(doing())
                seen = self.board.read()
                idle = time.monotonic() - progress()
                if seen is None and idle > timeout_s and self._step is step:
                    own = on_timeout(idle)
                    if own is not None:
                        seen = self.board.publish(own)
                if seen is not None:
                    self.seen = seen
                    self.board.stop()
                    self._end_if_stuck(step, seen)
        except Exception:  # noqa: BLE001 - the process is tearing its groups down: the step's own error tells
            return

    def _end_if_stuck(self, step, seen: Failure) -> None:
        """After this rank's communication was stopped for ``seen``: the call ``step`` ends at once
        (its collectives fail), or once its own work is done, unless it waits on the store whose host
        stopped answering (a new process group's rendezvous), which no stop reaches and which never
        returns. Then, ``STUCK_EXIT_S`` later, the process ends (exit code 1) with the failure on stderr,
        as NCCL's watchdog ends a rank whose collective timed out, instead of waiting forever."""
        end = time.monotonic() + STUCK_EXIT_S
        while self._step is step and not self._closing:
            if time.monotonic() > end and self.board.store_silent:
                _, _, _, doing = step
                rank = dist.get_rank() if dist.is_initialized() else 0
                sys.stderr.write(f"[rank {rank}] autopar: {seen.headline()}\n[rank {rank}] autopar: this rank's "
                                 f"call ({doing()}) did not end {STUCK_EXIT_S:g} s after its communication was "
                                 f"stopped (it waits where stopping cannot reach it, such as a store whose host "
                                 f"stopped answering): the process exits\n")
                sys.stderr.flush()
                os._exit(1)
            time.sleep(self.board.poll_s)
