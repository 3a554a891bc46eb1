"""Benchmark: autopar tp=2 vs PyTorch DTensor tensor parallelism vs one process (CPU, gloo).

Trains the same nanoGPT-style ``gpt`` model (same seed, same weights, same
batches, AdamW) with

1. autopar ``parallelize(model, tp=2)`` on 2 gloo ranks (``autopar.spawn``),
2. ``torch.distributed.tensor.parallel`` at tp=2 on 2 gloo ranks: Colwise q/k/v
   and mlp.fc, Rowwise attn.proj and mlp.proj. Embeddings and the (tied) LM
   head stay replicated on every rank: the simplest faithful setup,
3. (optional, on by default) the same DTensor plan plus a vocabulary-parallel
   embedding/LM head and ``loss_parallel`` -- this is the setup that matches what
   autopar compiles (autopar also shards the vocabulary),
4. a single process with ``torch.set_num_threads(1)`` (fair per-rank
   comparison) and with 2 threads (all cores of this machine),

and reports rank 0's median step time (forward + backward + optimizer step),
IQR, CPU/wall ratio, first/last losses and the time ratios. The configurations
run ``--rounds`` times interleaved and the per-step times are pooled, which
blunts bursts of background load on a shared machine (compare the medians with
the min column: a large gap means the machine was busy).

    .venv/bin/python bench/tp_vs_dtensor.py [--steps 6 --rounds 2 --d-model 256 --layers 4 ...]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
import types

import torch
import torch.distributed as dist
import torch.nn.functional as F

import autopar
from autopar.reference.models import ModelConfig, build
from gpt_flags import add_gpt_flags
from pooling import pool_round

TP = 2


# ----------------------------------------------------------------- helpers
def make_cfg(a) -> ModelConfig:
    return ModelConfig(vocab_size=a.vocab, seq_len=a.seq, n_layer=a.layers, n_head=a.heads, d_model=a.d_model)


def make_model(a):
    torch.manual_seed(0)  # identical initial weights in every configuration / rank
    return build("gpt", make_cfg(a))


def make_batches(a):
    g = torch.Generator().manual_seed(1234)  # identical data in every configuration / rank
    return [(torch.randint(0, a.vocab, (a.batch, a.seq), generator=g),
             torch.randint(0, a.vocab, (a.batch, a.seq), generator=g)) for _ in range(a.warmup + a.steps)]


def _as_float(loss) -> float:
    if hasattr(loss, "full_tensor"):  # DTensor (loss_parallel returns a replicated DTensor)
        loss = loss.full_tensor()
    return float(loss.detach())


class _nullctx:
    def __enter__(self):
        return None

    def __exit__(self, *exc):
        return False


def timed_loop(step, batches, warmup: int, distributed: bool, profile: bool = False):
    """Run ``step(x, y) -> float`` on every batch; time the ones after ``warmup``."""
    losses, times, cpu = [], [], []
    for i, (x, y) in enumerate(batches):
        if i == warmup and distributed:
            dist.barrier()
        c0, t0 = time.process_time(), time.perf_counter()
        losses.append(step(x, y))
        t1, c1 = time.perf_counter(), time.process_time()
        if i >= warmup:
            times.append(t1 - t0)
            cpu.append(c1 - c0)
    prof_table = None
    if profile:  # every rank runs the 2 extra steps (collectives); only rank 0 records them
        from torch.profiler import ProfilerActivity, profile as tprofile

        record = not distributed or dist.get_rank() == 0
        x, y = batches[-1]
        with tprofile(activities=[ProfilerActivity.CPU]) if record else _nullctx() as prof:
            for _ in range(2):
                step(x, y)
        if record:
            prof_table = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=15)
    return {"times": times, "cpu": cpu, "losses": losses, "profile": prof_table}


# ------------------------------------------------------------------ autopar
def autopar_worker(a):
    model = make_model(a)
    batches = make_batches(a)
    x0, y0 = batches[0]
    t0 = time.perf_counter()
    program = autopar.parallelize(model, tp=TP, example_inputs=(x0,), example_targets=y0)
    engine = program.materialize()
    setup_s = time.perf_counter() - t0
    opt = torch.optim.AdamW(engine.parameters(), lr=a.lr)

    def step(x, y):
        loss = engine.train_step(x, y)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss

    out = timed_loop(step, batches, a.warmup, True, a.profile)
    out["setup_s"] = setup_s
    return out


# ------------------------------------------------------------------ DTensor
def _local_heads_forward(self, x):
    """CausalSelfAttention.forward with C taken from the (local) q/k/v width.

    autopar/models.py uses ``C = x.shape[-1]`` (the full d_model) for the head
    size and the final ``view(B, T, C)``; under ColwiseParallel the q/k/v
    outputs are local tensors of width d_model/tp, so both must use that.
    """
    B, T, _ = x.shape
    q, k, v = self.q(x), self.k(x), self.v(x)
    C = q.shape[-1]
    hd = C // self.n_head  # n_head was divided by tp
    q = q.view(B, T, self.n_head, hd).transpose(1, 2)
    k = k.view(B, T, self.n_head, hd).transpose(1, 2)
    v = v.view(B, T, self.n_head, hd).transpose(1, 2)
    y = F.scaled_dot_product_attention(q, k, v, is_causal=True,
                                       dropout_p=self.dropout if self.training else 0.0)
    y = y.transpose(1, 2).contiguous().view(B, T, C)
    return self.proj(y)


def dtensor_worker(a, vocab_parallel: bool):
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (ColwiseParallel, RowwiseParallel, loss_parallel,
                                                   parallelize_module)

    model = make_model(a)
    batches = make_batches(a)
    t0 = time.perf_counter()
    mesh = DeviceMesh("cpu", list(range(TP)))
    for blk in model.h:
        assert blk.attn.n_head % TP == 0, "n_head must be divisible by tp"
        blk.attn.n_head //= TP  # local heads, as torchtitan does
        blk.attn.forward = types.MethodType(_local_heads_forward, blk.attn)
        parallelize_module(blk, mesh, {
            "attn.q": ColwiseParallel(), "attn.k": ColwiseParallel(), "attn.v": ColwiseParallel(),
            "attn.proj": RowwiseParallel(),
            "mlp.fc": ColwiseParallel(), "mlp.proj": RowwiseParallel(),
        })
    if vocab_parallel:
        tied = model.lm_head.weight is model.wte.weight
        # Embedding (V, d) rowwise and LM head (V, d) colwise both shard dim 0 of the weight.
        parallelize_module(model, mesh, {
            "wte": RowwiseParallel(input_layouts=Replicate(), output_layouts=Replicate()),
            "lm_head": ColwiseParallel(output_layouts=Shard(-1), use_local_output=False),
        })
        if tied:  # parallelize_module re-registers the parameters: re-tie the two Shard(0) DTensors
            model.lm_head.weight = model.wte.weight
            assert model.lm_head.weight.placements == (Shard(0),)
    setup_s = time.perf_counter() - t0
    # dedupe (tied weights) while keeping order
    params = list({id(p): p for p in model.parameters()}.values())
    opt = torch.optim.AdamW(params, lr=a.lr)

    def step(x, y):
        logits = model(x)
        if vocab_parallel:
            with loss_parallel():
                loss = F.cross_entropy(logits.flatten(0, -2), y.flatten())
                loss.backward()
        else:
            loss = autopar.lm_cross_entropy(logits, y)
            loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return _as_float(loss)

    out = timed_loop(step, batches, a.warmup, True, a.profile)
    out["setup_s"] = setup_s
    return out


# ----------------------------------------------------------- single process
def single_run(a, threads: int):
    old = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        model = make_model(a)
        batches = make_batches(a)
        opt = torch.optim.AdamW(model.parameters(), lr=a.lr)

        def step(x, y):
            loss = autopar.lm_cross_entropy(model(x), y)
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            return float(loss.detach())

        out = timed_loop(step, batches, a.warmup, False, a.profile and threads == 1)
        out["setup_s"] = 0.0
        return out
    finally:
        torch.set_num_threads(old)


# -------------------------------------------------------------------- main
def stats(times):
    q = statistics.quantiles(times, n=4) if len(times) >= 2 else [times[0]] * 3
    return statistics.median(times), q[2] - q[0]


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=6, help="timed steps (after warm-up) per round")
    p.add_argument("--warmup", type=int, default=2, help="untimed warm-up steps per round")
    p.add_argument("--rounds", type=int, default=2,
                   help="repeat all configurations this many times, interleaved; times are pooled")
    add_gpt_flags(p, d_model=256, layers=4, heads=4, seq=128, vocab=8192)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--no-vocab-parallel-dtensor", action="store_true",
                   help="skip the DTensor run with vocab-parallel embedding/LM head + loss_parallel")
    p.add_argument("--profile", action="store_true",
                   help="after timing, torch.profiler 2 steps on rank 0 of the TP runs and print the top ops")
    a = p.parse_args()
    if a.heads % TP or a.d_model % a.heads or a.vocab % TP:
        p.error(f"heads and vocab must be divisible by tp={TP}, d_model by heads")

    from rich.console import Console
    from rich.table import Table

    con = Console(width=max(Console().width, 132))  # wide enough for the table when piped
    cfg = make_cfg(a)
    n_params = sum(p.numel() for p in {id(p): p for p in make_model(a).parameters()}.values())
    con.print(f"[bold]model[/]: gpt (nanoGPT-style, tied LM head) d_model={cfg.d_model} layers={cfg.n_layer} "
              f"heads={cfg.n_head} seq={cfg.seq_len} batch={a.batch} vocab={cfg.vocab_size} "
              f"params={n_params / 1e6:.2f}M; AdamW lr={a.lr}; {a.rounds} round(s) of warm-up {a.warmup} + "
              f"{a.steps} timed steps")
    con.print(f"torch {torch.__version__}, {os.cpu_count()} CPUs, load avg at start "
              f"{'/'.join(f'{x:.2f}' for x in os.getloadavg())}; TP runs: 2 gloo ranks, 1 thread each")

    configs = [("autopar tp=2", lambda a: autopar.spawn(autopar_worker, nprocs=TP, args=(a,))),
               ("DTensor tp=2 (emb/LM head replicated)",
                lambda a: autopar.spawn(dtensor_worker, nprocs=TP, args=(a, False)))]
    if not a.no_vocab_parallel_dtensor:
        configs.append(("DTensor tp=2 (vocab-parallel + loss_parallel)",
                        lambda a: autopar.spawn(dtensor_worker, nprocs=TP, args=(a, True))))
    configs += [("single, 1 thread", lambda a: [single_run(a, 1)]),
                ("single, 2 threads", lambda a: [single_run(a, 2)])]

    # Rounds run the configurations interleaved, so a burst of background load on a shared machine is
    # spread over all of them instead of landing on one; per-step times of all rounds are pooled.
    runs = {}  # label -> per-rank dicts (times/cpu pooled over rounds; losses, profile from round 1)
    t_all = time.perf_counter()
    for rnd in range(a.rounds):
        ra = argparse.Namespace(**{**vars(a), "profile": a.profile and rnd == 0})
        for label, fn in configs:
            pool_round(runs, label, fn(ra), summed=("times", "cpu"), peaks=("setup_s",))
    total_s = time.perf_counter() - t_all

    med, medcpu = {}, {}
    tab = Table(title="step time = forward + backward + AdamW step (rank 0 for TP runs; cpu/wall = process CPU "
                      "time / wall time per step, <1 means waiting on the peer or descheduled)")
    for col in ("configuration", "median ms", "IQR ms", "min ms", "rank 1 median ms", "CPU ms", "cpu/wall", "setup s",
                "loss step 1", f"loss step {a.warmup + a.steps}"):
        tab.add_column(col, justify="left" if col == "configuration" else "right")
    for label, res in runs.items():
        r0 = res[0]
        m, iqr = stats(r0["times"])
        med[label] = m
        r1 = f"{statistics.median(res[1]['times']) * 1e3:.1f}" if len(res) > 1 else "-"
        cw = statistics.median(c / t for c, t in zip(r0["cpu"], r0["times"]))
        medcpu[label] = statistics.median(r0["cpu"])
        tab.add_row(label, f"{m * 1e3:.1f}", f"{iqr * 1e3:.1f}", f"{min(r0['times']) * 1e3:.1f}", r1,
                    f"{medcpu[label] * 1e3:.1f}", f"{cw:.2f}",
                    f"{r0['setup_s']:.2f}", f"{r0['losses'][0]:.5f}", f"{r0['losses'][-1]:.5f}")
    con.print(tab)

    # sanity: both ranks report the same loss; all configurations agree on the first step
    for label, res in runs.items():
        if len(res) > 1 and any(abs(x - y) > 1e-5 for x, y in zip(res[0]["losses"], res[1]["losses"])):
            con.print(f"[red]WARNING[/]: {label}: ranks disagree on the loss")
    ref = runs["single, 1 thread"][0]["losses"]
    for label, res in runs.items():
        d0 = abs(res[0]["losses"][0] - ref[0])
        dN = abs(res[0]["losses"][-1] - ref[-1])
        flag = "" if d0 < 1e-4 else "  [red]<-- first-step loss differs![/]"
        con.print(f"  {label:48s} |loss - single| step 1: {d0:.2e}   last step: {dN:.2e}{flag}")

    A, DR = "autopar tp=2", "DTensor tp=2 (emb/LM head replicated)"
    DV, S1, S2 = "DTensor tp=2 (vocab-parallel + loss_parallel)", "single, 1 thread", "single, 2 threads"
    pairs = [("autopar / DTensor (replicated emb/head)", A, DR),
             ("autopar / DTensor (vocab-parallel + loss_parallel)", A, DV),
             ("autopar / single (1 thread)", A, S1),
             ("DTensor (replicated) / single (1 thread)", DR, S1),
             ("DTensor (vocab-parallel) / single (1 thread)", DV, S1),
             ("autopar / single (2 threads)", A, S2),
             ("DTensor (replicated) / single (2 threads)", DR, S2)]
    rt = Table(title="ratios of medians (<1: the numerator is faster); CPU-time ratios are less sensitive to "
                     "background load")
    for col in ("ratio", "step time", "CPU time"):
        rt.add_column(col, justify="left" if col == "ratio" else "right")
    for name, num, den in pairs:
        if num in med and den in med:
            rt.add_row(name, f"{med[num] / med[den]:.3f}", f"{medcpu[num] / medcpu[den]:.3f}")
    con.print(rt)
    con.print(f"total wall time of the runs: {total_s:.1f}s")

    if a.profile:
        for label, res in runs.items():
            if res[0].get("profile"):
                con.print(f"\n[bold]profile, rank 0, 2 steps: {label}[/]")
                print(res[0]["profile"])


if __name__ == "__main__":
    main()
