"""Launching: `autopar run` and torchrun start a script's ranks; a failing rank stops them all."""

import os
import re
import signal
import subprocess
import sys
import textwrap
import time

import pytest
import torch

pytestmark = pytest.mark.multiprocess

SCRIPT = textwrap.dedent("""
    import sys, torch, autopar
    from autopar.reference.models import build

    def work(fail_rank):
        import torch.distributed as dist
        torch.manual_seed(0)
        model = build("gpt", vocab_size=64, seq_len=8, n_layer=2, n_head=2, d_model=16)
        x = torch.randint(0, 64, (2, 8))
        program = autopar.parallelize(model, tp=2, example_inputs=(x,), example_targets=x.clone())
        engine = program.materialize()
        if dist.get_rank() == fail_rank:
            raise RuntimeError("boom on rank %d" % fail_rank)
        loss = engine.train_step(x, x.clone())
        print("rank %d of %d loss %.6f" % (dist.get_rank(), dist.get_world_size(), loss), flush=True)

    if __name__ == "__main__":
        autopar.spawn(work, 2, (int(sys.argv[1]),))
""")


@pytest.fixture()
def script(tmp_path):
    path = tmp_path / "job.py"
    path.write_text(SCRIPT)
    return str(path)


def _run_command(cmd, timeout=180):
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)


# `autopar run` starting a script's ranks that train: tests/integration/test_readme_script.py (4 ranks,
# the same losses as under torchrun); here it starts ranks that fail.


def test_torchrun_starts_every_rank(script):
    out = _run_command([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                script, "-1"])
    assert out.returncode == 0, out.stderr[-2000:]
    found = sorted(re.findall(r"rank (\d) of 2 loss (\d+\.\d{6})", out.stdout))  # ranks' lines may interleave
    assert [r for r, _ in found] == ["0", "1"], out.stdout
    assert found[0][1] == found[1][1]  # the same loss on both ranks


def test_autopar_run_stops_all_ranks_when_one_fails(script):
    start = time.monotonic()
    out = _run_command([sys.executable, "-m", "autopar.cli", "run", "--nproc", "2", script, "1"])
    assert out.returncode != 0
    assert "boom on rank 1" in out.stderr and "stopped the others" in out.stderr
    assert time.monotonic() - start < 120


SLEEPER = textwrap.dedent("""
    import os, sys, time

    def sleep_forever(folder):
        with open(os.path.join(folder, "rank%s.pid" % os.environ["RANK"]), "w") as f:
            f.write(str(os.getpid()))
        while True:
            time.sleep(0.05)

    if __name__ == "__main__":
        if sys.argv[2] == "spawn":  # this process is the parent of the ranks autopar.spawn starts
            import autopar
            autopar.spawn(sleep_forever, 2, (sys.argv[1],))
        else:  # started by autopar run: this process is a rank
            sleep_forever(sys.argv[1])
""")


def _interrupted(cmd: list[str], folder) -> tuple[subprocess.CompletedProcess, list[int]]:
    """Start ``cmd``, wait until both ranks wrote their pid, send SIGINT (Ctrl-C) to it alone."""
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    pid_files = [folder / f"rank{r}.pid" for r in range(2)]
    deadline = time.monotonic() + 120
    while not all(f.exists() and f.read_text() for f in pid_files):
        assert proc.poll() is None and time.monotonic() < deadline, "the ranks did not start"
        time.sleep(0.05)
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=60)
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err), [int(f.read_text()) for f in pid_files]


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


@pytest.mark.parametrize("launcher", ["autopar run", "spawn"])
def test_ctrl_c_stops_every_rank_with_one_line(tmp_path, launcher):
    """SIGINT to the launcher (``autopar run``, or a script whose ``autopar.spawn`` is the ranks'
    parent): the ranks are stopped, one line says so, the exit code is 130, no traceback."""
    script = tmp_path / "sleeper.py"
    script.write_text(SLEEPER)
    if launcher == "spawn":
        cmd = [sys.executable, str(script), str(tmp_path), "spawn"]
    else:
        cmd = [sys.executable, "-m", "autopar.cli", "run", "--nproc", "2", str(script), str(tmp_path), "rank"]
    out, pids = _interrupted(cmd, tmp_path)
    lines = [line for line in (out.stdout + out.stderr).splitlines() if line.strip()]
    assert out.returncode == 130, lines
    assert "Traceback" not in out.stdout + out.stderr
    assert len(lines) == 1 and lines[0].endswith("interrupted: stopped 2 ranks"), lines
    assert not any(_alive(pid) for pid in pids)


def _train_inherited(program, seen_in_parent):
    """One step of ``program`` (compiled in the test process), and whether this rank holds the very
    objects the parent held (inherited by the fork, not pickled copies)."""
    import torch.distributed as dist

    from autopar.core.mesh import group_over

    x = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(1))
    engine = program.materialize()
    loss = engine.train_step(x, x.clone())
    # a second engine (another evaluation or resharding engine, say) makes no new groups: it
    # shares the first one's, and a group over other ranks would be made once, here none
    tp = engine.mesh.groups["tp"]
    shared = program.materialize().mesh.groups["tp"] is tp and group_over([1, 0]) is tp
    return dist.get_rank(), loss, id(program) == seen_in_parent, shared, group_over([dist.get_rank()])


def test_inherited_ranks_run_a_program_compiled_in_the_caller():
    """``spawn(..., inherit=True)`` forks the ranks from the caller: a program compiled there (which
    cannot be pickled) runs on every rank as the same object, and both ranks agree on the loss. A
    second engine of the program shares the first one's process groups instead of making more."""
    import autopar
    from autopar.reference.models import build

    torch.manual_seed(0)
    model = build("gpt", vocab_size=64, seq_len=8, n_layer=2, n_head=2, d_model=16)
    x = torch.randint(0, 64, (2, 8))
    program = autopar.parallelize(model, tp=2, example_inputs=(x,), example_targets=x.clone())
    results = autopar.spawn(_train_inherited, 2, (program, id(program)), inherit=True)
    assert [r[0] for r in results] == [0, 1]
    assert all(r[2] for r in results), "a rank got a copy of the program, not the caller's"
    assert results[0][1] == results[1][1]
    assert [r[3:] for r in results] == [(True, None)] * 2, "engines of one process share their process groups"


def test_inheriting_nccl_ranks_is_refused_before_any_start():
    from autopar.runtime.launch import LaunchError, spawn

    with pytest.raises(LaunchError, match=r"inherit=True\) forks CPU ranks; nccl ranks start fresh"):
        spawn(print, 2, inherit=True, backend="nccl")


def _board_made_late(delay_s: float) -> float:
    """Rank 1 makes an engine's failure board (a connection of its own to rank 0's store) ``delay_s`` after
    rank 0 has returned: the seconds its first store round trip took."""
    import torch.distributed as dist

    from autopar.runtime.engine.failure_board import FailureBoard

    if dist.get_rank() == 0:
        return 0.0
    time.sleep(delay_s)
    start = time.monotonic()
    board = FailureBoard("autopar/failure/late", dist.get_world_size())
    board.beat("late")
    assert board.heartbeats()[1][1] == "late"
    return time.monotonic() - start


def test_the_store_outlives_a_rank_that_finished_first():
    """Rank 0 serves the process group's store: the ranks leave together, so one that is still working
    when rank 0's function returned reaches the store (without the barrier, the late connection waits
    the group's whole timeout and the spawn fails)."""
    import autopar

    took = autopar.spawn(_board_made_late, 2, (1.0,), timeout_s=30, inherit=True)[1]
    assert took < 3.0, took
