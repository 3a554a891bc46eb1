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

import pytest
import torch.distributed as dist
from helpers import spawn_ranks
from stopped_ranks import TIMEOUT_S, continue_stopped, first_batch, stop_here, timed, tiny_program

pytestmark = pytest.mark.multiprocess


def _stop_one(stopped: int, pid_file: str) -> dict:
    """Rank ``stopped`` stops itself before the second step; the other continues it once its own
    second step failed."""
    engine = tiny_program().materialize()
    engine.failure_timeout_s = TIMEOUT_S
    x, y = first_batch()
    engine.train_step(x, y)
    if dist.get_rank() == stopped:
        stop_here(pid_file)  # stands still here until the other rank continues it
    error, took = timed(lambda: engine.train_step(x, y))
    if dist.get_rank() != stopped:
        continue_stopped(pid_file)
    return {"error": None if error is None else str(error), "took": took}


def test_a_stopped_rank_is_named_by_the_rank_waiting_for_it(tmp_path):
    tiny_program()  # compiled here once: the ranks inherit it
    first, second = spawn_ranks(_stop_one, 2, 1, str(tmp_path / "pid"), timeout_s=120)
    assert first["error"] is not None and TIMEOUT_S <= first["took"] < TIMEOUT_S + 10, first
    assert "no progress for" in first["error"] and "engine.failure_timeout_s = 3 s" in first["error"]
    assert "rank 1 (pp=1, dp=0, tp=0) has not answered for" in first["error"], first["error"]
    assert "last heard while running" in first["error"] and "of train_step 1" in first["error"]
    assert second["error"] is not None and "rank 0 (pp=0, dp=0, tp=0) failed running" in second["error"], second
