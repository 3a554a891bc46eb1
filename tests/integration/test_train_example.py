"""The main job (examples/train_gpt.py) as a user runs it: interrupted, resumed, the same run.

A run of 4 steps against one stopped after step 2 and resumed from its
checkpoint in new processes, and against one whose last rank dies at step 3
under ``autopar run --max-restarts 1``, restarted by the launcher and resumed
without a flag: the same held-out loss and the same final loss.
The final line's loss is the one the progress bar shows; step 0 matches
single-device training (the script checks it and says so).
"""

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.multiprocess

SCRIPT = Path(__file__).resolve().parents[2] / "examples" / "train_gpt.py"
LAYOUT = ["--tp", "1", "--pp", "2", "--dp", "1", "--steps", "4", "--save-every", "2", "--eval-every", "2"]


def _run_example(*extra: str) -> str:
    out = subprocess.run([sys.executable, str(SCRIPT), *LAYOUT, *extra], capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
    return out.stdout


def _final(text: str) -> str:
    return re.search(r"^final loss (\d+\.\d+) at step 4", text, re.M).group(1)


@pytest.fixture(scope="module")
def whole_run(tmp_path_factory) -> tuple[str, Path]:
    """The uninterrupted run's output, and its loss log."""
    root = tmp_path_factory.mktemp("whole")
    return _run_example("--ckpt-dir", str(root / "ckpt"), "--loss-log", str(root / "loss.log")), root / "loss.log"


@pytest.fixture(scope="module")
def whole(whole_run) -> str:
    return whole_run[0]


@pytest.fixture(scope="module")
def whole_log(whole_run) -> Path:
    return whole_run[1]


def _samples_of(log: Path) -> list[int]:
    """Every corpus window the run's steps read, as its loss log lists them."""
    return [i for line in log.read_text().splitlines() for i in json.loads(line)["samples"]]


def test_interrupted_and_resumed_run_ends_like_an_uninterrupted_one(tmp_path, whole, whole_log):
    assert "parity: step 0's loss" in whole
    bar = re.findall(r"step 4/4 .* loss (\d+\.\d+) ", whole)
    assert bar and bar[-1] == _final(whole)  # the last line says what the progress bar showed
    # and the same throughput: global tokens/s over the median step of the same steps
    speed = re.findall(r"step 4/4 .* ([\d,]+) tokens/s", whole)
    assert speed and speed[-1] == re.search(r"^final loss .* ms, ([\d,]+) tokens/s$", whole, re.M).group(1)
    first = _run_example("--ckpt-dir", str(tmp_path / "cut"), "--stop-at", "2", "--loss-log", str(tmp_path / "cut.log"))
    assert "final loss" in first and (tmp_path / "cut" / "latest").read_text().strip() == "step-00000002"
    shutil.copytree(tmp_path / "cut", tmp_path / "elastic")
    shutil.copy(tmp_path / "cut.log", tmp_path / "elastic.log")
    resumed = _run_example("--ckpt-dir", str(tmp_path / "cut"), "--resume")
    assert "resumed from" in resumed and "at step 2" in resumed
    assert _final(resumed) == _final(whole)
    held_out = re.compile(r"(\d+\.\d+) \(step 4\)")
    assert held_out.search(resumed).group(1) == held_out.search(whole).group(1)
    # the same checkpoint resumed on 1 rank, not the 2 asked for: the job plans a layout for 1 rank and the
    # same global batch, and reads on in the same global sample order
    out = subprocess.run([sys.executable, "-m", "autopar.cli", "run", "--nproc", "1", str(SCRIPT), *LAYOUT,
                          "--ckpt-dir", str(tmp_path / "elastic"), "--resume", "--loss-log", str(tmp_path / "elastic.log")],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
    assert "elastic: 1 ranks, not the tp=1 x pp=2 x dp=1 asked for" in out.stdout and "at step 2" in out.stdout
    steps = [json.loads(line) for line in (tmp_path / "elastic.log").read_text().splitlines()]
    assert [(s["step"], s["world"]) for s in steps] == [(1, 2), (2, 2), (3, 1), (4, 1)]
    seen = sorted(i for s in steps for i in s["samples"])  # every sample of the uninterrupted run's 4 steps, once
    assert seen == sorted(_samples_of(whole_log)) and len(set(seen)) == len(seen)
    # another layout sums in another order: the losses agree to fp32 rounding of the few steps, the printed 3 digits
    assert _final(out.stdout) == _final(whole)


def test_a_rank_lost_mid_run_is_restarted_and_resumes_by_itself(tmp_path, whole):
    """The last rank exits (code 17) at step 3 of the first start; the launcher stops the other, starts
    both again, and they resume from step 2's checkpoint: the final and held-out losses are the
    uninterrupted run's (same layout: bitwise, as the printed digits show)."""
    out = subprocess.run([sys.executable, "-m", "autopar.cli", "run", "--nproc", "2", "--max-restarts", "1", str(SCRIPT),
                          *LAYOUT, "--ckpt-dir", str(tmp_path / "crash"), "--crash-at-step", "3"],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
    assert "rank 1 of 2 exited with code 17" in out.stderr and "restarting all 2 ranks (1 of 1 restarts)" in out.stderr
    assert "resumed from" in out.stdout and "at step 2" in out.stdout
    assert _final(out.stdout) == _final(whole)
    held_out = re.compile(r"(\d+\.\d+) \(step 4\)")
    assert held_out.search(out.stdout).group(1) == held_out.search(whole).group(1)
