"""The named schedules: GPipe, 1F1B (PipeDream-Flush) and Megatron-LM's interleaved 1F1B
(the zero-bubble ZB-H1 and ZB-V are in ``zero_bubble.py``; ``generate`` dispatches to all),
and the forward-only (evaluation) form of any of them.

Each generator emits compute actions only (``lowering.lower`` adds the sends
and receives) and validates what it returns.
"""

from __future__ import annotations

from autopar.core.config import SCHEDULE_NAMES, microbatch_errors
import autopar.schedules.validation as validation
from autopar.schedules.actions import Action, Kind
from autopar.schedules.errors import ScheduleError
from autopar.schedules.in_flight import num_warmup
from autopar.schedules.schedule import Schedule
from autopar.schedules.zero_bubble import zb_h1, zb_v

__all__ = ["gpipe", "one_f_one_b", "interleaved_1f1b", "zero_bubble_h1", "zero_bubble_v", "generate",
           "forward_only"]


def _check_layout(name: str, p: int, v: int, m: int) -> None:
    errs = microbatch_errors(name, p, v, m)
    if errs:
        raise ScheduleError("; ".join(errs))


def _checked(schedule: Schedule) -> Schedule:
    validation.validate(schedule)
    return schedule


def _interleave(forwards: list[Action], backwards: list[Action], warmup: int) -> list[Action]:
    """Warm-up forwards, then alternate one forward and one backward, then cool-down backwards."""
    steady = len(forwards) - warmup
    order = forwards[:warmup]
    for k in range(steady):
        order += [forwards[warmup + k], backwards[k]]
    return order + backwards[steady:]


def gpipe(p: int, m: int, v: int = 1) -> Schedule:
    """GPipe: every forward, then every backward.

    Stage ``r`` visits its chunks ``r, r+p, ..`` in order for the forwards and
    in reverse for the backwards, all ``m`` microbatches per chunk
    (chunk-major). With ``L = (v-1) max(m, p) + m + p - 1`` steps per phase the
    makespan is ``L (t_f + t_b)`` against ``v m (t_f + t_b)`` of work, so

        bubble = ((p - 1) + (v - 1) max(p - m, 0)) / (v m)

    which is ``(p-1)/m`` for ``v = 1`` and ``(p-1)/(v m)`` for ``m >= p``.
    Every stage holds all ``v m`` activations at the peak.
    """
    _check_layout("gpipe", p, v, m)
    actions = {}
    for r in range(p):
        chunks = [r + k * p for k in range(v)]
        forwards = [Action(Kind.F, c, i) for c in chunks for i in range(m)]
        backwards = [Action(Kind.B, c, i) for c in reversed(chunks) for i in range(m)]
        actions[r] = forwards + backwards
    return _checked(Schedule("gpipe", p, v, m, actions))


def one_f_one_b(p: int, m: int) -> Schedule:
    """PipeDream-Flush (1F1B), ``m >= p``.

    Stage ``r`` runs ``w_r = min(p - r - 1, m)`` warm-up forwards, then
    ``m - w_r`` pairs (forward ``w_r + k``, backward ``k``), then ``w_r``
    cool-down backwards. Bubble ``(p-1)/m`` as GPipe, but stage ``r`` holds at
    most ``p - r`` activations instead of ``m``.
    """
    _check_layout("1f1b", p, 1, m)
    actions = {}
    for r in range(p):
        forwards = [Action(Kind.F, r, i) for i in range(m)]
        backwards = [Action(Kind.B, r, i) for i in range(m)]
        actions[r] = _interleave(forwards, backwards, num_warmup("1f1b", p, 1, m, r))
    return _checked(Schedule("1f1b", p, 1, m, actions))


