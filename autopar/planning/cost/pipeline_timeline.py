"""A layout's pipeline step as a timeline: its per-chunk costs run through the schedule simulator.

The simulator itself is ``autopar.schedules.simulate`` (schedule + costs ->
timeline). This module only turns what the cost model knows about a layout,
uniform per-chunk forward and backward times, the embedding's and the LM
head's extra work on the first and last chunk and the time of one
stage-to-stage message, into cost functions (with the weight-gradient part
``t_w`` of each backward, and the LM head's, for the zero-bubble schedules'
W actions), and picks the schedule and the behaviour of its sends:

- ``eager_timeline``: the compute-only schedule with ``eager`` sends,
  the model the planner ranks layouts with (Megatron-LM 2021: a send blocks
  its sender, reproducing the paper's numbers);
- ``lowered_timeline``: the lowered schedule autopar's runtime
  executes, with ``posted`` sends (non-blocking; only the consumer of a
  received tensor waits). ``autopar simulate`` draws this one.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import lru_cache

from autopar.schedules import Action, Schedule, Sends, SimResult, generate, lower
from autopar.schedules.actions import Key, Loc
from autopar.schedules.dependencies import index
from autopar.schedules.simulator import simulate_checked

__all__ = ["runtime_schedule", "chunk_costs", "weight_costs", "eager_timeline", "lowered_timeline"]


def runtime_schedule(name: str, p: int, v: int, m: int) -> Schedule:
    """The schedule autopar's runtime interprets: ``lower(generate(name, p, v, m))``
    (lowered with its default, equal F and B costs, as ``autopar.parallelize`` does)."""
    return lower(generate(name, p, v, m))


@lru_cache(maxsize=512)
def _checked(name: str, p: int, v: int, m: int, lowered: bool) -> tuple[Schedule, dict[Key, Loc]]:
    """The schedule (``generate``d, or its ``runtime_schedule``), which generation and lowering
    validate, and its action index: made and checked once for every layout the planner prices
    with it, each timeline then only simulated."""
    schedule = runtime_schedule(name, p, v, m) if lowered else generate(name, p, v, m)
    return schedule, index(schedule)


def chunk_costs(p: int, v: int, t_f: float, t_b: float, first_extra: tuple[float, float] = (0.0, 0.0),
                last_extra: tuple[float, float] = (0.0, 0.0)) -> tuple[Callable[[Action], float],
                                                                       Callable[[Action], float]]:
    """(forward cost, backward cost) of an action: ``t_f`` / ``t_b`` per chunk, plus the
    embedding's (forward, backward) on chunk 0 and the LM head's on the last chunk."""
    last = p * v - 1

    def cf(a: Action) -> float:
        return t_f + (first_extra[0] if a.chunk == 0 else 0.0) + (last_extra[0] if a.chunk == last else 0.0)

    def cb(a: Action) -> float:
        return t_b + (first_extra[1] if a.chunk == 0 else 0.0) + (last_extra[1] if a.chunk == last else 0.0)

    return cf, cb


def weight_costs(p: int, v: int, t_w: float | None, last_extra_w: float = 0.0) -> Callable[[Action], float] | None:
    """The W cost of an action: ``t_w`` per chunk plus the LM head's weight gradient on the last
    chunk (the embedding's runs in B); None (half of each backward) when ``t_w`` is None."""
    if t_w is None:
        return None
    last = p * v - 1
    return lambda a: t_w + (last_extra_w if a.chunk == last else 0.0)


def eager_timeline(name: str, p: int, v: int, m: int, t_f: float, t_b: float, comm: float,
                   first_extra: tuple[float, float] = (0.0, 0.0),
                   last_extra: tuple[float, float] = (0.0, 0.0),
                   t_w: float | None = None, last_extra_w: float = 0.0) -> SimResult:
    """Simulate schedule ``name`` with uniform chunk costs (``t_f``, ``t_b``), the
    embedding's (forward, backward) added to chunk 0 and the LM head's to the
    last chunk, and ``comm`` seconds per stage-to-stage message: eager sends,
    the planner's model. ``t_w`` (and the head's ``last_extra_w``): the W part of
    each backward in a zero-bubble schedule (``weight_costs``)."""
    cf, cb = chunk_costs(p, v, t_f, t_b, first_extra, last_extra)
    cw = weight_costs(p, v, t_w, last_extra_w)
    return simulate_checked(*_checked(name, p, v, m, False), cf, cb, comm, Sends.EAGER, cw)


def lowered_timeline(name: str, p: int, v: int, m: int, t_f: float, t_b: float, comm: float,
                     first_extra: tuple[float, float] = (0.0, 0.0),
                     last_extra: tuple[float, float] = (0.0, 0.0),
                     t_w: float | None = None, last_extra_w: float = 0.0) -> SimResult:
    """Like ``eager_timeline``, but running ``runtime_schedule(name, p, v, m)``
    (the lowered schedule autopar's runtime executes) with posted sends."""
    cf, cb = chunk_costs(p, v, t_f, t_b, first_extra, last_extra)
    cw = weight_costs(p, v, t_w, last_extra_w)
    return simulate_checked(*_checked(name, p, v, m, True), cf, cb, comm, Sends.POSTED, cw)
