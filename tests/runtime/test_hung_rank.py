"""A rank that stops answering (SIGSTOP: alive, but none of its threads runs) is named by the others.

Two gloo ranks run a tiny GPT cut into two pipeline stages, with a failure
timeout of 3 s. Before its second step rank 1 stops itself with SIGSTOP.
Rank 0's second step waits for rank 1's activations, times out, and its error
names rank 1 as the rank that stopped answering, with what rank 1 last ran
(its heartbeat on the failure board), within seconds of the timeout, far
under the libraries' ten-minute defaults. Rank 0 then continues rank 1
(SIGCONT), which raises the same root cause instead of hanging.
"""

from __future__ import annotations

import os
import signal
import time

import pytest
import torch
import torch.distributed as dist
from helpers import parallelize_on, spawn_ranks, token_batches

from autopar.reference.models import build

pytestmark = pytest.mark.multiprocess
VOCAB, TIMEOUT_S = 64, 3.0


def _program():
    torch.manual_seed(0)
    model = build("gpt", vocab_size=VOCAB, seq_len=8, n_layer=2, n_head=2, d_model=16)
    return parallelize_on(model, token_batches(VOCAB, 2, 4, seed=1, seq=8), 2, pp=2, microbatches=2, world_size=2)


def _stop_one(stopped: int, pid_file: str) -> dict:
    """Rank ``stopped`` stops itself before the second step; the other continues it once its own
    second step failed (its pid in ``pid_file``: rank 0, stopped, serves no store)."""
    engine = _program().materialize()
    engine.failure_timeout_s = TIMEOUT_S
    (x,), (y,) = token_batches(VOCAB, 2, 4, seed=1, seq=8)[0]
    engine.train_step(x, y)
    if dist.get_rank() == stopped:
        with open(pid_file, "w") as f:
            f.write(str(os.getpid()))
        os.kill(os.getpid(), signal.SIGSTOP)  # stands still here until the other rank continues it
    start = time.monotonic()
    try:
        engine.train_step(x, y)
        error = None
    except Exception as e:  # noqa: BLE001 - the error is what the test reads
        error = str(e)
    took = time.monotonic() - start
    if dist.get_rank() != stopped:
        while not os.path.exists(pid_file):
            time.sleep(0.01)
        os.kill(int(open(pid_file).read()), signal.SIGCONT)
    return {"error": error, "took": took}


def test_a_stopped_rank_is_named_by_the_rank_waiting_for_it(tmp_path):
    _program()  # compiled here once: the ranks inherit it
    first, second = spawn_ranks(_stop_one, 2, 1, str(tmp_path / "pid"), timeout_s=120)
    assert first["error"] is not None and TIMEOUT_S <= first["took"] < TIMEOUT_S + 10, first
    assert "no progress for" in first["error"] and "engine.failure_timeout_s = 3 s" in first["error"]
    assert "rank 1 (pp=1, dp=0, tp=0) has not answered for" in first["error"], first["error"]
    assert "last heard while running" in first["error"] and "of train_step 1" in first["error"]
    assert second["error"] is not None and "rank 0 (pp=0, dp=0, tp=0) failed running" in second["error"], second
