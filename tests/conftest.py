"""Fixtures the tests share; the plain functions behind them are in ``helpers.py``."""

from __future__ import annotations

from collections.abc import Callable

import pytest
from helpers import reference_run


@pytest.fixture(scope="session")
def reference() -> Callable:
    """``reference(key, model, data, **kw)``: the single-device run (``helpers.reference_run``) of
    ``model()`` on ``data()``, computed once per session for each ``key``.

    ``key`` names what determines the model and the data (family, layers,
    seed, ...); ``kw`` (learning rate, loss, clipping) is part of the key too.
    Several tests, and the tp=2 and tp=4 runs of one test, compare with the
    same run without training it again.
    """
    runs: dict = {}

    def run(key, model: Callable, data: Callable, **kwargs):
        full = (key, tuple(sorted(kwargs.items())))
        if full not in runs:
            runs[full] = reference_run(model(), data(), **kwargs)
        return runs[full]

    return run
