"""A call stuck where stopping communication cannot reach it ends its process, with the failure said.

Two gloo ranks, a failure timeout of 3 s. Rank 0, which serves the process
group's store, stops itself (SIGSTOP) before the first save; rank 1's save
makes the checkpoints' process group, whose rendezvous waits on that store
(a TCPStore read has no timeout once connected). Rank 1's failure watch fails
the save after the timeout, naming rank 0, and stops rank 1's communication;
the save cannot notice (it waits on the store, not on a collective), so
``STUCK_EXIT_S`` later the watch ends rank 1's process with the failure on
stderr, as NCCL's watchdog ends a rank, instead of leaving it waiting for
ever. ``spawn`` then reports rank 1's exit and ends the stopped rank 0.
"""

from __future__ import annotations

import os
import signal
import time

import pytest
import torch.distributed as dist
from helpers import spawn_ranks
from stopped_ranks import TIMEOUT_S, first_batch, tiny_program

from autopar.runtime.engine.failure_board import STORE_TIMEOUT_S, STUCK_EXIT_S
from autopar.runtime.launch import RankError

pytestmark = pytest.mark.multiprocess


def _save_with_rank0_stopped(root: str) -> None:
    engine = tiny_program().materialize()
    engine.failure_timeout_s = TIMEOUT_S
    x, y = first_batch()
    engine.train_step(x, y)
    time.sleep(0.5)  # a heartbeat or two between the calls
    if dist.get_rank() == 0:
        os.kill(os.getpid(), signal.SIGSTOP)  # ended by spawn once rank 1 is gone
    engine.save(root, step=1)  # rank 1: the checkpoints' group waits for rank 0's store


def test_a_save_stuck_on_a_stopped_store_ends_its_process_naming_rank_0(tmp_path, capfd):
    tiny_program()  # compiled here once: the ranks inherit it
    start = time.monotonic()
    with pytest.raises(RankError, match="rank 1 of 2"):
        spawn_ranks(_save_with_rank0_stopped, 2, str(tmp_path / "ckpt"), timeout_s=120)
    took = time.monotonic() - start
    err = capfd.readouterr().err
    assert ("[rank 1] autopar: rank 1 (pp=1, dp=0, tp=0) failed in save of step 1 (after step 1): TimeoutError: no "
            "progress for 3 s") in err, err[-3000:]
    assert "rank 0 (pp=0, dp=0, tp=0), which serves the group's store, does not answer" in err, err[-3000:]
    assert "did not end 3 s after its communication was stopped" in err and "the process exits" in err, err[-3000:]
    # the timeout, a store call's bound, the watch's grace, then spawn's grace for the stopped rank 0 (5 s)
    assert took < TIMEOUT_S + STORE_TIMEOUT_S + STUCK_EXIT_S + 5.0 + 6.0, took
