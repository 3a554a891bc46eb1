"""Train a small GPT with 2-way tensor parallelism on local CPU ranks.

    python examples/train_tp.py [--tp 2] [--steps 60]

The parent process compiles the model (any error in the model or the layout
shows here, before a process starts) and prints the plan; then --tp gloo ranks
train it on the repository's own text, and the first steps are checked
against single-device training.
"""

from __future__ import annotations

import argparse
import time

import torch

import autopar
from autopar.data import CorpusBatches
from autopar.models import ModelConfig, build
from autopar.parity import assert_parity, single_device_run

CFG = ModelConfig(vocab_size=256, seq_len=64, n_layer=4, n_head=4, d_model=128, dropout=0.0)
BATCH, LR, CHECK_STEPS = 16, 3e-3, 3


def make_model() -> torch.nn.Module:
    torch.manual_seed(0)
    return build("gpt", CFG)


def train(tp: int, steps: int):
    import torch.distributed as dist

    data = CorpusBatches(BATCH, CFG.seq_len, seed=0)
    x, y = data.next()
    program = autopar.parallelize(make_model(), tp=tp, example_inputs=(x,), example_targets=y)
    engine = program.materialize()
    opt = torch.optim.AdamW(engine.parameters(), lr=LR)
    losses, first_grads, times = [], [], []
    for step in range(steps):
        t0 = time.perf_counter()
        losses.append(engine.train_step(x, y))
        if step < CHECK_STEPS:
            first_grads.append(engine.full_grads())
        opt.step()
        opt.zero_grad()
        times.append(time.perf_counter() - t0)
        if dist.get_rank() == 0 and (step % 10 == 0 or step == steps - 1):
            print(f"  step {step:4d}  loss {losses[-1]:.4f}  {times[-1] * 1e3:6.1f} ms/step", flush=True)
        x, y = data.next()
    return losses, first_grads, sorted(times)[len(times) // 2]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tp", type=int, default=2)
    ap.add_argument("--steps", type=int, default=60)
    args = ap.parse_args()

    x, y = CorpusBatches(BATCH, CFG.seq_len, seed=0).next()
    program = autopar.parallelize(make_model(), tp=args.tp, example_inputs=(x,), example_targets=y,
                                  world_size=args.tp)
    print(program.summary())
    print(f"training on {args.tp} local CPU ranks (gloo), {args.steps} steps of {BATCH}x{CFG.seq_len} tokens")
    losses, grads, median = autopar.spawn(train, args.tp, (args.tp, args.steps))[0]
    print(f"loss {losses[0]:.3f} -> {losses[-1]:.3f}; median step {median * 1e3:.1f} ms")

    data = CorpusBatches(BATCH, CFG.seq_len, seed=0)
    batches = [((xb,), (yb,)) for xb, yb in (data.next() for _ in range(CHECK_STEPS))]
    ref_losses, ref_grads = single_device_run(make_model(), batches, autopar.lm_cross_entropy,
                                              optimizer=lambda ps: torch.optim.AdamW(ps, lr=LR))
    assert_parity(ref_losses[:1], ref_grads[0], losses[:1], grads[0], label="step 0")
    for step in range(1, CHECK_STEPS):
        assert_parity(ref_losses[: step + 1], ref_grads[step], losses[: step + 1], grads[step],
                      label=f"step {step}", rel_norm=1e-4)
    print(f"parity: the first {CHECK_STEPS} losses and every gradient match single-device training "
          f"({', '.join(f'{a:.5f}' for a in ref_losses)})")


if __name__ == "__main__":
    main()
