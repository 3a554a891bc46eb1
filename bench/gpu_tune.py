"""GPU check of ``autopar tune``: the tuned profile's GEMM figures, and one bf16 training step of a ~350M
GPT predicted with it against the step measured, on one GPU, in a few minutes.

1. ``autopar tune`` on the GPU (one process: compute only) over the GPT's shapes at micro-batch
   ``--batch``, bf16 and fp32: the profile is written to ``--out``;
2. its bf16 GEMM rates, shape by shape, beside the preset's prediction (``--preset``, dgx-h200);
3. one autopar training step (``parallelize(precision="bf16")``, tp = pp = dp = 1; median over steps,
   ``bench/gpu_calibration.step_time``) beside ``step_estimate.estimate``'s iteration time with the tuned
   profile and with the preset.

    PYTHONPATH=$PWD .venv/bin/python bench/gpu_tune.py --out $OUT/gpu-hardware.json   # on a machine with a GPU
    PYTHONPATH=$PWD .venv/bin/python bench/gpu_tune.py --smoke                        # tiny sizes, on the CPU
Without a GPU (and without --smoke) it says so and exits 0.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import torch

from autopar.planning.cost.hardware import PROFILES
from autopar.planning.cost.hardware_profile import load_hardware, load_profile
from autopar.planning.cost.layout import Cluster, Layout
from autopar.planning.cost.op_costs import gemm_op
from autopar.planning.cost.op_times import op_time
from autopar.planning.cost.step_estimate import estimate

_HERE = Path(__file__).resolve().parent


def _calibration():
    """bench/gpu_calibration.py (the GPT's config, its spec, the timed step), loaded from beside this file."""
    spec = importlib.util.spec_from_file_location("gpu_calibration", _HERE / "gpu_calibration.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="gpu-hardware.json", help="the profile autopar tune writes")
    ap.add_argument("--preset", default="dgx-h200", choices=sorted(PROFILES), help="the preset to compare with")
    ap.add_argument("--batch", type=int, default=8, help="sequences per step (and the micro-batch tuned)")
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--smoke", action="store_true", help="tiny sizes on the CPU (checks the script)")
    return ap.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = _args(argv)
    if not args.smoke and not torch.cuda.is_available():
        print("no GPU: bench/gpu_tune.py times autopar tune and a bf16 step on a GPU; nothing measured "
              "(--smoke runs it with tiny sizes on the CPU)")
        return 0
    cal = _calibration()
    cfg = cal._config(args.smoke)
    spec = cal._spec(cfg)
    dims = ["--layers", str(cfg.n_layer), "--hidden", str(cfg.d_model), "--heads", str(cfg.n_head),
            "--seq-len", str(cfg.seq_len), "--vocab", str(cfg.vocab_size), "--micro-batch", str(args.batch)]
    tune = [sys.executable, "-m", "autopar.cli", "tune", *dims, "--tp", "1", "--dtypes", "bf16,fp32", "--out", args.out]
    print("$ autopar " + " ".join(tune[3:]), flush=True)
    root = str(_HERE.parent)  # this checkout's autopar, whatever the working directory
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")])))
    subprocess.run(tune + (["--quick"] if args.smoke else []), check=True, env=env)
    profile, tuned, preset = load_profile(args.out), load_hardware(args.out, dtype="bf16"), PROFILES[args.preset]
    print(f"{'bf16 GEMM (batch, M, N, K)':28} {'tuned TFLOP/s':>14} {args.preset + ' predicted':>20}")
    for g in profile.gemm:
        if g.dtype == "bf16":
            op = gemm_op(g.name, g.batch, g.m, g.n, g.k)
            print(f"{str((g.batch, g.m, g.n, g.k)):28} {g.flops_per_s / 1e12:14.4g} "
                  f"{op.flops / op_time(op, preset) / 1e12:20.4g}")
    print(f"copy {profile.memory_bw / 1e9:.4g} GB/s, eager op {profile.eager_op_s * 1e6:.3g} us")
    device = torch.device("cuda" if torch.cuda.is_available() and not args.smoke else "cpu")
    measured = cal.step_time(cfg, args.batch, device, args.steps, args.warmup)
    lay = Layout(t=1, p=1, d=1, b=args.batch, recompute="none")
    with_profile = estimate(spec, Cluster(1, tuned, args.batch), lay).t_iter
    with_preset = estimate(spec, Cluster(1, preset, args.batch), lay).t_iter
    print(f"autopar bf16 step: measured {measured * 1e3:.2f} ms; predicted with the tuned profile "
          f"{with_profile * 1e3:.2f} ms (ratio {measured / with_profile:.3f}), with {args.preset} "
          f"{with_preset * 1e3:.2f} ms (ratio {measured / with_preset:.3f})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
