"""Benchmark: context parallelism (cp) on CPU gloo ranks, one model, one run.

An HF Llama (grouped-query attention, rotary positions, causal; same seed, weights and batches),
trained by autopar with each sequence split over cp = 1, 2, 4 ranks (world = cp; 1 thread per
rank; the load-balanced layout, ring attention):

1. **The longest sequence that fits a per-rank memory budget.** For each cp the sequence length
   doubles from ``--start`` until one training step keeps more than the budget on a rank: the
   parameter state (fp32 weights, gradients and AdamW's two moments, the same at every cp: the
   parameters are replicated over cp) plus the activation bytes autograd keeps for the backward
   at the step's peak (the engine's own count, ``peak_activation_bytes``). The budget is the
   parameter state plus ``--budget-mib`` of activations. Printed: each length tried, the bytes
   kept per rank, and the longest that fits.
2. **Step time per token at an equal sequence** (``--seq``): the median over ``--steps`` timed
   steps (a warm-up step first, a barrier before each) of rank 0's step, forward + backward +
   AdamW, per token of the global batch, and its ratio to cp=1's. With more ranks than cores the
   ranks share the cores, so the ratio reads against cp=1 on one core: a CPU cannot show the
   speed-up of cp ranks each with a GPU, only what the ring and the smaller blocks cost.

PyTorch's own context parallelism (``torch.distributed.tensor.experimental.context_parallel``)
dispatches only the flash and memory-efficient SDPA kernels of CUDA devices; it has no CPU path to
compare with here, so this benchmark has no peer column.

    .venv/bin/python bench/context_parallel.py [--hidden 64 --layers 2 --seq 1024 --budget-mib 24 --steps 5]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist

import autopar

CPS = (1, 2, 4)
_PROGRAM = None  # the program the next spawn's ranks run (forked with it)


def make_model(a):
    import transformers

    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=a.vocab, hidden_size=a.hidden, intermediate_size=4 * a.hidden,
                                   num_hidden_layers=a.layers, num_attention_heads=a.heads,
                                   num_key_value_heads=a.heads // 2, max_position_embeddings=1 << 16)
    return transformers.LlamaForCausalLM(cfg)


def batches(a, seq: int, steps: int):
    g = torch.Generator().manual_seed(1)
    return [torch.randint(0, a.vocab, (a.batch, seq), generator=g) for _ in range(steps)]


def compile_for(a, cp: int, seq: int):
    x = batches(a, seq, 1)[0]
    return autopar.parallelize(make_model(a), cp=cp, world_size=cp, example_inputs=(x,), example_targets=(x,))


def _rank_run(a, seq: int, steps: int) -> dict:
    """In a rank: the program trained ``steps`` steps (the first a warm-up); its step times, peak kept
    activation bytes and parameter state bytes."""
    torch.set_num_threads(1)
    engine = _PROGRAM.materialize()
    opt = torch.optim.AdamW(engine.parameters(), lr=1e-3)
    times, peak = [], 0
    for x in batches(a, seq, steps):
        dist.barrier() if dist.is_initialized() else None
        start = time.perf_counter()
        engine.train_step(x, x)
        opt.step()
        opt.zero_grad()
        times.append(time.perf_counter() - start)
        peak = max(peak, engine.stats["peak_activation_bytes"])
    state = sum(p.numel() * p.element_size() for p in engine.parameters()) * 4  # weights, grads, m, v
    return {"times": times[1:], "kept": peak, "state": state}


def run(a, cp: int, seq: int, steps: int) -> dict:
    global _PROGRAM
    _PROGRAM = compile_for(a, cp, seq)
    if cp == 1:
        return _rank_run(a, seq, steps)
    return autopar.spawn(_rank_run, cp, (a, seq, steps), timeout_s=1800, inherit=True)[0]


def _mib(n: float) -> str:
    return f"{n / 2**20:7.2f} MiB"


def longest_that_fits(a) -> dict[int, int]:
    print(f"1. longest sequence within the budget: parameter state + {a.budget_mib} MiB of kept activations per rank")
    print(f"{'cp':>3} {'seq':>7} {'kept per rank':>15} {'state':>12} {'fits':>5}")
    best = {}
    for cp in CPS:
        seq, fits = a.start, 0
        while True:
            got = run(a, cp, seq, steps=1)
            ok = got["kept"] <= a.budget_mib * 2**20
            print(f"{cp:>3} {seq:>7} {_mib(got['kept']):>15} {_mib(got['state']):>12} {'yes' if ok else 'no':>5}",
                  flush=True)
            if not ok:
                break
            fits, seq = seq, seq * 2
        best[cp] = fits
    print("longest that fits: " + ", ".join(f"cp={cp}: {s} tokens" for cp, s in best.items()) +
          (f"  ({best[CPS[-1]] / best[1]:.1f}x at cp={CPS[-1]})" if best[1] else ""))
    return best


def time_per_token(a) -> None:
    print(f"\n2. step time per token at {a.seq} tokens a sequence, {a.batch} sequences a step "
          f"(median of {a.steps} steps after a warm-up; {os.cpu_count()} cores shared by the ranks)")
    print(f"{'cp':>3} {'ranks':>5} {'step (ms)':>10} {'IQR (ms)':>9} {'us/token':>9} {'vs cp=1':>8} {'kept/rank':>12}")
    base = None
    for cp in CPS:
        got = run(a, cp, a.seq, steps=a.steps + 1)
        times = sorted(got["times"])
        med = statistics.median(times)
        q = statistics.quantiles(times, n=4) if len(times) >= 2 else [med, med, med]
        per_token = med / (a.batch * a.seq) * 1e6
        base = base or per_token
        print(f"{cp:>3} {cp:>5} {med * 1e3:>10.1f} {(q[2] - q[0]) * 1e3:>9.1f} {per_token:>9.2f} "
              f"{per_token / base:>7.2f}x {_mib(got['kept']):>12}", flush=True)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--vocab", type=int, default=256)
    p.add_argument("--hidden", type=int, default=64)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--seq", type=int, default=1024, help="sequence length of the timing part")
    p.add_argument("--start", type=int, default=512, help="first sequence length of the memory part")
    p.add_argument("--budget-mib", type=float, default=24.0, help="kept activation bytes allowed per rank")
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--only", choices=("memory", "time"), default=None)
    a = p.parse_args(argv)
    print(f"HF Llama: hidden {a.hidden}, {a.heads} heads ({a.heads // 2} kv), {a.layers} layers, vocab {a.vocab}; "
          f"torch {torch.__version__}", flush=True)
    if a.only != "time":
        longest_that_fits(a)
    if a.only != "memory":
        time_per_token(a)


if __name__ == "__main__":
    sys.exit(main())
