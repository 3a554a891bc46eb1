"""Fixtures the tests share; the plain functions behind them are in ``helpers.py``."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import helpers
from helpers import reference_run, tiny_gpt_program

import autopar


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


@pytest.fixture(scope="module")
def shared() -> Callable:
    """``shared(key, make)``: ``make()`` once per test module for each ``key``, for what several tests of the
    module only read (a compiled program whose structure they inspect). A test that changes what it gets
    (materialises and trains it, patches it) makes its own instead."""
    made: dict = {}

    def get(key, make: Callable):
        if key not in made:
            made[key] = make()
        return made[key]

    return get


@pytest.fixture
def show(request: pytest.FixtureRequest) -> Callable[[str], None]:
    """``show(text)``: print ``text`` only when output capture is off (``pytest -s``): the numbers behind an
    assertion, for a reader, without cluttering a normal run."""

    def print_uncaptured(text: str) -> None:
        if request.config.getoption("capture") == "no":
            print(text)

    return print_uncaptured


@pytest.fixture
def tiny_program() -> autopar.ParallelProgram:
    """A 2-layer GPT compiled for one device (``helpers.tiny_gpt_program``), fresh for each test."""
    return tiny_gpt_program()


@pytest.fixture(autouse=True)
def _forget_compiled_programs():
    """Each test compiles its own programs: ``parallelize_on``'s cache lives for one test."""
    yield
    helpers._COMPILED.clear()


def pytest_collection_modifyitems(config, items):
    """The modules that start ranks (marked ``multiprocess``) run first, each module's tests in their
    order: the two workers (``-n 2 --dist loadscope``) take the long modules while both are free and
    fill the end with the short ones, instead of ending on one long module while the other idles."""
    spawning = {item.module.__name__ for item in items if item.get_closest_marker("multiprocess")}
    items.sort(key=lambda item: item.module.__name__ not in spawning)
