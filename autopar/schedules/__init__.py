"""Pipeline schedules as plain data: generate, lower, validate, dry-run (``schedule.py``)."""

from autopar.core.config import SCHEDULE_NAMES
from autopar.schedules.schedule import (
    Action,
    DryRun,
    Kind,
    Schedule,
    ScheduleError,
    Time,
    dry_run,
    generate,
    gpipe,
    interleaved_1f1b,
    lower,
    num_warmup,
    one_f_one_b,
    parse_grid,
    peak_in_flight,
    validate,
)

__all__ = [
    "Kind", "Action", "Schedule", "ScheduleError", "DryRun", "Time", "SCHEDULE_NAMES", "num_warmup", "gpipe",
    "one_f_one_b", "interleaved_1f1b", "generate", "lower", "validate", "dry_run", "peak_in_flight", "parse_grid",
]
