"""Benchmark: how long a checkpoint save holds up the training loop, synchronous vs asynchronous.

A GPT of a few hundred MB (default: d_model 768, 8 layers, vocabulary 8192:
~63M parameters, 250 MB in fp32; with AdamW's two moments a checkpoint of
~760 MB) trains at tp=2 x pp=2 on 4 gloo CPU ranks (1 thread each). The same
engine runs three loops of ``--steps`` steps, one after another:

- ``none``:  steps only (the baseline);
- ``sync``:  ``engine.save(..., async_save=False)`` every ``--every`` steps;
- ``async``: ``engine.save(..., async_save=True)`` every ``--every`` steps, the
             last save waited for at the end of the loop.

Per save, the time ``engine.save`` blocked the loop (rank 0's view, after a
barrier: with sync that is the whole write and publication; with async the
copy to host memory, plus any wait for the previous save still writing).
Per loop, the wall time of the whole loop; ``loop overhead / save`` is
(loop - baseline loop) / saves, which also counts what the background writes
cost the steps running beside them (on a CPU they share the cores). Medians
over the saves of ``--rounds`` rounds; each finished checkpoint but the newest
is deleted outside the timed region, so the disk holds at most two at a time.

    .venv/bin/python bench/checkpoint_save.py [--steps 8 --every 2 --rounds 1 --dir /tmp]
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist

import autopar
from autopar.reference.models import build
from gpt_flags import add_gpt_flags

MODES = ("none", "sync", "async")
WORLD = 4


def _engine(a):
    torch.manual_seed(0)
    model = build("gpt", vocab_size=a.vocab, seq_len=a.seq, n_layer=a.layers, n_head=a.heads, d_model=a.d_model)
    x = torch.randint(0, a.vocab, (a.mb, a.seq))
    program = autopar.parallelize(model, tp=2, pp=2, microbatches=2, example_inputs=(x,), example_targets=(x,))
    engine = program.materialize()
    return engine, torch.optim.AdamW(engine.parameters(), lr=1e-4)


def _prune(root: Path, keep: str) -> None:
    """Rank 0 deletes every finished checkpoint under ``root`` but ``keep`` (outside the timed region)."""
    if dist.get_rank() == 0:
        for path in root.glob("step-*"):
            if path.name != keep and not path.name.endswith(".partial"):
                shutil.rmtree(path)
    dist.barrier()


def _loop(engine, optimizer, batch, a, mode: str, root: Path, first_step: int) -> tuple[float, list[float]]:
    """``a.steps`` steps, saving every ``a.every`` in ``mode``; (loop seconds, blocked seconds per save)."""
    blocked, handle = [], None
    dist.barrier()
    start = time.perf_counter()
    for i in range(1, a.steps + 1):
        engine.train_step(*batch)
        optimizer.step()
        optimizer.zero_grad()
        if mode != "none" and i % a.every == 0:
            t = time.perf_counter()
            handle = engine.save(root, optimizer, step=first_step + i, async_save=mode == "async")
            blocked.append(time.perf_counter() - t)
            pause = time.perf_counter()
            _prune(root, handle.path.name if mode == "sync" else "")  # async: the previous one is complete
            start += time.perf_counter() - pause  # pruning is not part of the loop
    if handle is not None:
        handle.wait()
    dist.barrier()
    return time.perf_counter() - start, blocked


def _worker(a) -> dict:
    engine, optimizer = _engine(a)
    x = torch.randint(0, a.vocab, (2 * a.mb, a.seq), generator=torch.Generator().manual_seed(1))
    batch = (x, x)
    for _ in range(2):  # warm-up: allocator, gloo connections
        engine.train_step(*batch)
        optimizer.step()
        optimizer.zero_grad()
    out = {m: {"loop": [], "blocked": []} for m in MODES}
    root = Path(a.dir)
    for r in range(a.rounds):
        for k, mode in enumerate(MODES):
            loop, blocked = _loop(engine, optimizer, batch, a, mode, root / mode, (r * len(MODES) + k) * 1000)
            out[mode]["loop"].append(loop)
            out[mode]["blocked"] += blocked
    params = sum(p.numel() for _, p in engine.named_local_parameters())
    out["local_params"] = params
    return out


def _report(results: list[dict], a, checkpoint_bytes: int) -> None:
    r0 = results[0]
    params = sum(r["local_params"] for r in results[:WORLD])  # tied/replicated ones counted per holder
    base = statistics.median(r0["none"]["loop"])
    saves = a.steps // a.every
    print(f"model: d_model {a.d_model}, {a.layers} layers, vocabulary {a.vocab}; parameters held by the 4 ranks: "
          f"{params / 1e6:.1f}M; checkpoint {checkpoint_bytes / 2**20:.0f} MiB (weights + AdamW state)")
    print(f"{a.steps} steps per loop, a save every {a.every} ({saves} per loop), {a.rounds} round(s); rank 0's times\n")
    print(f"{'mode':6} {'blocked / save (median)':>24} {'min':>7} {'max':>7} {'loop (median)':>14} "
          f"{'loop overhead / save':>21}")
    rows = {}
    for mode in MODES:
        loop = statistics.median(r0[mode]["loop"])
        blocked = r0[mode]["blocked"] or [0.0]
        rows[mode] = (statistics.median(blocked), (loop - base) / saves if mode != "none" else 0.0)
        print(f"{mode:6} {rows[mode][0]:>23.3f}s {min(blocked):>6.3f}s {max(blocked):>6.3f}s {loop:>13.2f}s "
              f"{rows[mode][1]:>20.3f}s")
    (sb, so), (ab, ao) = rows["sync"], rows["async"]
    print(f"\nasync / sync: blocked per save {ab / sb:.3f} ({sb / ab:.1f}x less), "
          f"loop overhead per save {ao / so:.3f}" if sb > 0 and so > 0 else "")
    print(f"sync write rate: {checkpoint_bytes / 2**20 / sb:.0f} MiB/s for the whole checkpoint (4 ranks writing)")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=8, help="steps per loop")
    p.add_argument("--every", type=int, default=2, help="save every this many steps")
    p.add_argument("--rounds", type=int, default=1, help="repeat the three loops; times are pooled")
    add_gpt_flags(p, d_model=768, layers=8, heads=12, seq=64, vocab=8192)
    p.add_argument("--mb", type=int, default=1, help="rows per microbatch (2 microbatches per step)")
    p.add_argument("--dir", default=None, help="where the checkpoints go (a fresh temporary directory inside)")
    a = p.parse_args()
    a.dir = tempfile.mkdtemp(prefix="autopar-ckpt-bench-", dir=a.dir)
    try:
        results = autopar.spawn(_worker, WORLD, (a,), timeout_s=3600)
        newest = max((d for d in Path(a.dir, "sync").glob("step-*")), key=lambda d: d.name)
        size = sum(f.stat().st_size for f in newest.iterdir())
        _report(results, a, size)
    finally:
        shutil.rmtree(a.dir, ignore_errors=True)


if __name__ == "__main__":
    main()
