"""Library logging: records name the rank, and the default handler writes each warning once.

The default handler's behaviour depends on the root logger's handlers, which a test
runner sets; those cases run in a fresh interpreter, as an application would.
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
from pathlib import Path

from autopar.core.log import LIBRARY_LOGGER, current_rank, get_logger

ROOT = Path(__file__).resolve().parents[2]


def _run(code: str, rank: str | None) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "RANK"}
    env["PYTHONPATH"] = str(ROOT)
    if rank is not None:
        env["RANK"] = rank
    return subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True,
                          check=True)


def test_a_warning_reaches_stderr_once_with_its_rank():
    out = _run("from autopar.core.log import get_logger\n"
               "get_logger('autopar.a').warning('first %s', 1)\n"
               "get_logger('autopar.a').info('not shown')\n"
               "get_logger('autopar.b').warning('second')\n", rank="3")
    assert out.stdout == ""
    assert out.stderr.splitlines() == ["autopar.a: WARNING: [rank 3] first 1", "autopar.b: WARNING: [rank 3] second"]


def test_no_rank_no_prefix():
    out = _run("from autopar.core.log import get_logger\nget_logger('autopar.a').warning('plain')\n", rank=None)
    assert out.stderr.splitlines() == ["autopar.a: WARNING: plain"]


def test_an_application_handler_writes_it_alone():
    out = _run("import logging, sys\n"
               "logging.basicConfig(stream=sys.stdout, format='app %(message)s')\n"
               "from autopar.core.log import get_logger\n"
               "get_logger('autopar.a').warning('once')\n", rank="1")
    assert out.stdout.splitlines() == ["app [rank 1] once"]
    assert out.stderr == ""


def test_one_default_handler_however_many_loggers(monkeypatch):
    monkeypatch.setenv("RANK", "5")
    for name in ("autopar.x", "autopar.y", "autopar.x"):
        get_logger(name)
    assert len(logging.getLogger(LIBRARY_LOGGER).handlers) == 1
    assert len(logging.getLogger("autopar.x").filters) == 1
    assert current_rank() == 5


def test_records_carry_the_rank_for_captured_logs(caplog, monkeypatch):
    monkeypatch.setenv("RANK", "2")
    with caplog.at_level(logging.WARNING, logger="autopar.z"):
        get_logger("autopar.z").warning("seen")
    assert [(r.rank, r.getMessage()) for r in caplog.records] == [(2, "[rank 2] seen")]
