"""Benchmark: what the memory features cost in step time and save in bytes, on CPU gloo ranks.

Section 1, the distributed optimizer (ZeRO stage 1), dp=2 on 2 ranks, a small
GPT from ``autopar.reference.models`` (default: d_model 256, 4 layers,
vocabulary 8192: ~5M parameters), AdamW, four runs of the same model and data:

- autopar, AdamW over ``engine.parameters()`` (every replica the whole state);
- autopar, ``engine.distributed_optimizer(torch.optim.AdamW)`` (1/d of it);
- PyTorch's DDP with AdamW;
- PyTorch's DDP with ``torch.distributed.optim.ZeroRedundancyOptimizer(AdamW)``,
  PyTorch's own ZeRO stage 1 (whole parameters assigned to ranks).

Per run: the median step time over ``--steps`` steps after 2 warm-up steps
(rank 0's; a step is forward, backward, optimizer step and zero_grad, and for
the distributed optimizer the wait for its parameter all-gathers too, which a
training loop would overlap with the next forward: no credit is taken for
that). The runs' steps are interleaved (one step of each in turn, the ranks
meeting at a barrier before each), so a machine whose load changes, as a
shared one's does, slows every run alike. And, per rank, the optimizer state's bytes (moments and step counts) and the
flat buffers a sharded optimizer adds (autopar's fp32 master ranges and
gradient shards); the largest over the ranks. Ratios are printed below.

Section 2, sequence parallelism (tp=2 with and without): step time and the
activation bytes kept for the backward (the engine's ``peak_activation_bytes``).
It runs when ``autopar.parallelize`` takes ``sequence_parallel``, and is
skipped with a line saying so otherwise.

    .venv/bin/python bench/memory_features.py [--steps 10 --d-model 256 --layers 4]
"""

from __future__ import annotations

import argparse
import inspect
import statistics
import time

import torch
import torch.distributed as dist

import autopar
from autopar.reference.models import build
from gpt_flags import add_gpt_flags

WORLD = 2
MiB = 2**20


def _say(text: str) -> None:
    """Progress, from rank 0 only."""
    if dist.get_rank() == 0:
        print(text, flush=True)


def _model(a):
    torch.manual_seed(0)
    return build("gpt", vocab_size=a.vocab, seq_len=a.seq, n_layer=a.layers, n_head=a.heads, d_model=a.d_model)


def _batch(a):
    """The global batch: one microbatch of ``a.mb`` rows per replica."""
    g = torch.Generator().manual_seed(1)
    return (torch.randint(0, a.vocab, (WORLD * a.mb, a.seq), generator=g),
            torch.randint(0, a.vocab, (WORLD * a.mb, a.seq), generator=g))


def _timed(steps: dict, a) -> dict:
    """Name -> median seconds of ``steps[name]()`` over ``a.steps`` steps after 2 warm-up steps, the
    runs' steps interleaved."""
    for step in steps.values():
        for _ in range(2):
            step()
    times: dict = {name: [] for name in steps}
    for _ in range(a.steps):
        for name, step in steps.items():
            dist.barrier()
            t = time.perf_counter()
            step()
            times[name].append(time.perf_counter() - t)
    return {name: statistics.median(t) for name, t in times.items()}


def _state_bytes(state) -> int:
    return sum(t.numel() * t.element_size() for s in state.values() for t in s.values() if isinstance(t, torch.Tensor))


# ----------------------------------------------------------- section 1: ZeRO 1
def _autopar_run(a, distributed: bool) -> dict:
    x, y = _batch(a)
    program = autopar.parallelize(_model(a), microbatches=1, example_inputs=(x[: a.mb],), example_targets=(y[: a.mb],))
    engine = program.materialize()
    if distributed:
        optimizer = engine.distributed_optimizer(torch.optim.AdamW, lr=1e-4)
    else:
        optimizer = torch.optim.AdamW(engine.parameters(), lr=1e-4)

    def step():
        engine.train_step(x, y)
        optimizer.step()
        optimizer.zero_grad()
        engine.wait_parameters()  # the runs are interleaved: no gather may run on under another's step

    def sizes():
        buffers = optimizer.buffer_bytes() if distributed else 0
        return {"state": _state_bytes(optimizer.state), "buffers": buffers,
                "params": sum(p.numel() for p in engine.parameters())}
    return step, sizes


def _ddp_run(a, zero: bool) -> dict:
    from torch.distributed.optim import ZeroRedundancyOptimizer
    from torch.nn.parallel import DistributedDataParallel

    x, y = _batch(a)
    rows = slice(dist.get_rank() * a.mb, (dist.get_rank() + 1) * a.mb)
    model = DistributedDataParallel(_model(a))
    if zero:
        optimizer = ZeroRedundancyOptimizer(model.parameters(), optimizer_class=torch.optim.AdamW, lr=1e-4)
    else:
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)

    def step():
        autopar.lm_cross_entropy(model(x[rows]), y[rows]).backward()
        optimizer.step()
        optimizer.zero_grad()

    def sizes():
        state = optimizer.optim.state if zero else optimizer.state
        return {"state": _state_bytes(state), "buffers": 0, "params": sum(p.numel() for p in model.parameters())}
    return step, sizes


