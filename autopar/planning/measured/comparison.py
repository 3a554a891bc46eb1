"""A measured run laid beside its prediction: the same step simulated with the run's own costs.

``compare`` takes a ``MeasuredRun`` (``trace_reader.py``), the per-action costs of
its steps after the first (a warm-up: allocator, caches), medians
(``action_costs.py``), simulates the schedule with them (posted sends, as
the runtime runs it), and puts the predicted step time beside the measured
median step (the first action's start to the last action's end over all
ranks). It also simulates each step with that step's own costs (per chunk,
the mean over its microbatches) and replays it (each action its own time): on
a machine shared with other work compute costs drift from step to step and a
rank is now and then descheduled inside one action, and a step compared with
its own costs shows whether the model, not the drift, misses.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import dataclass, replace

from autopar.planning.errors import PlanError
from autopar.planning.measured.action_costs import ActionCosts, Step, action_costs, received_messages
from autopar.planning.measured.trace_reader import MeasuredRun
from autopar.schedules import Event, SimResult

__all__ = ["StepComparison", "Comparison", "compare", "step_time"]


def step_time(step: Step) -> float:
    """A measured step: from the first action's start to the last action's end, over all ranks."""
    return max(e.end for evs in step.values() for e in evs) - min(e.start for evs in step.values() for e in evs)


@dataclass(frozen=True)
class StepComparison:
    """One step: measured, simulated with its own costs (per chunk, means over microbatches),
    and replayed (simulated with each of its actions' own time)."""

    step: int
    measured: float
    predicted: float
    replayed: float

    @property
    def ratio(self) -> float:
        """predicted / measured."""
        return self.predicted / self.measured

    @property
    def replay_ratio(self) -> float:
        """replayed / measured: how well the simulator's model of the schedule (dependencies,
        posted sends, transfers) reproduces the step, costs aside."""
        return self.replayed / self.measured


@dataclass(frozen=True)
class Comparison:
    """A run's measured steps against the simulator fed their costs."""

    run: MeasuredRun
    costs: ActionCosts
    """Medians over the compared steps."""
    prediction: SimResult
    """The schedule simulated with ``costs``."""
    per_step: list[StepComparison]
    """Each compared step, simulated with its own costs."""

    @property
    def measured_step(self) -> float:
        """The median measured step (seconds)."""
        return statistics.median(s.measured for s in self.per_step)

    @property
    def predicted_step(self) -> float:
        """The predicted step from the median costs (seconds)."""
        return float(self.prediction.step_time)

    @property
    def ratio(self) -> float:
        """predicted / measured median step."""
        return self.predicted_step / self.measured_step

    @property
    def per_step_ratio(self) -> float:
        """The median over steps of (step simulated with its own costs) / (step measured)."""
        return statistics.median(s.ratio for s in self.per_step)

    @property
    def replay_ratio(self) -> float:
        """The median over steps of (step replayed with each action's time) / (step measured)."""
        return statistics.median(s.replay_ratio for s in self.per_step)

    @property
    def shown_step(self) -> int:
        """The step whose measured time is nearest the median: the one a picture draws."""
        return min(self.per_step, key=lambda s: abs(s.measured - self.measured_step)).step

    def summary(self) -> str:
        """One line: both step times and their ratio."""
        return (f"measured step {self.measured_step * 1e3:.2f} ms (median of {len(self.per_step)} steps), "
                f"predicted {self.predicted_step * 1e3:.2f} ms: predicted / measured = {self.ratio:.3f} "
                f"(each step with its own costs: median {self.per_step_ratio:.3f}; replayed action by action: "
                f"{self.replay_ratio:.3f})")

    def measured_events(self, step: int | None = None) -> dict[int, list[Event]]:
        """Rank -> the events of ``step`` (default: ``shown_step``) from 0 at the step's start,
        each receive's wait split into waiting for the peer (``wait``) and the transfer (``comm``)."""
        events = self.run.steps[self.shown_step if step is None else step]
        zero = min(e.start for evs in events.values() for e in evs)
        split = {(r.rank, r.name): r for r in received_messages(events, self.run.shape,
                                                                 self.run.schedule.chunk_stages)}
        out: dict[int, list[Event]] = {}
        for rank, evs in events.items():
            out[rank] = [replace(x, start=x.start - zero, end=x.end - zero)
                         for e in evs for x in _split_wait(e, split.get((rank, e.name)))]
        return out

    def predicted_events(self) -> dict[int, list[Event]]:
        """Rank -> the predicted events of its stage (every rank of a stage runs the same)."""
        stage_of = [self.run.shape.coords(r)[0] for r in range(self.run.shape.world)]
        return {r: [replace(e, rank=r) for e in self.prediction.events[s]] for r, s in enumerate(stage_of)}


def _split_wait(e: Event, received) -> list[Event]:
    """A receive's wait as (waiting for the peer, transfer); any other event unchanged."""
    if e.kind != "wait" or received is None:
        return [e]
    cut = min(max(e.start, received.posted), e.end)
    parts = [Event(e.rank, "wait", e.name, e.start, cut), Event(e.rank, "comm", e.name, cut, e.end)]
    return [x for x in parts if x.end > x.start]


def compare(run: MeasuredRun, warmup: int = 1) -> Comparison:
    """``run``'s steps after the first ``warmup`` ones against the simulator fed their costs."""
    keys = sorted(run.steps)[warmup:]
    if not keys:
        raise PlanError(f"the trace holds {len(run.steps)} step(s) and the first {warmup} are a warm-up: "
                        f"record more training steps (engine.write_trace(path, steps=k) writes the last k)")
    steps: Sequence[Step] = [run.steps[k] for k in keys]
    costs = action_costs(steps, run.shape, run.schedule.chunk_stages)
    per_step = [_compare_step(run, k) for k in keys]
    return Comparison(run, costs, costs.simulate(run.schedule), per_step)


def _compare_step(run: MeasuredRun, k: int) -> StepComparison:
    """Step ``k`` measured, simulated with its own costs (means over its microbatches: a rank
    descheduled inside one action still counts) and replayed with each action's time."""
    step = [run.steps[k]]
    stages = run.schedule.chunk_stages
    medians = action_costs(step, run.shape, stages, average=statistics.fmean).simulate(run.schedule)
    replay = action_costs(step, run.shape, stages, per_microbatch=True).simulate(run.schedule)
    return StepComparison(k, step_time(run.steps[k]), float(medians.step_time), float(replay.step_time))
