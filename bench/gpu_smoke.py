"""GPU smoke benchmark: one GPU, tp = pp = dp = 1, autopar against eager PyTorch, bf16.

The same GPT-2-medium-sized model (24 layers, d_model 1024, 16 heads, a
50304-token vocabulary, 1024-token sequences), the same weights and the same
batches, trained with AdamW:

1. eager PyTorch: ``loss = F.cross_entropy(model(x), y)`` under bf16 autocast,
   ``loss.backward()``, ``optimizer.step()``;
2. autopar: ``parallelize(model, precision="bf16")``, ``engine.train_step``,
   ``optimizer.step()`` over the engine's parameters;
3. with ``--compile``: autopar with ``compile=True`` (the chunk's forward and
   backward compiled by Inductor at the first step, its compile seconds printed)
   and ``torch.compile`` of the eager model, the two compiled forms side by side.

Printed: the median step time of each (after warm-up steps), their ratio,
tokens/s, and model FLOP utilisation (6 N T for the weights plus the
attention's 12 L s^2 d per sequence, over the GPU's dense bf16 peak), the
first and last losses of both (they follow each other), and autopar's step
time per action kind from its timeline. Nothing else: it is the check that
the CUDA path (NCCL-free on one GPU, every tensor on the device) runs, and what
it costs.

    .venv/bin/python bench/gpu_smoke.py                # on a machine with a GPU
    .venv/bin/python bench/gpu_smoke.py --tiny --cpu   # the same code path, tiny, on the CPU
    .venv/bin/python bench/gpu_smoke.py --compile      # and the compiled forms
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F

import autopar
from autopar.reference.models import ModelConfig, build

PEAK_BF16 = {"H100": 989e12, "H200": 989e12, "A100": 312e12, "L4": 121e12, "A10": 125e12}
"""Dense bf16 tensor-core FLOP/s by GPU name (data sheets)."""


def _args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--batch", type=int, default=8, help="sequences per step")
    ap.add_argument("--tiny", action="store_true", help="a 2-layer, d_model 64 model (to check the script)")
    ap.add_argument("--cpu", action="store_true", help="run on the CPU (fp32 stays bf16 autocast on CPU)")
    ap.add_argument("--compile", action="store_true",
                    help="also autopar with compile=True and torch.compile of the eager model (Inductor)")
    return ap.parse_args()


def _config(tiny: bool) -> ModelConfig:
    if tiny:
        return ModelConfig(vocab_size=512, seq_len=64, n_layer=2, n_head=4, d_model=64, dropout=0.0)
    return ModelConfig(vocab_size=50304, seq_len=1024, n_layer=24, n_head=16, d_model=1024, dropout=0.0)


def _flops_per_step(model: torch.nn.Module, cfg: ModelConfig, batch: int) -> float:
    n = sum(p.numel() for p in model.parameters())
    tokens = batch * cfg.seq_len
    attention = 12 * cfg.n_layer * cfg.seq_len ** 2 * cfg.d_model * batch
    return 6 * n * tokens + attention


def _peak(device: torch.device) -> float | None:
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    return next((v for k, v in PEAK_BF16.items() if k in name), None)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _timed(step, batches, device, warmup: int) -> tuple[list[float], list[float]]:
    times, losses = [], []
    for i, (x, y) in enumerate(batches):
        _sync(device)
        t0 = time.perf_counter()
        losses.append(float(step(x, y)))
        _sync(device)
        if i >= warmup:
            times.append(time.perf_counter() - t0)
    return times, losses


def _eager(model, device, batches, warmup):
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)

    def step(x, y):
        with torch.autocast(device.type, dtype=torch.bfloat16):
            logits = model(x)
        loss = F.cross_entropy(logits.float().flatten(0, 1), y.flatten())
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.detach()

    return _timed(step, batches, device, warmup)


def _autopar(model, device, batches, warmup, batch: int, compile_chunks: bool = False):
    x, y = batches[0]
    program = autopar.parallelize(model, example_inputs=(x,), example_targets=y, microbatches=1,
                                  precision="bf16", compile=compile_chunks or None)
    engine = program.materialize()
    assert engine.device == device, f"the engine computes on {engine.device}, the model is on {device}"
    opt = torch.optim.AdamW(engine.parameters(), lr=1e-4)

    def step(x, y):
        loss = engine.train_step(x, y)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss

    times, losses = _timed(step, batches, device, warmup)
    kinds: dict[str, float] = {}
    for e in engine.events:
        kinds[e.kind] = kinds.get(e.kind, 0.0) + e.end - e.start
    if compile_chunks:
        kinds["compile (first step)"] = sum(r.seconds for r in engine.compiled().values())
    return times, losses, kinds


def main() -> None:
    args = _args()
    device = torch.device("cpu" if args.cpu or not torch.cuda.is_available() else "cuda")
    cfg = _config(args.tiny)
    torch.manual_seed(0)
    eager = build("gpt", cfg).to(device)
    torch.manual_seed(0)
    ours = build("gpt", cfg).to(device)
    ours.load_state_dict(eager.state_dict())
    g = torch.Generator().manual_seed(1)
    batches = []
    for _ in range(args.steps):
        t = torch.randint(0, cfg.vocab_size, (args.batch, cfg.seq_len + 1), generator=g)
        batches.append((t[:, :-1].to(device), t[:, 1:].to(device)))
    print(f"device {device} ({torch.cuda.get_device_name(device) if device.type == 'cuda' else 'CPU'}), "
          f"{sum(p.numel() for p in eager.parameters()) / 1e6:.1f}M parameters, batch {args.batch} x {cfg.seq_len}")
    e_times, e_losses = _eager(eager, device, batches, args.warmup)
    a_times, a_losses, kinds = _autopar(ours, device, batches, args.warmup, args.batch)
    rows = [("eager", e_times, e_losses), ("autopar", a_times, a_losses)]
    if args.compile:
        torch.manual_seed(0)
        fast = build("gpt", cfg).to(device)
        fast.load_state_dict(eager.state_dict())
        rows.append(("compiled", *_eager(torch.compile(fast), device, batches, args.warmup)))
        torch.manual_seed(0)
        ours_c = build("gpt", cfg).to(device)
        ours_c.load_state_dict(eager.state_dict())
        c_times, c_losses, c_kinds = _autopar(ours_c, device, batches, args.warmup, args.batch, compile_chunks=True)
        rows.append(("autopar-c", c_times, c_losses))
    flops, peak = _flops_per_step(eager, cfg, args.batch), _peak(device)
    tokens = args.batch * cfg.seq_len
    print(f"{'':10} {'median step':>12} {'tokens/s':>10} {'MFU':>6} {'first loss':>11} {'last loss':>10}")
    for name, times, losses in rows:
        med = statistics.median(times)
        mfu = f"{flops / med / peak:6.1%}" if peak else "   n/a"
        print(f"{name:10} {med * 1e3:10.1f}ms {tokens / med:10.0f} {mfu} {losses[0]:11.4f} {losses[-1]:10.4f}")
    print(f"autopar / eager step time: {statistics.median(a_times) / statistics.median(e_times):.3f}")
    if args.compile:
        print(f"autopar compiled / autopar eager: {statistics.median(c_times) / statistics.median(a_times):.3f}; "
              f"/ torch.compile: {statistics.median(c_times) / statistics.median(rows[2][1]):.3f}; "
              f"compiled in {c_kinds['compile (first step)']:.1f} s")
    print("autopar's last step by action kind: " + ", ".join(f"{k} {v * 1e3:.1f}ms" for k, v in sorted(kinds.items())))


if __name__ == "__main__":
    main()
