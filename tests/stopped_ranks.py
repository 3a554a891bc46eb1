"""What the tests of stopped ranks share: a tiny two-rank GPT program, and a rank that stops itself
(SIGSTOP) until the other continues it.

The stopped rank writes its pid to a file first, since a stopped rank 0 serves no store; the
other rank times its own call (``timed``), then continues the stopped one (``continue_stopped``).
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Callable

import torch
from helpers import parallelize_on, token_batches

from autopar.reference.models import build

VOCAB, TIMEOUT_S = 64, 3.0
"""The tiny GPT's vocabulary, and the failure timeout the tests give their engines."""


def tiny_program(layout: str = "pp"):
    """A 2-layer GPT on two ranks: two pipeline stages ('pp', two microbatches) or two replicas ('dp')."""
    torch.manual_seed(0)
    model = build("gpt", vocab_size=VOCAB, seq_len=8, n_layer=2, n_head=2, d_model=16)
    data = token_batches(VOCAB, 2, 4, seed=1, seq=8)
    if layout == "pp":
        return parallelize_on(model, data, 2, pp=2, microbatches=2, world_size=2)
    return parallelize_on(model, data, 2, dp=2, microbatches=1, world_size=2)


def first_batch():
    """The tiny program's first global batch, (x, y)."""
    (x,), (y,) = token_batches(VOCAB, 2, 4, seed=1, seq=8)[0]
    return x, y


def stop_here(pid_file: str) -> None:
    """This process stops (every thread of it) until another continues it with SIGCONT. The pid file
    appears whole (written aside, then renamed), so a reader never finds it empty."""
    with open(pid_file + ".part", "w") as f:
        f.write(str(os.getpid()))
    os.replace(pid_file + ".part", pid_file)
    os.kill(os.getpid(), signal.SIGSTOP)


def timed(call: Callable[[], object]) -> tuple[Exception | None, float]:
    """(what ``call`` raised, None if nothing; the seconds it took)."""
    start = time.monotonic()
    try:
        call()
        error = None
    except Exception as e:  # noqa: BLE001 - the error is what the tests read
        error = e
    return error, time.monotonic() - start


def _stopped(pid: int) -> bool:
    """Whether process ``pid`` is stopped (state T in /proc), so a SIGCONT now cannot come before its SIGSTOP."""
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()[0] in ("T", "t")


def continue_stopped(pid_file: str, within_s: float = 60.0) -> None:
    """SIGCONT to the rank that stopped itself, once its pid is written and it has stopped (a rank slower
    to get there than the other's timeout would otherwise be continued before it stops, and stay stopped)."""
    end = time.monotonic() + within_s
    while not os.path.exists(pid_file) and time.monotonic() < end:
        time.sleep(0.01)
    pid = int(open(pid_file).read())
    while not _stopped(pid) and time.monotonic() < end:
        time.sleep(0.01)
    os.kill(pid, signal.SIGCONT)
