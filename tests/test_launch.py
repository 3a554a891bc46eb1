"""Launching: `autopar run` and torchrun start a script's ranks; a failing rank stops them all."""

import re
import subprocess
import sys
import textwrap
import time

import pytest

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


def _run(cmd, timeout=180):
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)


def test_autopar_run_starts_every_rank(script):
    out = _run([sys.executable, "-m", "autopar.cli", "run", "--nproc", "2", script, "-1"])
    assert out.returncode == 0, out.stderr[-2000:]
    found = sorted(re.findall(r"rank (\d) of 2 loss (\d+\.\d{6})", out.stdout))  # ranks' lines may interleave
    assert [r for r, _ in found] == ["0", "1"], out.stdout
    assert found[0][1] == found[1][1]  # the same loss on both ranks


def test_torchrun_starts_every_rank(script):
    out = _run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                script, "-1"])
    assert out.returncode == 0, out.stderr[-2000:]
    assert sorted(re.findall(r"rank (\d) of 2 loss", out.stdout)) == ["0", "1"], out.stdout


def test_autopar_run_stops_all_ranks_when_one_fails(script):
    start = time.monotonic()
    out = _run([sys.executable, "-m", "autopar.cli", "run", "--nproc", "2", script, "1"])
    assert out.returncode != 0
    assert "boom on rank 1" in out.stderr and "stopped the others" in out.stderr
    assert time.monotonic() - start < 120
