"""The planning floor: what a 3D-parallel layout of a model will cost, before anything runs,
which layout to run, and how a measured run compares with its prediction.

Four rooms, each importing only those above it in this list (and ``core``, ``schedules``):

- ``cost/``: the cost model, a layout's iteration time, throughput and memory from the
  model's shapes, the hardware's data sheet and two fitted constants (``estimate``);
- ``search/``: the planner (every layout ranked, why one beats another), how robust a choice
  is (flip points), two layouts' terms side by side, the paper's layout comparisons;
- ``measured/``: a trace the runtime wrote, read back, its per-action costs, and its steps
  against the same schedule simulated with those costs;
- ``drawing/``: timelines in the terminal and as SVG, a measured step above its prediction,
  and tables that never cut a number.

``errors.py`` holds ``PlanError``, what each room raises when it refuses its input. Every
room's ``__init__`` only says what it offers: import from the files themselves.
"""
