"""A collective call's failure as one error on every rank: ``ActionError`` naming the rank and what it ran.

An action that raises is re-raised as ``ActionError`` naming the rank, its
(pp, dp, tp) coordinates and the action, with the schedule grid around it (the
action marked ``[..]``). With peers, the failure is published on the engine's
failure board (``failure_board.py``), this rank's communication is stopped, and
every rank raises the same root cause; a failed engine refuses further steps
(``EngineFailedError``). ``StepFailures`` keeps the board and whether the engine
failed.

Every collective call of the engine runs under the board's watch, through one
mechanism (``_watch_over``): a step (``together``, its actions and phases as
the clock of progress) and every other call (``watched``: the gradient norm and
clipping, the optimizer's step, a save and the wait for an asynchronous one, a
load, the parameters' all-gathers, the exports). So a peer that stops answering
anywhere is found within ``engine.failure_timeout_s`` by the ranks waiting for
it, named by its silent heartbeat, and every rank raises that root cause.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING

from autopar.core.errors import AutoparError
from autopar.core.mesh import Mesh
from autopar.runtime.engine.errors import ActionError
from autopar.runtime.engine.failure_board import EngineFailedError, Failure, FailureBoard

if TYPE_CHECKING:
    from autopar.runtime.engine.step_state import StepState
    from autopar.schedules import Schedule

__all__ = ["StepFailures"]


class StepFailures:
    """One engine's failure board and whether (and where) one of its steps failed."""

    def __init__(self, board: FailureBoard, mesh: Mesh) -> None:
        self.board = board
        """Where this engine's ranks publish a step's failure."""
        self.mesh = mesh
        self.stage = mesh.pp_rank
        self.failed: tuple[int, str, Failure] | None = None
        """(step number, the call's kind, root cause) once a collective call failed with peers: the
        engine's calls are refused."""
        self._inside = False
        """A watched call runs (a call inside it adds no watch of its own)."""

    def refuse_if_failed(self, what: str, steps: int, read_board: bool = False) -> None:
        """``EngineFailedError`` when a step of this engine failed, here or (``read_board``: one store
        round trip) on a peer: its state is inconsistent and its communication stopped. ``steps``:
        the steps the engine started so far."""
        if self.failed is None and read_board:
            root = self.board.read()
            if root is not None:  # a peer failed after this rank's last exchange with it
                self.board.stop()
                self.failed = (steps, root.kind, root)
        if self.failed is None:
            return
        number, kind, root = self.failed
        pp, dp, tp = self.mesh.shape.coords(self.mesh.rank)
        raise EngineFailedError(
            f"this engine failed at step {number} ({kind}) on rank {self.mesh.rank} (pp={pp}, dp={dp}, tp={tp}): "
            f"{root.headline()}; its state is inconsistent (sends in flight, partial gradients, peers stopped) "
            f"and its process groups are stopped, so {what} is refused: restart the job and restore the last "
            f"checkpoint with a new engine", root)

    @contextlib.contextmanager
    def together(self, st: "StepState", timeout_s: float) -> Iterator[Callable[[], bool]]:
        """Around a step's communicating part: with peers, a watch reads the failure board (and
        bounds a wait by ``timeout_s`` without progress: an action or phase that does not end); a
        failure outside the actions is published like an action's; a failure a peer published is
        raised at the step's end if this rank saw none."""
        with self._watch_over(timeout_s, lambda: st.progress, lambda: self.doing(st),
                              lambda e: self.own_failure(st, list(st.at), e), st.schedule, is_step=True) as stopped:
            yield stopped

    @contextlib.contextmanager
    def watched(self, what: str, step: int, timeout_s: float, patient: bool = False) -> Iterator[Callable[[], bool]]:
        """Around a collective call outside the steps (``what``: ``clip_grad_norm_``, ``save of step-4``...;
        ``step``: the engine's steps so far), under the same watch as a step: a wait longer than
        ``timeout_s`` fails this rank naming the silent peers; ``patient`` (a save, a load: writing and
        reading take what they take) fails it only once a peer stopped answering. A failure a peer
        published, or a communication error, becomes this rank's ``ActionError`` with the root cause;
        the project's own errors (a ``CheckpointError`` every rank raises alike, ``NonFiniteError``)
        pass unchanged while nothing was published. Yields ``stopped()``: whether this rank's
        communication was stopped for a failure (a wait on a thread can give up then). Inside another
        watched call (a save waiting for the one in flight) it adds nothing."""
        clock = [time.monotonic()]
        where = f"after step {step}" if step else "before the first step"

        def own(e: BaseException | None) -> Failure:
            error = "" if e is None else f"{type(e).__name__}: {e}"
            return Failure(self.mesh.rank, self.mesh.shape.coords(self.mesh.rank), what, where, error, step, what)

        with self._watch_over(timeout_s, lambda: clock[0], lambda: f"{what} ({where})", own,
                              patient=clock if patient else None) as stopped:
            yield stopped

    @contextlib.contextmanager
    def _watch_over(self, timeout_s: float, progress: Callable[[], float], doing: Callable[[], str],
                    own: Callable[[BaseException | None], Failure], schedule: "Schedule | None" = None,
                    is_step: bool = False, patient: list[float] | None = None) -> Iterator[Callable[[], bool]]:
        """The watch over one collective call (a step, or ``watched``'s): ``progress()`` the time of its
        last progress, ``doing()`` its heartbeat, ``own(e)`` this rank's failure raising ``e`` (None: a
        timeout's, filled in here); ``schedule`` marks a step's actions; ``is_step``: every exception is a
        failure, and one board read when the step ended well (a peer may fail after its last exchange with
        this rank; a later call's watch finds it otherwise); ``patient``: the
        call's clock, moved on at a timeout while every peer still answers."""
        if not self.board.shared or self._inside:
            yield lambda: self.board.stopped
            return
        me, coords = self.mesh.rank, self.mesh.shape.coords

        def on_timeout(idle: float) -> Failure | None:
            if patient is not None and not self.board.silent_peers(me):
                patient[0] = time.monotonic()  # slow, not stopped: every rank still answers
                return None
            return own(TimeoutError(f"no progress for {idle:.0f} s (engine.failure_timeout_s = {timeout_s:g} s): "
                                    f"a peer stopped communicating, or this rank's work hangs; "
                                    + self.board.silence(me, coords)))

        self._inside = True
        try:
            with self.board.watch(timeout_s, progress, on_timeout, doing, beat_now=is_step) as watch:
                yield lambda: self.board.stopped
            if watch.seen is not None or (is_step and self.board.read() is not None):
                raise self.error(own(None), None, schedule)
        except ActionError:
            raise
        except Exception as e:
            if (isinstance(e, AutoparError) and not is_step and not self.board.stopped
                    and self.board.read() is None and not self.board.store_silent):
                raise  # the project's own error, raised alike on every rank: not a failure of the engine
            raise self.error(own(e), e, schedule) from e
        finally:
            self._inside = False

    def doing(self, st: "StepState") -> str:
        """What this rank runs now, for its heartbeat: ``F0.1 (stage 0, step 3 of the step 7)``."""
        try:
            own = self.own_failure(st, list(st.at), None)
        except Exception:  # noqa: BLE001 - read from the watch thread while the step moves on
            return ""
        return f"{own.what}{f' ({own.where})' if own.where else ''} of {own.kind} {own.step}"

    def own_failure(self, st: "StepState", steps: list[int], e: BaseException | None) -> Failure:
        """This rank's failure: at ``steps`` of its action list (or in ``st.phase``), raising ``e``."""
        actions = [st.schedule.actions[self.stage][t] for t in steps]
        if actions:
            what = " ".join(map(str, actions))
            where = f"stage {self.stage}, " + (f"step {steps[0]}" if len(steps) == 1
                                                else f"steps {steps[0]}..{steps[-1]}")
            if st.waiting_for:
                where += f", waiting for {st.waiting_for}"
        else:
            what, where = st.phase, ""
        error = "" if e is None else f"{type(e).__name__}: {e}"
        return Failure(self.mesh.rank, self.mesh.shape.coords(self.mesh.rank), what, where, error, st.number,
                       st.kind, tuple((self.stage, t) for t in steps))

    def failure(self, e: Exception | None, steps: list[int], st: "StepState") -> ActionError:
        """``e`` with context: the rank, its coordinates, the action(s) at ``steps`` (indices in this
        stage's action list of ``st.schedule``; none: ``st.phase``) and the schedule grid around them,
        marked (``error``). ``e`` None: a peer's failure seen at the step's end."""
        return self.error(self.own_failure(st, steps, e), e, st.schedule)

    def error(self, own: Failure, e: BaseException | None, schedule: "Schedule | None" = None) -> ActionError:
        """This rank's failure ``own`` (raising ``e``; None: a peer's seen at the call's end) as the error
        every rank raises: with peers, ``own`` is published (unless a failure is already: that one is
        the root cause, and this rank says where it saw it), this rank's communication is stopped so
        that none of its peers keeps waiting on it, and the engine refuses further calls. With a
        ``schedule``, the grid around the failing actions, marked. A store that stopped answering (its
        host, rank 0, stopped) is named: no root cause could be shared through it."""
        root = own
        if self.board.shared:
            root = self.board.publish(own) if e is not None else (self.board.read() or own)
            self.board.stop()
            self.failed = (own.step, own.kind, root)
        pp, dp, tp = own.coords
        if root == own:
            message = own.headline(marked=True)
        else:
            step = own.kind in ("train_step", "eval_step")
            seen = (("at the end of its step" if step else f"at the end of {own.what}") if e is None and not own.marks
                    else f"while running {own.what}{f' ({own.where})' if own.where else ''}")
            first_line = own.error.splitlines()[0][:300] if own.error else ""
            message = (f"{root.headline(marked=root.kind == own.kind)}\nseen from rank {own.rank} "
                       f"(pp={pp}, dp={dp}, tp={tp}) {seen}{f': {first_line}' if first_line else ''}")
        note = self.board.store_note(self.mesh.shape.coords) if self.board.shared else ""
        if note and note not in message:
            message += f"\nno failure could be shared: {note}"
        marks = list(own.marks) + (list(root.marks) if root != own and root.kind == own.kind else [])
        if marks and schedule is not None:
            ts = [t for _, t in marks]
            message += "\n" + schedule.format_grid(marks, columns=(min(ts) - 8, max(ts) + 9))
        actions = [schedule.actions[self.stage][t] for _, t in own.marks] if schedule is not None else []
        return ActionError(message, self.mesh.rank, own.coords, actions, own.marks,
                           root if self.board.shared else None)
