"""Pipeline schedules as plain data: generate, lower, validate, simulate.

One job per file:

- ``actions.py``: ``Action`` (F, B, W, sends, receives) and its text form (``SF2.0>3``);
- ``placement.py``: where chunks live (interleaved ``c % p``, or ZB-V's V); ``chunk_placement``;
- ``schedule.py``: ``Schedule``, per stage the ordered actions of one step; ``parse_grid``;
- ``grid.py``: the rank x time grid a schedule prints as, and reads back from;
- ``dependencies.py``: who needs whom (producers, send/receive partners);
- ``in_flight.py``: activations held at once: warm-up counts, bounds, peaks;
- ``generators.py``: GPipe, 1F1B and interleaved 1F1B, ``generate`` (any name), and
  ``forward_only`` (evaluation) of any;
- ``zero_bubble.py``: ZB-H1 and ZB-V, whose backwards split into B and W;
- ``lowering.py``: ``lower``, the sends and receives of every cross-stage dependency;
- ``early_receives.py``: ``receives_early``, each receive of a lowered schedule moved to the earliest
  batch it can join without a deadlock;
- ``checks.py`` and ``validation.py``: the rules, and ``validate``;
- ``events.py``: ``Event``, one action of one rank in time (simulated or measured);
- ``simulator.py``: the one simulator, parameterised by how sends behave, and ``dry_run``.
"""

from autopar.core.config import SCHEDULE_NAMES, SPLIT_BACKWARD_SCHEDULES
from autopar.schedules.actions import Action, Kind, Time
from autopar.schedules.events import Event
from autopar.schedules.generators import (
    forward_only,
    generate,
    gpipe,
    interleaved_1f1b,
    one_f_one_b,
    zero_bubble_h1,
    zero_bubble_v,
)
from autopar.schedules.in_flight import in_flight_bound, num_warmup, peak_in_flight
from autopar.schedules.lowering import lower
from autopar.schedules.early_receives import receives_early
from autopar.schedules.chunk_placement import Placement, chunk_placement
from autopar.schedules.errors import ScheduleError
from autopar.schedules.schedule import Schedule, parse_grid
from autopar.schedules.simulator import DryRun, Sends, SimResult, dry_run, simulate
from autopar.schedules.validation import validate

__all__ = [
    "Kind", "Action", "Schedule", "ScheduleError", "DryRun", "Time", "SCHEDULE_NAMES", "num_warmup", "gpipe",
    "one_f_one_b", "interleaved_1f1b", "generate", "lower", "validate", "dry_run", "peak_in_flight", "parse_grid",
    "Event", "Sends", "SimResult", "simulate", "in_flight_bound", "forward_only", "SPLIT_BACKWARD_SCHEDULES",
    "zero_bubble_h1", "zero_bubble_v", "Placement", "chunk_placement", "receives_early",
]
