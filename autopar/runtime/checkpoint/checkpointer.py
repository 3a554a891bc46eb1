"""Save and load an engine's training state with ``torch.distributed.checkpoint`` (DCP).

``engine.save(root, optimizer, step=N, ...)`` and ``engine.load(path, optimizer, ...)``
call ``Checkpointer.save`` and ``Checkpointer.load``. Collective: every rank
calls them. What is stored (``docs/training.md``, "Checkpoints"):

- every parameter in its full, unpadded shape as in the user's model, each rank
  writing its shard's pieces at their global offsets (``model_state``),
  so a program of any layout (tp, pp, v, dp) reads the pieces that overlap its
  own shards: DCP reshards on load;
- the optimizer's state by parameter name, resharded with the parameters, and
  its hyperparameters (``optimizer_state``; a distributed optimizer's under the
  same keys, each replica writing its own ranges: ``sharded_optimizer_state``);
  the LR scheduler's state;
- the engine's random streams (dropout continues identically after a resume at
  the same layout), the persistent buffers, the step and a user dict ``extra``.

A save writes into ``step-N.partial/`` and becomes ``step-N/`` and ``latest``
only once every rank finished (``description``); an asynchronous save
copies the state to host memory and returns while DCP writes in a thread.
A save is refused, before anything is written, when a parameter is not finite.
A save that fails writing on any rank (a full disk, an I/O error, a file size
limit) fails on every rank (DCP gathers each rank's result): ``SaveHandle.wait``
raises ``CheckpointError`` naming the directory and each rank's error, rank 0
removes the partial directory, and ``latest`` names the previous checkpoint;
an asynchronous save's failure is raised at the engine's next call
(``report_failed_save``).
A load checks the checkpoint against the program before reading anything, and
every rank fails together on a problem any rank finds (``checks``); DCP's
metadata is read as data, never as code (``safe_metadata``).

The checkpoint's collectives run over a process group of their own (gloo: DCP
exchanges Python objects, and an asynchronous save's thread must not interleave
its collectives with training's on the same group).
"""

from __future__ import annotations

import contextlib
import io
import re
import shutil
import time
import warnings
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

from autopar.core.mesh import group_over
from autopar.runtime.checkpoint.checks import (agree, nonfinite_param_errors, param_errors, read_metadata,
                                               target_errors, truncation_errors)
from autopar.runtime.checkpoint.dcp import HostStager, PieceLoadPlanner, PieceSavePlanner
from autopar.runtime.checkpoint.description import (
    LATEST,
    CheckpointError,
    clear_partial,
    read_description,
    resolve,
    save_errors,
)
import autopar.runtime.checkpoint.optimizer_state as optimizer_state
from autopar.runtime.checkpoint.publishing import PublishingWriter
from autopar.runtime.checkpoint.safe_metadata import SafeReader
import autopar.runtime.checkpoint.sharded_optimizer_state as sharded_optimizer_state
from autopar.runtime.checkpoint.model_state import (
    buffer_entries,
    describe,
    model_entries,
    restore_rng,
    rng_entries,
    rng_targets,
    same_streams,
)
from autopar.runtime.optim.distributed_optimizer import DistributedOptimizer

_SINGLE_PROCESS_NOTE = (r"torch\.distributed is (disabled, )?unavailable or uninitialized, assuming the intent is to "
                        r"(save|load) in a single process")

__all__ = ["Checkpointer", "SaveHandle", "CheckpointError"]

GIVE_UP_S = 2.0
"""How long ``SaveHandle.wait`` still waits for the save's thread once this rank's communication was
stopped for a failure (its collectives fail then, so it ends at once)."""
_WRITING: list = [None]
"""The process's asynchronous save still writing over the checkpoints' group, whichever engine started it."""


@contextlib.contextmanager
def _unwatched(what: str, patient: bool = False) -> Iterator[Callable[[], bool]]:
    """No failure watch (a save without an engine's): yields ``stopped()``, always False."""
    yield lambda: False


