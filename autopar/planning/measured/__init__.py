"""A measured run beside its prediction.

- ``trace_reader.py``: ``read_trace``, the run a trace ``engine.write_trace`` wrote holds
  (its version and fields: ``autopar.schedules.trace_format``);
- ``action_costs.py``: per-action costs from a run's events, the schedule simulator's inputs;
- ``comparison.py``: ``compare``, the measured steps against the schedule simulated with their costs.
"""
