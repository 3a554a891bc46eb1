"""Compile a GPT-3-shaped model (175B) on the meta device for tp=8, pp=16 and inspect it.

    python examples/inspect_gpt.py [--layers 96] [--rank 9]

Nothing is allocated: the parameters live on the meta device, so this runs on
a laptop. It prints the plan (mesh, layers per chunk, memory per GPU,
collectives, bubble) and one rank's generated code.
"""

from __future__ import annotations

import argparse
import time

import torch

import autopar
from autopar.reference.models import ModelConfig, build


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, default=96)
    ap.add_argument("--hidden", type=int, default=12288)
    ap.add_argument("--heads", type=int, default=96)
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--vocab", type=int, default=50257)
    ap.add_argument("--micro-batch", type=int, default=1)
    ap.add_argument("--tp", type=int, default=8)
    ap.add_argument("--pp", type=int, default=16)
    ap.add_argument("--vp", type=int, default=3, help="virtual stages (96 layers / (16 * 3) = 2 per chunk)")
    ap.add_argument("--microbatches", type=int, default=64)
    ap.add_argument("--rank", type=int, default=9, help="whose code to print")
    ap.add_argument("--code-lines", type=int, default=60)
    args = ap.parse_args()

    cfg = ModelConfig(vocab_size=args.vocab, seq_len=args.seq, n_layer=args.layers, n_head=args.heads,
                      d_model=args.hidden)
    with torch.device("meta"):
        model = build("gpt", cfg)
    x = torch.zeros(args.micro_batch, args.seq, dtype=torch.long)
    t0 = time.perf_counter()
    program = autopar.parallelize(model, tp=args.tp, pp=args.pp, virtual_stages=args.vp,
                                  microbatches=args.microbatches, recompute="layer", precision="bf16",
                                  example_inputs=(x,), example_targets=x)
    seconds = time.perf_counter() - t0
    print(program.summary())
    code = program.code(rank=args.rank).splitlines()
    print("\n".join(code[: args.code_lines]))
    if len(code) > args.code_lines:
        print(f"... ({len(code) - args.code_lines} more lines: program.code(rank={args.rank}))")
    print(f"\ncompiled in {seconds:.1f} s on the meta device (no parameter memory allocated)")


if __name__ == "__main__":
    main()
