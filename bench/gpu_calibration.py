"""GPU calibration of the cost model: measured against predicted, on one GPU, in a few minutes.

1. GEMM throughput (bf16) over the shapes the planner prices for a GPT-2-medium-sized layer
   (``planning.cost.transformer.layer_ops`` at t = 1, forward and backward, and the LM head), each
   timed with ``torch.matmul``, beside ``planning.cost.op_times.op_time``'s prediction on the
   chosen hardware profile;
2. one autopar training step (``parallelize(precision="bf16")``, tp = pp = dp = 1) of that
   ~350M GPT, median over steps, beside ``planning.cost.step_estimate``'s iteration time.

The two fitted constants (``hardware.Efficiency.gemm``, ``.hbm``) were fitted on A100 rows of
the paper; the H100/H200 profiles reuse them. The ratios printed here are what a refit needs.

    .venv/bin/python bench/gpu_calibration.py --hardware dgx-h200   # on a machine with a GPU
    .venv/bin/python bench/gpu_calibration.py --smoke                # tiny sizes, on the CPU
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch

import autopar
from autopar.planning.cost.hardware import PROFILES, get_hardware
from autopar.planning.cost.layout import Cluster, Layout
from autopar.planning.cost.models import ModelSpec
from autopar.planning.cost.op_times import op_time
from autopar.planning.cost.step_estimate import estimate
from autopar.planning.cost.transformer import head_ops, layer_ops
from autopar.reference.models import ModelConfig, build


def _args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--hardware", default="dgx-h200", choices=sorted(PROFILES), help="profile to predict with")
    ap.add_argument("--batch", type=int, default=8, help="sequences per step")
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--smoke", action="store_true", help="tiny sizes on the CPU (checks the script)")
    return ap.parse_args(argv)


def _config(smoke: bool) -> ModelConfig:
    if smoke:
        return ModelConfig(vocab_size=512, seq_len=64, n_layer=2, n_head=4, d_model=64, dropout=0.0)
    return ModelConfig(vocab_size=50304, seq_len=1024, n_layer=24, n_head=16, d_model=1024, dropout=0.0)


def _spec(cfg: ModelConfig) -> ModelSpec:
    return ModelSpec(layers=cfg.n_layer, hidden=cfg.d_model, heads=cfg.n_head, seq_len=cfg.seq_len,
                     vocab=cfg.vocab_size, dropout=False, fused_attention=True, name="gpt-350m")


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _time(fn, device: torch.device, repeat: int) -> float:
    """Median seconds of ``fn`` over ``repeat`` calls after two warm-ups."""
    for _ in range(2):
        fn()
    times = []
    for _ in range(repeat):
        _sync(device)
        t0 = time.perf_counter()
        fn()
        _sync(device)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def gemm_rows(spec: ModelSpec, b: int, hw, device: torch.device, repeat: int) -> list[tuple]:
    """(shape, measured TFLOP/s, predicted TFLOP/s) of every distinct GEMM the planner prices."""
    ops = layer_ops(spec, b, 1)
    head = head_ops(spec, b, 1)
    seen, rows = set(), []
    for op in ops.forward + ops.backward + head.forward:
        if op.kind != "gemm" or op.gemm in seen:
            continue
        seen.add(op.gemm)
        batch, m, n, k = op.gemm
        x = torch.randn(batch, m, k, device=device, dtype=torch.bfloat16)
        w = torch.randn(batch, k, n, device=device, dtype=torch.bfloat16)
        sec = _time(lambda: torch.matmul(x, w), device, repeat)
        flops = 2 * batch * m * n * k
        rows.append((op.gemm, flops / sec / 1e12, flops / op_time(op, hw) / 1e12))
    return rows


def step_time(cfg: ModelConfig, batch: int, device: torch.device, steps: int, warmup: int) -> float:
    """Median seconds of one autopar bf16 training step (engine step and AdamW)."""
    torch.manual_seed(0)
    model = build("gpt", cfg).to(device)
    g = torch.Generator().manual_seed(1)
    tok = torch.randint(0, cfg.vocab_size, (batch, cfg.seq_len + 1), generator=g)
    x, y = tok[:, :-1].to(device), tok[:, 1:].to(device)
    engine = autopar.parallelize(model, example_inputs=(x,), example_targets=y, microbatches=1,
                                 precision="bf16").materialize()
    opt = torch.optim.AdamW(engine.parameters(), lr=1e-4)

    def step() -> None:
        engine.train_step(x, y)
        opt.step()
        opt.zero_grad(set_to_none=True)

    for _ in range(max(warmup - 2, 0)):
        step()
    return _time(step, device, steps)


def main(argv: list[str] | None = None) -> int:
    args = _args(argv)
    device = torch.device("cpu" if args.smoke or not torch.cuda.is_available() else "cuda")
    cfg, hw = _config(args.smoke), get_hardware(args.hardware)
    spec = _spec(cfg)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
    print(f"device {device} ({name}); predictions for {hw.name} ({hw.gpu}); model {spec.label}: "
          f"{cfg.n_layer} layers, d_model {cfg.d_model}, {cfg.n_head} heads, seq {cfg.seq_len}, batch {args.batch}")
    print(f"{'GEMM (batch, M, N, K)':28} {'measured TFLOP/s':>17} {'predicted':>10} {'ratio':>7}")
    for shape, measured, predicted in gemm_rows(spec, args.batch, hw, device, repeat=args.steps):
        print(f"{str(shape):28} {measured:17.4g} {predicted:10.4g} {measured / predicted:7.3g}")
    measured = step_time(cfg, args.batch, device, args.steps, args.warmup)
    lay = Layout(t=1, p=1, d=1, b=args.batch, recompute="none")
    predicted = estimate(spec, Cluster(1, hw, args.batch), lay).t_iter
    print(f"autopar bf16 step: measured {measured * 1e3:.2f} ms, predicted {predicted * 1e3:.2f} ms, "
          f"ratio {measured / predicted:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
