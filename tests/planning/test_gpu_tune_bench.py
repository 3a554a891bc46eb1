"""``bench/gpu_tune.py``: without a GPU it says so and exits 0; ``--smoke`` runs the whole check on the CPU
(autopar tune, the tuned bf16 GEMM rates beside the preset's, a step measured beside both predictions)."""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

import pytest
import torch

BENCH = Path(__file__).resolve().parents[2] / "bench" / "gpu_tune.py"


def _bench():
    spec = importlib.util.spec_from_file_location("gpu_tune", BENCH)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    return bench


@pytest.mark.skipif(torch.cuda.is_available(), reason="says 'no GPU' only where there is none")
def test_without_a_gpu_it_says_so(capsys):
    assert _bench().main([]) == 0
    assert capsys.readouterr().out.startswith("no GPU:")


def test_smoke_predicts_a_step_with_the_tuned_profile(tmp_path, capfd):
    out = tmp_path / "smoke.json"
    assert _bench().main(["--smoke", "--batch", "2", "--steps", "2", "--warmup", "2", "--out", str(out)]) == 0
    text = capfd.readouterr().out
    rows = re.findall(r"^\((\d+), (\d+), (\d+), (\d+)\)\s+([\d.e+-]+)\s+([\d.e+-]+)$", text, re.M)
    assert len(rows) >= 6 and all(float(r[4]) > 0 and float(r[5]) > 0 for r in rows)
    step = re.search(r"measured ([\d.]+) ms; predicted with the tuned profile ([\d.]+) ms", text)
    assert step is not None and float(step.group(1)) > 0 and float(step.group(2)) > 0
