"""A step's failure as one error on every rank: ``ActionError`` with the schedule around it.

An action that raises is re-raised as ``ActionError`` naming the rank, its
(pp, dp, tp) coordinates and the action, with the schedule grid around it (the
action marked ``[..]``). With peers, the failure is published on the engine's
failure board (``failure_board.py``), this rank's communication is stopped, and
every rank raises the same root cause; a failed engine refuses further steps
(``EngineFailedError``). ``StepFailures`` keeps the board and whether the engine
failed; the engine calls it around each step's communicating part.
"""

from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING

from autopar.core.mesh import Mesh
from autopar.runtime.engine.errors import ActionError
from autopar.runtime.engine.failure_board import EngineFailedError, Failure, FailureBoard

if TYPE_CHECKING:
    from autopar.runtime.engine.step_state import StepState

__all__ = ["StepFailures"]


class StepFailures:
    """One engine's failure board and whether (and where) one of its steps failed."""

    def __init__(self, board: FailureBoard, mesh: Mesh) -> None:
        self.board = board
        """Where this engine's ranks publish a step's failure."""
        self.mesh = mesh
        self.stage = mesh.pp_rank
        self.failed: tuple[int, str, Failure] | None = None
        """(step number, step kind, root cause) once a step failed with peers: steps are refused."""

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
    def together(self, st: "StepState", timeout_s: float):
        """Around a step's communicating part: with peers, a watch reads the failure board (and
        bounds a wait by ``timeout_s``); a failure outside the actions is published like an
        action's; a failure a peer published is raised at the step's end if this rank saw none."""
        if not self.board.shared:
            yield
            return
        watch = self.board.watch(timeout_s, lambda: st.progress,
                                 lambda idle: self.own_failure(st, st.at, TimeoutError(
                                     f"no progress for {idle:.0f} s (engine.failure_timeout_s = "
                                     f"{timeout_s:g} s): a peer stopped communicating, or "
                                     f"this rank's work hangs; "
                                     + self.board.silence(self.mesh.rank, self.mesh.shape.coords))),
                                 lambda: self.doing(st))
        try:
            with watch:
                yield
            seen = self.board.read()
            if seen is not None:
                raise self.failure(None, [], st)
        except ActionError:
            raise
        except Exception as e:
            raise self.failure(e, list(st.at), st) from e

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
        marked.

        With peers: the failure is published (unless one is already: that one is the root cause,
        and this rank says where it saw it), this rank's communication is stopped so that none of
        its peers keeps waiting on it, and the engine refuses further steps. ``e`` None: a peer's
        failure seen at the step's end."""
        own = self.own_failure(st, steps, e)
        root = own
        if self.board.shared:
            root = self.board.publish(own) if e is not None else (self.board.read() or own)
            self.board.stop()
            self.failed = (st.number, own.kind, root)
        pp, dp, tp = own.coords
        if root == own:
            message = own.headline(marked=True)
        else:
            seen = ("at the end of its step" if e is None and not steps else
                    f"while running {own.what}{f' ({own.where})' if own.where else ''}")
            first_line = own.error.splitlines()[0][:300] if own.error else ""
            message = (f"{root.headline(marked=root.kind == own.kind)}\nseen from rank {own.rank} "
                       f"(pp={pp}, dp={dp}, tp={tp}) {seen}{f': {first_line}' if first_line else ''}")
        marks = list(own.marks) + (list(root.marks) if root != own and root.kind == own.kind else [])
        if marks:
            ts = [t for _, t in marks]
            message += "\n" + st.schedule.format_grid(marks, columns=(min(ts) - 8, max(ts) + 9))
        actions = [st.schedule.actions[self.stage][t] for t in steps]
        return ActionError(message, self.mesh.rank, own.coords, actions, own.marks,
                           root if self.board.shared else None)
