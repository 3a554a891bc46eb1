"""Pictures and tables of the planning floor.

- ``timeline.py``: a simulated pipeline step as a terminal timeline and as SVG;
- ``measured_vs_predicted.py``: one SVG, a measured step above its prediction;
- ``tables.py``: rich tables that never cut a number (the plan, the program summary, measured steps).
"""
