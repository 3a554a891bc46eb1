"""A rank that stops answering outside a step (SIGSTOP) is named by the others within the failure timeout.

Two gloo ranks, a failure timeout of 3 s. One rank stops itself with SIGSTOP
right before a collective call outside ``train_step``: the gradient clipping
(pp=2: its norm is summed over the stages), the distributed optimizer's own
``step()`` (dp=2: its norm over the replicas, then the parameters'
all-gathers), the wait for an asynchronous save (DCP's collectives run in the
save's thread), and a step while rank 0, the host of the process group's
store, is the one stopped. The other rank's call fails within the timeout plus
a few seconds, and its error names the silent rank and what it runs, instead
of waiting for gloo's own timeout (minutes). It then continues the stopped
rank (SIGCONT), whose call raises the same root cause instead of hanging.
"""

from __future__ import annotations

import time

import pytest
import torch
import torch.distributed as dist
from helpers import spawn_ranks
from stopped_ranks import TIMEOUT_S, continue_stopped, first_batch, stop_here, timed, tiny_program

from autopar.runtime.checkpoint.publishing import PublishingWriter
from autopar.runtime.engine.failure_board import STORE_TIMEOUT_S

pytestmark = pytest.mark.multiprocess
SLACK_S = 4.0
"""What a survivor may take past the timeout: a poll of the watch, closing its connections, the error."""
STORE_S = STORE_TIMEOUT_S
"""A stopped rank 0 also leaves one of the survivor's store calls to its bound."""

LAYOUT = {"clip": "pp", "optimizer": "dp", "save": "pp", "rank 0": "pp"}


def _stop_in(cls: type, method: str, pid_file: str) -> None:
    """``cls.method`` stops this process (``stop_here``) when called, then does its work."""
    original = getattr(cls, method)

    def stopping(self, *args, **kwargs):
        stop_here(pid_file)
        return original(self, *args, **kwargs)

    setattr(cls, method, stopping)


def _stop_at(where: str, stopped: int, pid_file: str, root: str) -> dict:
    """Rank ``stopped`` stops itself right before the call ``where``; the other makes the call, and once
    it failed continues the stopped rank (its pid in ``pid_file``: a stopped rank 0 serves no store)."""
    engine = tiny_program(LAYOUT[where]).materialize()
    engine.failure_timeout_s = TIMEOUT_S
    opt = engine.distributed_optimizer(torch.optim.AdamW, lr=1e-3) if where == "optimizer" else None
    x, y = first_batch()
    engine.train_step(x, y)
    call = {"clip": lambda: engine.clip_grad_norm_(1.0),
            "optimizer": lambda: opt.step(),
            "rank 0": lambda: engine.train_step(x, y)}.get(where)
    if where == "save":  # stopped by the save's own thread, before it writes (its peers wait for it in DCP)
        if dist.get_rank() == stopped:
            _stop_in(PublishingWriter, "write_data", pid_file)
        call = engine.save(root, step=1, async_save=True).wait
    time.sleep(0.5)  # a heartbeat or two between the calls
    if dist.get_rank() == stopped and where != "save":
        stop_here(pid_file)
    error, took = timed(call)
    if dist.get_rank() != stopped:
        continue_stopped(pid_file)
    return {"error": None if error is None else f"{type(error).__name__}: {error}", "took": took}


@pytest.mark.parametrize("where, stopped, what, named", [
    ("clip", 1, "clip_grad_norm_ (after step 1)", "rank 1 (pp=1, dp=0, tp=0) has not answered for"),
    ("optimizer", 1, "the distributed optimizer's step (after step 1)", "rank 1 (pp=0, dp=1, tp=0) has not answered for"),
    ("save", 1, "the wait for the save of step-00000001", "rank 1 (pp=1, dp=0, tp=0) has not answered for"),
    ("rank 0", 0, "failed running F1.0 (stage 1, step 1, waiting for RF1.0", "rank 0 (pp=0, dp=0, tp=0), which serves the group's store, does not answer"),
])
def test_a_rank_stopped_outside_a_step_is_named_within_the_timeout(tmp_path, where, stopped, what, named):
    tiny_program(LAYOUT[where])  # compiled here once: the ranks inherit it
    out = spawn_ranks(_stop_at, 2, where, stopped, str(tmp_path / "pid"), str(tmp_path / "ckpt"), timeout_s=120)
    survivor, resumed = out[1 - stopped], out[stopped]
    bound = TIMEOUT_S + SLACK_S + (STORE_S if stopped == 0 else 0.0)
    assert survivor["error"] is not None and TIMEOUT_S <= survivor["took"] < bound, (where, survivor)
    assert "ActionError" in survivor["error"] and f"rank {1 - stopped} " in survivor["error"], survivor["error"]
    assert what in survivor["error"] and "no progress for" in survivor["error"], survivor["error"]
    assert named in survivor["error"], survivor["error"]
    assert resumed["error"] is not None, (where, resumed)  # raised, not hung, once continued
    if stopped != 0:  # the root cause, read from the board: the survivor's timeout
        assert f"rank {1 - stopped} " in resumed["error"].splitlines()[0] and what in resumed["error"], resumed["error"]