class SaveHandle:
    """A save: ``path`` is where the checkpoint is visible once ``wait()`` returns.

    ``partial`` is where the ranks write until then; on rank 0 (``removes_partial``) a save that
    failed on a rank which reported it (every rank done) removes it, so that no half-written
    directory is left beside the checkpoints."""

    def __init__(self, path: Path, future: Future, partial: Path, removes_partial: bool = False,
                 watched: Callable[..., contextlib.AbstractContextManager] = _unwatched) -> None:
        self.path = path
        """``ROOT/step-N``: complete once the save is done."""
        self.partial = partial
        """``ROOT/step-N.partial``: where the ranks write."""
        self._future = future
        self._removes_partial = removes_partial
        self.settled = False
        """Every rank's save finished successfully (``Checkpointer.report_failed_save`` stops asking)."""
        self._watched = watched

    def done(self) -> bool:
        """Whether the save finished (successfully or not)."""
        return self._future.done()

    def failed(self) -> bool:
        """Whether the save finished with an error (``wait()`` raises it)."""
        return self._future.done() and self._future.exception() is not None

    def wait(self) -> Path:
        """Block until the checkpoint is visible on every rank; raise ``CheckpointError`` if the save
        failed (on every rank: DCP fails a save on all ranks when one fails).

        Under the engine's failure watch (``StepFailures.watched``, patient: writing takes what it
        takes): a peer that stops answering while the save's thread waits for it in DCP's collectives
        fails the wait on every rank, naming it. Once this rank's communication is stopped for a failure,
        the wait gives up after ``GIVE_UP_S`` even if the save's thread has not returned."""
        with self._watched(f"the wait for the save of {self.path.name}", patient=True) as stopped:
            stopped_at = None
            while True:
                try:
                    self._future.result(timeout=0.25)
                    break
                except FutureTimeout:
                    if stopped() and stopped_at is None:
                        stopped_at = time.monotonic()
                    if stopped_at is not None and time.monotonic() - stopped_at > GIVE_UP_S:
                        raise CheckpointError(f"saving checkpoint {self.path}: this rank's communication was stopped "
                                              f"for a failure and the save's thread did not end within "
                                              f"{GIVE_UP_S:g} s; {self.partial} is left as it is (never loaded)") from None
                except (Exception, CheckpointException) as e:  # noqa: BLE001 - DCP's is a BaseException
                    raise CheckpointError(self._failure(e)) from e
        return self.path

    def _failure(self, e: BaseException) -> str:
        """What failed, where, and what is left: nothing published; the partial directory removed when
        DCP heard from every rank (a ``CheckpointException``: none still writes), else left and named."""
        every_rank_reported = isinstance(e, CheckpointException)
        removed = _remove(self.partial) if self._removes_partial and every_rank_reported else None
        latest = self.path.parent / LATEST
        previous = latest.read_text().strip() if latest.is_file() else None
        if self.path.is_dir():  # published, but 'latest' was not replaced
            left = f"{self.path} was written but {latest} still names {previous!r}"
        elif previous:
            left = f"nothing was published: {latest} still names {previous}, which loads as before"
        else:
            left = "nothing was published (no earlier checkpoint under this root)"
        if not every_rank_reported:  # a rank died or stopped answering: it may still be writing there
            cleaned = (f"; {self.partial} is left as it is (not every rank reported; it is never loaded, and a "
                       f"new save of this step replaces it)")
        elif removed:
            cleaned = f"; the partial directory could not be removed ({removed}): remove it"
        else:
            cleaned = "; its partial directory is removed by rank 0"
        return (f"saving checkpoint {self.path} failed writing into {self.partial}:\n  " + "\n  ".join(_failures(e))
                + f"\n{left}{cleaned}. Fix: free space or repair the file system under {self.path.parent} "
                f"(or save under another root), then save again; training can go on")


def _failures(e: BaseException) -> list[str]:
    """Each rank's error of a failed DCP call, one line each (``rank 1: OSError: [Errno 28] ...``)."""
    if isinstance(e, CheckpointException):
        return [f"rank {rank}: {_problem(failure)}" for rank, (failure, _) in sorted(e.failures.items())]
    return [_problem(e)]


def _remove(directory: Path) -> str | None:
    """Remove ``directory`` if it is there; None, or why it could not be removed."""
    try:
        if directory.exists():
            shutil.rmtree(directory)
    except OSError as e:
        return f"{type(e).__name__}: {e}"
    return None


def _problem(e: BaseException) -> str:
    """An exception as one line of a ``CheckpointError``: ours as they are, others with their type."""
    return str(e) if isinstance(e, CheckpointError) else f"{type(e).__name__}: {e}"


def _optimizer_io(optimizer):
    """How ``optimizer``'s state goes into a checkpoint and back: by range for a distributed optimizer
    (``sharded_optimizer_state``), by shard for any other (``optimizer_state``); the same keys."""
    return sharded_optimizer_state if isinstance(optimizer, DistributedOptimizer) else optimizer_state


def _completed(run) -> Future:
    """A future already holding ``run()``'s result or exception (a synchronous save)."""
    future: Future = Future()
    try:
        future.set_result(run())
    except (Exception, CheckpointException) as e:  # noqa: BLE001 - handed to SaveHandle.wait, which names the checkpoint
        future.set_exception(e)
    return future