def _megatron_chunk(k: int, p: int, v: int, forward: bool) -> tuple[int, int]:
    """(local chunk, microbatch) of a stage's k-th forward or backward.

    Megatron-LM's ``get_model_chunk_id``: virtual microbatches go in groups of
    ``p`` per chunk, ``k mod (p v) // p`` is the local chunk (reversed for
    backwards) and microbatch ``(k // (p v)) p + k mod p``.
    """
    local = (k % (p * v)) // p
    if not forward:
        local = v - 1 - local
    return local, (k // (p * v)) * p + k % p


def interleaved_1f1b(p: int, v: int, m: int) -> Schedule:
    """Megatron-LM's interleaved 1F1B: ``v`` chunks per stage, ``m % p == 0``.

    Stage ``r`` owns chunks ``r, r+p, .., r+(v-1)p``; its k-th forward/backward
    visits the chunk chosen by :func:`_megatron_chunk`. Warm-up
    ``w_r = min(2 (p-r-1) + (v-1) p, v m)`` forwards, then alternate, then
    cool down. Bubble ``(p-1)/(v m)``: ``v`` times smaller than 1F1B for ``v``
    times the point-to-point messages. (That is the compute-only dry run; a
    runtime that blocks on each batch of exchanges, sends included, loses part
    of it when ``t_b != t_f``; autopar's does not block on sends, see the
    ``posted`` sends of ``autopar.schedules.simulator``.)
    """
    _check_layout("interleaved", p, v, m)
    actions = {}
    for r in range(p):
        steps = [
            (_megatron_chunk(k, p, v, True), _megatron_chunk(k, p, v, False)) for k in range(v * m)
        ]
        forwards = [Action(Kind.F, local * p + r, i) for (local, i), _ in steps]
        backwards = [Action(Kind.B, local * p + r, i) for _, (local, i) in steps]
        actions[r] = _interleave(forwards, backwards, num_warmup("interleaved", p, v, m, r))
    return _checked(Schedule("interleaved", p, v, m, actions))


def zero_bubble_h1(p: int, m: int) -> Schedule:
    """ZB-H1 (``zero_bubble.py``): 1F1B with split backwards whose W's fill the cool-down, ``m >= p``.
    Idle time ``(p-1)(t_f + t_b - 2 t_w)`` per stage (``t_b`` the whole backward), 1F1B's peak memory."""
    _check_layout("zb-h1", p, 1, m)
    return _checked(zb_h1(p, m))


def zero_bubble_v(p: int, m: int) -> Schedule:
    """ZB-V (``zero_bubble.py``): two chunks per stage in a V, split backwards, ``m >= p``.
    Idle time ``(p-1) t_f`` per stage (chunk costs, F = B = W) once ``m >= (3p - 1) / 2``; 1F1B's peak memory."""
    _check_layout("zbv", p, 2, m)
    return _checked(zb_v(p, m))


def generate(name: str, p: int, v: int, m: int) -> Schedule:
    """Dispatch by name: 'gpipe', '1f1b' (needs v = 1), 'interleaved', 'zb-h1' (v = 1) or 'zbv' (v = 2)."""
    if name == "gpipe":
        return gpipe(p, m, v)
    if name == "interleaved":
        return interleaved_1f1b(p, v, m)
    one_chunk = {"1f1b": one_f_one_b, "zb-h1": zero_bubble_h1, "zbv": zero_bubble_v}
    if name in one_chunk:
        _check_layout(name, p, v, m)
        return one_chunk[name](p, m)
    raise ScheduleError(f"unknown schedule {name!r}; known: {', '.join(SCHEDULE_NAMES)}")


def forward_only(schedule: Schedule) -> Schedule:
    """The evaluation form of a compute-only training schedule: every stage runs its forwards in
    the order ``schedule`` runs them, and no backward.

    One F per (chunk, microbatch) and nothing kept for a backward, so the stage moves from one
    forward straight to the next. Keeping the training order keeps the training schedule's
    buffering of received activations (Megatron-LM's forward-only pass visits the chunks in
    the same order): chunk-major for GPipe, groups of ``p`` microbatches per chunk for
    interleaved 1F1B. With unit forwards the step takes

        (v - 1) max(m, p) + m + p - 1

    slots: ``m + p - 1`` for ``v = 1`` (a stage starts ``r`` slots late), ``v m + p - 1`` for
    ``m >= p``, so the bubble is ``(p - 1) / (v m)`` as in training. The result keeps the
    schedule's name and is marked ``forward_only``; ``lowering.lower`` adds its sends and
    receives.
    """
    if schedule.is_lowered:
        raise ScheduleError(f"schedule {schedule.name!r} is lowered: give its compute-only form, "
                         "and lower the forward-only schedule afterwards")
    if schedule.forward_only:
        raise ScheduleError(f"schedule {schedule.name!r} is already forward-only")
    actions = {s: [a for a in acts if a.kind is Kind.F] for s, acts in schedule.actions.items()}
    return _checked(Schedule(schedule.name, schedule.p, schedule.v, schedule.m, actions, forward_only=True,
                             placement=schedule.placement))
