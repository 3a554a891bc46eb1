"""Choosing a layout with the cost model.

- ``planner.py``: ``search`` over (t, p, d, v, micro-batch, schedule, recomputation, sequence
  parallelism, distributed optimizer), the ``Plan`` it returns, why one layout beats another;
- ``sensitivity.py``: flip points, how far a measured or fitted input would have to move to
  change the ranking;
- ``versus.py``: two layouts' iteration times term by term (``Plan.why()``, ``autopar plan --vs-*``);
- ``paper_comparisons.py``: the paper's measured layout comparisons and the planner's ranking of each.
"""
