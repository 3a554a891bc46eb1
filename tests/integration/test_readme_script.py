"""The README's first snippet, saved as a script, runs as written under `autopar run` and torchrun.

Neither launcher gets any help: the script joins the process group the
launcher set up when it calls ``materialize()``. Both runs print the same
five losses (same seeds, same layout), and rank 0 prints the plan.
"""

import re
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.multiprocess

README = Path(__file__).resolve().parents[2] / "README.md"


def _snippet() -> str:
    text = README.read_text()
    return re.search(r"```python\n(.*?)```", text, re.S).group(1)


def _losses(cmd: list[str], script: Path) -> list[str]:
    out = subprocess.run(cmd + [str(script)], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
    assert "layers" in out.stdout and "# autopar rank program: rank 1" in out.stdout  # summary and code, once
    assert out.stdout.count("# autopar rank program: rank 1") == 1  # printed by rank 0 only
    return re.findall(r"step (\d) loss (\d+\.\d{4})", out.stdout)


def test_readme_snippet_runs_under_both_launchers(tmp_path):
    script = tmp_path / "train.py"
    script.write_text(_snippet())
    ours = _losses([sys.executable, "-m", "autopar.cli", "run", "--nproc", "4"], script)
    theirs = _losses([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "4"],
                     script)
    assert [s for s, _ in ours] == ["0", "1", "2", "3", "4"]
    assert ours == theirs
