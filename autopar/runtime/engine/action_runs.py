"""Running a stage's actions in order: one compute action at a time, communication in runs.

``run_actions`` walks this stage's action list of the step's schedule. A
compute action (F, B, W) runs alone; a run of consecutive communication
actions (SF, RF, SB, RB) adds its operations to one batch that is then posted
at once, so no ordering of pairs can deadlock. Each compute action and each
posted batch becomes an ``Event`` of the step's timeline; an F or B that waited
for a received tensor gets a ``wait`` event (``RF2.0``) and starts when the
tensor was there. A failure is re-raised as the ``ActionError`` that
``StepFailures.failure`` makes of it, naming the action(s) it came from.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from autopar.runtime.engine.step_failures import StepFailures
from autopar.runtime.engine.step_state import CommBatch, StepState
from autopar.runtime.engine.timeline import Event
from autopar.schedules import Action, Kind

__all__ = ["Handlers", "run_actions"]

Handlers = dict[Kind, Callable[[Action, StepState], None]]
"""Action kind -> its handler, called ``handler(action, state)``."""


def run_actions(st: StepState, stage: int, rank: int, handlers: Handlers, post: Callable[[StepState], None],
                failures: StepFailures) -> None:
    """Run ``stage``'s actions of ``st.schedule`` in order, recording each compute action and each
    batch of point-to-point operations (posted by ``post``) in ``st.events``."""
    actions = st.schedule.actions[stage]
    t0 = st.origin = time.perf_counter()
    i = 0
    while i < len(actions):
        j = i + 1
        if actions[i].is_comm:
            while j < len(actions) and actions[j].is_comm:
                j += 1
        start = time.perf_counter() - t0
        st.waits.clear()
        name, kind = _run(st, handlers, post, failures, actions, i, j)
        end = time.perf_counter() - t0
        for waited_from, waited_to in st.waits:
            st.events.append(Event(rank, "wait", "R" + name, waited_from - t0, waited_to - t0))
            start = waited_to - t0
        st.events.append(Event(rank, kind, name, start, end))
        i = j


def _run(st: StepState, handlers: Handlers, post: Callable[[StepState], None], failures: StepFailures,
         actions: list[Action], i: int, j: int) -> tuple[str, str]:
    """Run ``actions[i:j]``: one compute action, or a run of communication actions posted as one
    batch. Returns the event's (name, kind); a failure is re-raised as ``ActionError``."""
    at = st.at = [i]
    st.progress = time.monotonic()
    try:
        if actions[i].is_compute:
            handlers[actions[i].kind](actions[i], st)
            return str(actions[i]), actions[i].kind.value
        st.comm = CommBatch()
        for k in range(i, j):
            at = st.at = [k]
            handlers[actions[k].kind](actions[k], st)
        at = st.at = list(range(i, j))  # posting the batch: it is the run's, not one action's
        post(st)
        return " ".join(map(str, actions[i:j])), "comm"
    except Exception as e:
        raise failures.failure(e, at, st) from e
