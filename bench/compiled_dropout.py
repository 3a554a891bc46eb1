"""Check: dropout in Inductor-compiled chunks draws the eager chunks' masks (one process, no parallelism).

A small GPT with dropout 0.2 is run one training step by autopar eagerly and
with ``compile=True`` (Inductor), from the same seed; the losses and every
gradient are compared. Inductor lowers random ops to torch's own kernels for
autopar's chunks (``INDUCTOR_CONFIG``: ``fallback_random``), so the masks are
the same and only the fused kernels' summation order differs. ``--inductor-rng``
compiles with Inductor's own random kernels instead, to show the difference
they make. Takes about a minute (Inductor's compile).

    .venv/bin/python bench/compiled_dropout.py [--inductor-rng]
"""

from __future__ import annotations

import argparse
import contextlib

import torch

import autopar
from autopar.reference.models import ModelConfig, build


def one_step(compile_mode):
    torch.manual_seed(0)
    model = build("gpt", ModelConfig(vocab_size=64, seq_len=16, n_layer=2, n_head=2, d_model=32, dropout=0.2))
    x = torch.randint(0, 64, (4, 16))
    engine = autopar.parallelize(model, example_inputs=(x,), example_targets=x.roll(1, 1),
                                 compile=compile_mode).materialize()
    torch.manual_seed(1)
    loss = engine.train_step(x, x.roll(1, 1))
    return loss, engine.full_grads()


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--inductor-rng", action="store_true", help="compile with Inductor's own random kernels")
    a = p.parse_args()
    eager_loss, eager_grads = one_step(None)
    print("compiling with Inductor...", flush=True)
    patch = contextlib.nullcontext()
    if a.inductor_rng:
        import autopar.runtime.engine.compiled_split as split
        patch = _patched(split.INDUCTOR_CONFIG, fallback_random=False)
    with patch:
        loss, grads = one_step("inductor")
    worst = max(float((grads[n] - eager_grads[n]).abs().max()) for n in eager_grads)
    print(f"loss eager {eager_loss:.7f}, compiled {loss:.7f} (difference {abs(loss - eager_loss):.1e}); "
          f"largest gradient difference {worst:.1e} over {len(grads)} parameters")


@contextlib.contextmanager
def _patched(table: dict, **values):
    old = dict(table)
    table.update(values)
    try:
        yield
    finally:
        table.clear()
        table.update(old)


if __name__ == "__main__":
    main()
