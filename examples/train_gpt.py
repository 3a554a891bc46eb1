"""The main job: train a small GPT with 3D parallelism on local CPU ranks.

    python examples/train_gpt.py                 # 8 ranks: tp=2 x pp=2 (interleaved, v=2) x dp=2
    python examples/train_gpt.py --tp 2 --pp 1 --dp 1 --steps 100
    autopar run --nproc 8 examples/train_gpt.py  # or torchrun --nproc-per-node 8 examples/train_gpt.py

The model is compiled first (bad layouts fail here, before any process
starts) and its plan printed; the ranks train on the repository's own text
with a progress bar; at the end the first steps are checked against
single-device training: same losses, same gradients.
"""

from __future__ import annotations

import argparse
import math
import os
import time

import torch

import autopar
from autopar.reference.data import CorpusBatches
from autopar.reference.models import ModelConfig, build
from autopar.reference.parity import FP32_TOLERANCE, assert_parity, single_device_run

CFG = ModelConfig(vocab_size=256, seq_len=64, n_layer=4, n_head=4, d_model=128, dropout=0.0)
CHECK_STEPS = 3


def make_model() -> torch.nn.Module:
    torch.manual_seed(0)
    return build("gpt", CFG)


def lr_factor(step: int, steps: int) -> float:
    """Linear warm-up over the first tenth of the steps, then cosine decay to a tenth."""
    warmup = max(1, steps // 10)
    if step < warmup:
        return (step + 1) / warmup
    progress = (step - warmup) / max(1, steps - warmup)
    return 0.1 + 0.45 * (1 + math.cos(math.pi * min(progress, 1.0)))


def compile_program(args, world_size=None) -> autopar.ParallelProgram:
    x, y = CorpusBatches(args.micro_batch, CFG.seq_len).next()
    return autopar.parallelize(make_model(), tp=args.tp, pp=args.pp, dp=args.dp, virtual_stages=args.vp,
                               microbatches=args.microbatches, recompute=args.recompute, precision=args.precision,
                               example_inputs=(x,), example_targets=y, world_size=world_size)


def global_batches(args, steps: int):
    data = CorpusBatches(args.micro_batch * args.microbatches * args.dp, CFG.seq_len, seed=0)
    return [data.next() for _ in range(steps)]


def train(args):
    import torch.distributed as dist
    from rich.progress import BarColumn, Progress, TextColumn, TimeRemainingColumn

    program = compile_program(args)
    engine = program.materialize()
    opt = torch.optim.AdamW(engine.parameters(), lr=args.lr, weight_decay=0.01)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: lr_factor(step, args.steps))
    losses, grads, times = [], [], []
    main = dist.get_rank() == 0
    columns = [TextColumn("[bold]step {task.completed}/{task.total}"), BarColumn(),
               TextColumn("loss {task.fields[loss]:.3f}  {task.fields[ms]:.0f} ms/step"), TimeRemainingColumn()]
    with Progress(*columns, disable=not main, transient=False) as bar:
        task = bar.add_task("train", total=args.steps, loss=float("nan"), ms=0.0)
        for step, (x, y) in enumerate(global_batches(args, args.steps)):
            t0 = time.perf_counter()
            losses.append(engine.train_step(x, y))
            norm = engine.clip_grad_norm_(args.clip)
            if step < CHECK_STEPS:
                grads.append(engine.full_grads())
            opt.step()
            sched.step()
            opt.zero_grad()
            times.append(time.perf_counter() - t0)
            bar.update(task, advance=1, loss=losses[-1], ms=times[-1] * 1e3)
            del norm
    return losses, grads, sorted(times)[len(times) // 2], dict(engine.stats["bytes_sent"])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tp", type=int, default=2)
    ap.add_argument("--pp", type=int, default=2)
    ap.add_argument("--dp", type=int, default=2)
    ap.add_argument("--vp", type=int, default=2, help="virtual stages per pipeline stage (interleaved)")
    ap.add_argument("--microbatches", type=int, default=4)
    ap.add_argument("--micro-batch", type=int, default=2, help="sequences per microbatch")
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--clip", type=float, default=1.0)
    ap.add_argument("--recompute", default="none", choices=["none", "layer", "chunk"])
    ap.add_argument("--precision", default="fp32", choices=["fp32", "bf16"])
    args = ap.parse_args()
    if args.pp == 1:
        args.vp = 1
    world = args.tp * args.pp * args.dp
    launched = "RANK" in os.environ  # under torchrun / autopar run this process is one rank
    is_main = os.environ.get("RANK", "0") == "0"

    program = compile_program(args, world_size=world)
    if is_main:
        print(program.summary())
        print(program.schedule)
        tokens = args.micro_batch * args.microbatches * args.dp * CFG.seq_len
        print(f"\ntraining on {world} {'ranks' if launched else 'local CPU ranks (gloo)'}: "
              f"{args.steps} steps of {tokens} tokens")
    results = autopar.spawn(train, world, (args,))
    if not is_main:
        return
    losses, grads, median, sent = results[0]
    print(f"loss {losses[0]:.3f} -> {min(losses[-5:]):.3f} over {args.steps} steps; "
          f"median step {median * 1e3:.0f} ms; rank 0 sent {sum(sent.values()) / 2**20:.2f} MiB per step")

    batches = [((x,), (y,)) for x, y in global_batches(args, CHECK_STEPS)]
    first_lr = args.lr * lr_factor(0, args.steps)  # the schedule's lr at step 0
    optimizer = lambda ps: torch.optim.AdamW(ps, lr=first_lr, weight_decay=0.01)  # noqa: E731
    ref_losses, ref_grads = single_device_run(make_model(), batches[:1], autopar.lm_cross_entropy,
                                              optimizer=optimizer, clip_grad_norm=args.clip,
                                              precision=args.precision)
    tol = FP32_TOLERANCE if args.precision == "fp32" else {"rtol": 2e-2, "atol": 1e-3, "rel_norm": 5e-2}
    assert_parity(ref_losses, ref_grads[0], losses[:1], grads[0], label="step 0", **tol)
    print(f"parity: step 0's loss ({ref_losses[0]:.6f}) and all {len(ref_grads[0])} gradients match "
          f"single-device training (rtol {tol['rtol']:g}, atol {tol['atol']:g})")


if __name__ == "__main__":
    main()
