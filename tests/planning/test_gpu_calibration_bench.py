"""``bench/gpu_calibration.py --smoke`` runs on the CPU and prints measured beside predicted."""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

BENCH = Path(__file__).resolve().parents[2] / "bench" / "gpu_calibration.py"


def test_gpu_calibration_smoke(capsys):
    spec = importlib.util.spec_from_file_location("gpu_calibration", BENCH)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    assert bench.main(["--smoke", "--steps", "2", "--warmup", "2", "--batch", "2"]) == 0
    out = capsys.readouterr().out
    num = r"([\d.]+(?:e[+-]\d+)?)"
    gemms = re.findall(rf"^\((\d+), (\d+), (\d+), (\d+)\)\s+{num}\s+{num}\s+{num}$", out, re.M)
    assert len(gemms) >= 4  # QKV, attention scores, context, projection, fc1, fc2, their backward, the head
    assert all(float(g[4]) > 0 and float(g[5]) > 0 for g in gemms)
    step = re.search(r"measured ([\d.]+) ms, predicted ([\d.]+) ms, ratio ([\d.]+)", out)
    assert step is not None and float(step.group(1)) > 0 and float(step.group(2)) > 0