RUNS = {"autopar, AdamW": lambda a: _autopar_run(a, False),
        "autopar, distributed AdamW": lambda a: _autopar_run(a, True),
        "torch DDP, AdamW": lambda a: _ddp_run(a, False),
        "torch DDP, ZeroRedundancyOptimizer": lambda a: _ddp_run(a, True)}


def _zero_section(a) -> dict:
    built = {}
    for i, (name, run) in enumerate(RUNS.items()):
        _say(f"  [{i + 1}/{len(RUNS)}] building {name} ...")
        built[name] = run(a)
    _say(f"  timing {a.steps} steps of each, interleaved ...")
    seconds = _timed({name: step for name, (step, _) in built.items()}, a)
    return {name: {"step": seconds[name], **sizes()} for name, (_, sizes) in built.items()}


# ------------------------------------------------- section 2: sequence parallel
def _sequence_parallel_section(a) -> dict | None:
    if "sequence_parallel" not in inspect.signature(autopar.parallelize).parameters:
        return None
    x, y = _batch(a)
    engines, steps = {}, {}
    for i, flag in enumerate((False, True)):
        _say(f"  [{i + 1}/2] building tp=2, sequence_parallel={flag} ...")
        program = autopar.parallelize(_model(a), tp=2, microbatches=1, sequence_parallel=flag,
                                      example_inputs=(x[: a.mb],), example_targets=(y[: a.mb],))
        engines[flag] = program.materialize()
        steps[flag] = _plain_step(engines[flag], x[: a.mb], y[: a.mb])
    _say(f"  timing {a.steps} steps of each, interleaved ...")
    seconds = _timed(steps, a)
    return {flag: {"step": seconds[flag], "kept": engine.stats["peak_activation_bytes"]}
            for flag, engine in engines.items()}


def _plain_step(engine, x, y):
    """One training step of ``engine`` with AdamW."""
    optimizer = torch.optim.AdamW(engine.parameters(), lr=1e-4)

    def step():
        engine.train_step(x, y)
        optimizer.step()
        optimizer.zero_grad()
    return step


def _worker(a) -> dict:
    _say("section 1: the distributed optimizer, dp=2")
    zero = _zero_section(a)
    _say("section 2: sequence parallelism, tp=2")
    return {"zero": zero, "sp": _sequence_parallel_section(a)}


# --------------------------------------------------------------------- report
def _report_zero(results: list[dict], a) -> None:
    runs = {name: [r["zero"][name] for r in results] for name in RUNS}
    params = runs["autopar, AdamW"][0]["params"]
    print(f"\n1. dp=2 on {WORLD} CPU gloo ranks (1 thread each): GPT d_model {a.d_model}, {a.layers} layers, "
          f"vocabulary {a.vocab},\n   {params / 1e6:.1f}M parameters; {a.mb} x {a.seq} tokens per replica per step; "
          f"median of {a.steps} steps")
    print(f"   {'run':<36}{'step ms':>10}{'state/rank MiB':>17}{'+buffers MiB':>15}")
    rows = {}
    for name, per_rank in runs.items():
        step = per_rank[0]["step"]
        state = max(r["state"] for r in per_rank)
        buffers = max(r["buffers"] for r in per_rank)
        rows[name] = (step, state, state + buffers)
        print(f"   {name:<36}{step * 1e3:>10.1f}{state / MiB:>17.2f}{buffers / MiB:>15.2f}")
    for label, num, den in (("autopar distributed / autopar AdamW", "autopar, distributed AdamW", "autopar, AdamW"),
                            ("torch ZeRO / torch DDP AdamW", "torch DDP, ZeroRedundancyOptimizer", "torch DDP, AdamW"),
                            ("autopar distributed / torch ZeRO", "autopar, distributed AdamW",
                             "torch DDP, ZeroRedundancyOptimizer")):
        (s1, b1, t1), (s0, b0, t0) = rows[num], rows[den]
        print(f"   {label:<38} step x{s1 / s0:.2f}   state x{b1 / b0:.2f}   state+buffers x{t1 / t0:.2f}")


def _report_sp(results: list[dict]) -> None:
    sp = results[0]["sp"]
    if sp is None:
        print("\n2. sequence parallelism: skipped (autopar.parallelize takes no sequence_parallel argument yet)")
        return
    print(f"\n2. tp=2, with and without sequence parallelism (rank 0)\n   {'run':<36}{'step ms':>10}{'kept MiB':>12}")
    for flag in (False, True):
        print(f"   {'sequence_parallel=' + str(flag):<36}{sp[flag]['step'] * 1e3:>10.1f}{sp[flag]['kept'] / MiB:>12.2f}")
    off, on = sp[False], sp[True]
    print(f"   with / without: step x{on['step'] / off['step']:.2f}   kept activations x{on['kept'] / off['kept']:.2f}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=10, help="timed steps per run (after 2 warm-up steps)")
    add_gpt_flags(p, d_model=256, layers=4, heads=4, seq=64, vocab=8192)
    p.add_argument("--mb", type=int, default=4, help="rows per replica per step")
    a = p.parse_args()
    print(f"memory features on {WORLD} CPU ranks: {len(RUNS)} runs of section 1, then section 2", flush=True)
    results = autopar.spawn(_worker, WORLD, (a,), timeout_s=3600)
    _report_zero(results, a)
    _report_sp(results)


if __name__ == "__main__":
    main()
