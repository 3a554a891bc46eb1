"""Train the reference GPT on two local gloo ranks (pp=2), write the measured trace, and lay it
beside its simulation (``autopar simulate --measured``): one SVG and one Perfetto trace per layout.

    python bench/measured_vs_predicted.py --out runs/measured              # 1F1B and interleaved (v=2)
    python bench/measured_vs_predicted.py --vp 2 --microbatches 8 --steps 10
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

import autopar
from autopar.cli import main as cli_main
from autopar.reference.models import build


def _train(path: str, v: int, m: int, steps: int, d_model: int, seq: int) -> None:
    """One rank: parallelize the GPT over pp=2, train ``steps`` steps, write the trace."""
    torch.manual_seed(0)
    model = build("gpt", vocab_size=256, seq_len=seq, n_layer=4, n_head=4, d_model=d_model)
    tokens = torch.randint(0, 256, (2 * m, seq + 1), generator=torch.Generator().manual_seed(0))
    x, y = tokens[:, :-1], tokens[:, 1:]
    program = autopar.parallelize(model, pp=2, virtual_stages=v, microbatches=m,
                                  example_inputs=(x[:2],), example_targets=y[:2])
    engine = program.materialize()
    optimizer = torch.optim.SGD(engine.parameters(), lr=1e-3)
    for step in range(steps):
        engine.train_step(x, y)
        optimizer.step()
        optimizer.zero_grad()
        if engine.mesh.rank == 0:
            print(f"  v={v} step {step + 1}/{steps}", flush=True)
    engine.write_trace(path, steps=steps)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="runs/measured", help="folder for the traces and pictures")
    ap.add_argument("--vp", type=int, nargs="+", default=[1, 2], help="virtual stages to run")
    ap.add_argument("--microbatches", type=int, default=8)
    ap.add_argument("--steps", type=int, default=8, help="training steps (the first is a warm-up)")
    ap.add_argument("--d-model", type=int, default=128)
    ap.add_argument("--seq", type=int, default=64)
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    for v in args.vp:
        path = os.path.join(args.out, f"pp2-v{v}.json")
        print(f"training pp=2 v={v} m={args.microbatches} on 2 gloo ranks, {args.steps} steps ...", flush=True)
        autopar.spawn(_train, 2, (path, v, args.microbatches, args.steps, args.d_model, args.seq))
        cli_main(["simulate", "--measured", path, "--svg", path.replace(".json", ".svg")])


if __name__ == "__main__":
    sys.exit(main())