class Checkpointer:
    """One engine's checkpoints: their process group and the asynchronous save in flight.

    Made by the ``RankEngine`` at its first save or load over what it reads and writes of
    the engine. Every engine of the process checkpoints over one gloo group (made by the
    first, collectively), so a save or load first waits for the asynchronous save in
    flight, whichever engine started it: two saves never talk over the group at once. ``holdings``
    (``engine.holdings``: the program, mesh, device, shards and feeds) and ``stream``
    (``engine.random_stream``), unannotated because the engine imports this module.
    """

    def __init__(self, holdings, stream, watched: Callable[..., contextlib.AbstractContextManager] = _unwatched) -> None:
        self.holdings = holdings
        self.stream = stream
        self.watched = watched
        """``watched(what, patient)``: the engine's failure watch over a collective call (the wait for an
        asynchronous save runs under it)."""
        self.group = (group_over(range(dist.get_world_size()), backend="gloo", purpose="checkpoints")
                      if dist.is_initialized() else None)
        """All ranks, gloo: only checkpoints talk over it (one group for every engine of the process).
        None in a process without a process group."""
        if self.group is None:  # DCP says it assumes one process; here that is a fact, not news
            warnings.filterwarnings("ignore", message=_SINGLE_PROCESS_NOTE)
        self.pending: SaveHandle | None = None
        """This engine's asynchronous save still writing, waited for before the next save or load."""

    def _rank0(self) -> bool:
        return not dist.is_initialized() or dist.get_rank() == 0

    def wait(self) -> None:
        """Wait for this engine's asynchronous save in flight (raises if it failed), and for
        another engine's that still writes over the shared group."""
        pending, self.pending = self.pending, None
        other, _WRITING[0] = _WRITING[0], None
        if other is not None and other is not pending:
            other.wait()
        if pending is not None:
            pending.wait()

    def unsettled(self) -> bool:
        """An asynchronous save of this engine is not known to have succeeded on every rank
        (``report_failed_save`` asks)."""
        return self.pending is not None and not self.pending.settled

    def report_failed_save(self, device: torch.device) -> None:
        """Raise, on every rank, this engine's asynchronous save if it failed (``CheckpointError``), so
        that a failure is not lost until the next save. Collective while the save is not known to have
        succeeded on every rank: one all-reduce (MAX) of (failed here, still writing here) over the world,
        so that every rank raises at the same call, whichever saw its failure first."""
        handle = self.pending
        if handle is None or handle.settled:
            return
        flags = torch.tensor([int(handle.failed()), int(not handle.done())], dtype=torch.int64, device=device)
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(flags, op=dist.ReduceOp.MAX)
        failed, writing = (int(f) for f in flags.tolist())
        if failed:  # DCP fails the save on every rank: a rank still writing gets the same failure
            self.wait()
        handle.settled = not writing

    # ---------------------------------------------------------------------- save
    def save(self, root: str | Path, optimizer=None, *, step: int, scheduler=None, extra: Any = None,
             async_save: bool = False) -> SaveHandle:
        """Write ``ROOT/step-N`` (see ``RankEngine.save``)."""
        if isinstance(step, bool) or not isinstance(step, int) or step < 0:
            raise CheckpointError(f"step must be a non-negative int (it names ROOT/step-N), got {step!r}")
        self.wait()
        root = Path(root)
        agree(save_errors(root, step) + nonfinite_param_errors(self.holdings, step), self.group,
              f"cannot save step {step} under {root}")  # before anything is written, on every rank
        errors, state, description = [], {}, {}
        try:
            state = self._state(optimizer, scheduler, extra)
            description = describe(self.holdings.program, step)
            if not errors and self._rank0():
                clear_partial(root, step)
        except Exception as e:  # noqa: BLE001 - whatever one rank meets, every rank must hear of it
            errors.append(_problem(e))
        agree(errors, self.group, f"cannot save step {step} under {root}")
        writer = PublishingWriter(root, step, description)
        partial = Path(writer.path)
        if async_save:
            future = dcp.async_save(state, storage_writer=writer, planner=PieceSavePlanner(),
                                    process_group=self.group, async_stager=HostStager())
            self.pending = _WRITING[0] = SaveHandle(writer.final, future, partial, self._rank0(), self.watched)
            return self.pending
        handle = SaveHandle(writer.final, _completed(lambda: dcp.save(
            state, storage_writer=writer, planner=PieceSavePlanner(), process_group=self.group)),
            partial, self._rank0(), self.watched)
        handle.wait()
        return handle

    def _state(self, optimizer, scheduler, extra) -> dict:
        """This rank's DCP state dict: views of its tensors (a synchronous save writes them as they are)."""
        holdings = self.holdings
        state: dict = {**model_entries(holdings), **buffer_entries(holdings, saving=True),
                       **rng_entries(holdings, self.stream)}
        if optimizer is not None:
            state.update(_optimizer_io(optimizer).optimizer_entries(holdings, optimizer))
        if self._rank0():  # the same on every rank: stored once
            state["extra"] = _loadable("extra", extra)
            if scheduler is not None:
                state["scheduler"] = _loadable("the scheduler's state_dict()", scheduler.state_dict())
        return state

    # ---------------------------------------------------------------------- load
    def load(self, path: str | Path, optimizer=None, scheduler=None) -> tuple[int, Any]:
        """Read a checkpoint into the engine (see ``RankEngine.load``); returns (step, extra)."""
        self.wait()
        step_dir, description, metadata = self._open(path)
        targets = self._prepare(optimizer, scheduler, description, metadata, step_dir)
        try:
            dcp.load(targets, storage_reader=SafeReader(step_dir), planner=PieceLoadPlanner(),
                     process_group=self.group)
        except (Exception, CheckpointException) as e:  # noqa: BLE001 - DCP raises the same on every rank
            raise CheckpointError(f"cannot load checkpoint {step_dir}:\n  " + "\n  ".join(_failures(e))) from e
        if optimizer is not None:
            _optimizer_io(optimizer).apply_loaded(self.holdings, optimizer, targets)
        if scheduler is not None:
            scheduler.load_state_dict(targets["scheduler"])
        restore_rng(self.holdings, self.stream, targets, description["step"])
        return description["step"], targets.get("extra")

    def _open(self, path) -> tuple[Path, dict, Any]:
        """The complete checkpoint ``path`` names, its ``autopar.json`` and DCP metadata, checked
        against the program on every rank before anything is read."""
        errors, found = [], (Path(path), {}, None)
        try:
            step_dir = resolve(path)
            found = (step_dir, read_description(step_dir), read_metadata(step_dir))
            errors = truncation_errors(step_dir, found[2]) + param_errors(self.holdings.program, found[2])
        except Exception as e:  # noqa: BLE001 - whatever one rank meets, every rank must hear of it
            errors = [_problem(e)]
        agree(errors, self.group, f"cannot load checkpoint {found[0]}")
        return found

    def _prepare(self, optimizer, scheduler, description: dict, metadata, step_dir: Path) -> dict:
        """Where each value read goes, checked on every rank: the engine's and the optimizer's own
        tensors (DCP writes into them), None for stored objects. On a problem the optimizer is left
        as it was."""
        saved = metadata.state_dict_metadata.keys()
        fresh = []
        try:
            fresh = _optimizer_io(optimizer).initialise_state(optimizer) if optimizer is not None else []
            targets, errors = self._targets(optimizer, scheduler, description, saved)
            errors += target_errors(metadata, targets)
        except Exception as e:  # noqa: BLE001 - whatever one rank meets, every rank must hear of it
            targets, errors = {}, [_problem(e)]
        if errors:
            for p in fresh:
                optimizer.state.pop(p, None)
        agree(errors, self.group, f"cannot load checkpoint {step_dir}")
        return targets

    def _targets(self, optimizer, scheduler, description: dict, saved) -> tuple[dict, list[str]]:
        """(key -> destination, problems): parameters and buffers always; this rank's random stream
        when the checkpoint holds it; the optimizer's state when it fits; the scheduler and extra."""
        holdings = self.holdings
        targets: dict = {**model_entries(holdings), **buffer_entries(holdings, saving=False)}
        if same_streams(holdings, self.stream, description["layout"], saved):
            targets.update(rng_targets(holdings, self.stream))
        io = _optimizer_io(optimizer)
        errors = io.optimizer_errors(holdings, optimizer, saved) if optimizer is not None else []
        if optimizer is not None and not errors:
            targets.update(io.optimizer_targets(holdings, optimizer, saved))
        if scheduler is not None:
            targets["scheduler"] = None
        if "extra" in saved:
            targets["extra"] = None
        return targets, errors


def _loadable(what: str, value: Any) -> Any:
    """``value`` if a load can read it back (``torch.load(weights_only=True)``: tensors, numbers,
    strings, lists, tuples, dicts); else an error naming what holds it, before anything is written."""
    buf = io.BytesIO()
    torch.save(value, buf)
    buf.seek(0)
    try:
        torch.load(buf, weights_only=True)
    except Exception as e:  # noqa: BLE001 - the unpickler names the type it refuses
        found = re.search(r"Unsupported global: GLOBAL ([\w.]+)", str(e))
        kind = found.group(1) if found else f"{type(e).__name__}: {str(e)[:200]}"
        raise CheckpointError(
            f"{what} holds a value a checkpoint cannot load safely ({kind}). Fix: store plain Python values "
            f"(int, float, str, lists, dicts) or tensors, e.g. int(x) for a NumPy integer, "
            f"torch.tensor(a) for an array") from None
    return value
