"""Benchmark: expert parallelism (ep) against the tensor-parallel split of the experts and one process (CPU, gloo).

The same HF Mixtral (8 experts, top-2; same seed, weights and batches, AdamW) trained

- by autopar at ep=2 (dp=2, world 2) and ep=4 (dp=4, world 4): each rank holds E/ep whole
  experts of every layer and its own 1/dp of the batch; the routed rows travel to the rank
  holding their expert ('allgather' dispatcher, and with ``--alltoall`` also 'alltoall');
- by autopar at tp=2 and tp=4 (ep=1, world 2 and 4): every rank holds every expert, split
  tp ways on its width (and the attention split by heads), and all the batch;
- by PyTorch alone in one process (1 thread).

Each autopar layout is compiled here once and runs in its own ``autopar.spawn`` (ranks forked from
this process, 1 thread each, a barrier before each step); ``--rounds`` repeats all of them, the
order reversed every other round, and pools the timed steps (a burst of other work on a shared
machine then lands on several layouts rather than one). Reported, for rank 0: the median step
time (forward + backward + AdamW step) of the timed steps, its IQR, the parameter bytes the rank
holds (its shards, read from the engine) and those of its routed experts, each beside the
performance model's prediction (``autopar.planning``): the layout priced by ``estimate`` on a
profile of this machine measured here (one core's fp32 GEMM rate and copy bandwidth, the time of
a tiny eager op, and the gloo link of each world: all-reduces timed in its spawns, the best). The
model prices one device per rank: with more ranks than cores, each rank gets cores/ranks of a
core (the profile's rates scaled so). Its messages and memory-bound kernels count 2-byte
elements and the runs are fp32, so the profile's link and memory bandwidths are halved.

Targets (the project's issue): the expert parameters per rank are exactly E/ep experts; the
step at ep=4 is faster than the tensor-parallel split at 4 ranks.

    .venv/bin/python bench/experts.py [--steps 8 --hidden 128 --expert-ffn 512 --seq 64 --batch 16 --alltoall]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F

import autopar
from autopar.planning.cost.hardware import Efficiency, Hardware
from autopar.planning.cost.layout import Cluster, Layout
from autopar.planning.cost.models import ModelSpec, expert_params_per_rank, params_per_stage
from autopar.planning.cost.precision import RUNTIME_FP32
from autopar.planning.cost.step_estimate import estimate

LAYOUTS: dict[str, dict] = {  # name -> parallelize() layout (world = tp * dp)
    "ep=2": dict(dp=2, ep=2),
    "tp=2": dict(tp=2),
    "ep=4": dict(dp=4, ep=4),
    "tp=4": dict(tp=4),
}
ALLTOALL: dict[str, dict] = {"ep=2 a2a": dict(dp=2, ep=2, expert_dispatch="alltoall"),
                             "ep=4 a2a": dict(dp=4, ep=4, expert_dispatch="alltoall")}
ONE = "1 process"
_PROGRAM = None  # the program the next spawn's ranks run (forked with it: inherit=True)


# ---------------------------------------------------------------------------- the model and the data
def make_config(a):
    import transformers

    return transformers.MixtralConfig(
        vocab_size=a.vocab, hidden_size=a.hidden, intermediate_size=a.expert_ffn, num_hidden_layers=a.layers,
        num_attention_heads=a.heads, num_key_value_heads=a.kv_heads, num_local_experts=a.experts,
        num_experts_per_tok=a.top_k, max_position_embeddings=a.seq, bos_token_id=0, eos_token_id=0,
        pad_token_id=None)


def make_model(a):
    import transformers

    torch.manual_seed(0)  # the same weights in every layout
    return transformers.MixtralForCausalLM(make_config(a))


def make_batches(a):
    g = torch.Generator().manual_seed(1)  # the same data in every layout
    return [(torch.randint(0, a.vocab, (a.batch, a.seq), generator=g),
             torch.randint(0, a.vocab, (a.batch, a.seq), generator=g)) for _ in range(a.warmup + a.steps)]


def model_spec(a) -> ModelSpec:
    """The performance model's description of the Mixtral above (the compiler does not read a
    mixture-of-experts model from its graph yet, so it is given here by its dimensions)."""
    return ModelSpec(layers=a.layers, hidden=a.hidden, heads=a.heads, kv_heads=a.kv_heads, seq_len=a.seq,
                     vocab=a.vocab, ffn=a.expert_ffn, gated_mlp=True, dropout=False, fused_attention=True,
                     tied_head=False, learned_positions=False, experts=a.experts, top_k=a.top_k,
                     name="mixtral-bench")


def _is_expert(name: str, shape: torch.Size) -> bool:
    """A routed expert's stacked weight (HF Mixtral's ``mlp.experts.gate_up_proj`` / ``down_proj``)."""
    return ".experts." in name and len(shape) == 3


# ---------------------------------------------------------------------------- timing
def timed(step, batches, warmup: int, distributed: bool) -> dict:
    losses, times = [], []
    for i, (x, y) in enumerate(batches):
        if distributed:
            dist.barrier()
        t0 = time.perf_counter()
        losses.append(step(x, y))
        t1 = time.perf_counter()
        if i >= warmup:
            times.append(t1 - t0)
        if (not distributed or dist.get_rank() == 0) and (i + 1) % 4 == 0:
            print(f"    step {i + 1}/{len(batches)}", flush=True)
    return {"times": times, "losses": losses}


def link_of_world() -> tuple[float, float]:
    """(bytes/s, seconds per step) of this world's gloo all-reduce, from a small and a large one
    (the fastest of 15 each: the least disturbed by other work on the machine):
    t = 2 (n-1)/n B / bw + 2 (n-1) latency (``network.allreduce_time``)."""
    n = dist.get_world_size()
    out = []
    for numel in (16, 1 << 20):
        x = torch.ones(numel)
        for _ in range(3):
            dist.all_reduce(x)
        ts = []
        for _ in range(15):
            dist.barrier()
            t0 = time.perf_counter()
            dist.all_reduce(x)
            ts.append(time.perf_counter() - t0)
        out.append(min(ts))
    small, large = out
    latency = small / (2 * (n - 1))
    bw = 2 * (n - 1) / n * 4 * (1 << 20) / max(large - small, 0.05 * large)
    return bw, latency


def worker(a) -> dict:
    program = _PROGRAM
    engine = program.materialize()
    opt = torch.optim.AdamW(engine.parameters(), lr=a.lr)
    local = dict(engine.named_local_parameters())
    param_bytes = sum(t.numel() * t.element_size() for t in local.values())
    expert_bytes = sum(t.numel() * t.element_size() for n, t in local.items() if _is_expert(n, t.shape))
    link = link_of_world()

    def step(x, y):
        loss = engine.train_step(x, y)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss

    out = timed(step, make_batches(a), a.warmup, True)
    out |= {"param_bytes": param_bytes, "expert_bytes": expert_bytes, "link": link}
    return out


def one_process(a) -> dict:
    old = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        model = make_model(a)
        opt = torch.optim.AdamW(model.parameters(), lr=a.lr)

        def step(x, y):
            logits = model(x).logits
            loss = F.cross_entropy(logits.flatten(0, 1), y.flatten())
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            return float(loss.detach())

        out = timed(step, make_batches(a), a.warmup, False)
        params = dict(model.named_parameters())
        out["param_bytes"] = sum(p.numel() * p.element_size() for p in params.values())
        out["expert_bytes"] = sum(p.numel() * p.element_size() for n, p in params.items()
                                  if _is_expert(n, p.shape))
        return out
    finally:
        torch.set_num_threads(old)


# ---------------------------------------------------------------------------- this machine as a profile
def _median_time(fn, reps: int = 20) -> float:
    fn()
    ts = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts)


def measure_core() -> dict:
    """One core's fp32 GEMM rate (a 256^3 product), copy bandwidth (64 MiB) and the time of a tiny op."""
    old = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        x, w = torch.randn(256, 256), torch.randn(256, 256)
        flops = 2 * 256**3 / _median_time(lambda: torch.mm(x, w))
        src = torch.randn(16 << 20)
        dst = torch.empty_like(src)
        bw = 2 * src.numel() * 4 / _median_time(lambda: dst.copy_(src), reps=10)
        a, b = torch.ones(8), torch.ones(8)
        op = _median_time(lambda: torch.add(a, b), reps=200)
    finally:
        torch.set_num_threads(old)
    return {"flops": flops, "bw": bw, "op": op}


def cpu_profile(core: dict, world: int, link: tuple[float, float] | None) -> Hardware:
    """This machine as the performance model's hardware: one rank per "GPU", all in one "node"
    (the gloo link for every collective), each rank getting cores/world of a core when the ranks
    outnumber the cores; bandwidths halved (the model counts 2-byte elements, the runs are fp32)."""
    share = min(1.0, (os.cpu_count() or 1) / world)
    bw, lat = link if link is not None else (1e12, 0.0)
    return Hardware(name="cpu-gloo", gpu="CPU core (gloo rank)", gpus_per_node=max(world, 1),
                    peak_flops=core["flops"] * share, hbm_bytes=64 * 2**30, hbm_bw=core["bw"] * share / 2,
                    sm_count=1, nvlink_bw=bw / 2, ib_bw=bw / 2, nvlink_latency=lat, ib_latency=lat,
                    nvlink_efficiency=1.0, ib_efficiency=1.0, memory_headroom=1.0,
                    eff=Efficiency(gemm=1.0, hbm=1.0, gemm_k_overhead=0.0, kernel_overhead=core["op"]))


def predict(a, layout: dict | None, core: dict, link) -> dict:
    """The planner's step time and parameter bytes for one layout of the run."""
    spec = model_spec(a)
    t, dp, ep = (layout or {}).get("tp", 1), (layout or {}).get("dp", 1), (layout or {}).get("ep", 1)
    lay = Layout(t=t, p=1, d=dp, b=a.batch // dp, recompute="none", dp_overlap=True, ep=ep,
                 expert_dispatch=(layout or {}).get("expert_dispatch", "allgather"), fused_kernels=False,
                 precision=RUNTIME_FP32)
    world = t * dp
    est = estimate(spec, Cluster(world, cpu_profile(core, world, link), a.batch), lay)
    return {"step_s": est.t_iter, "param_bytes": 4 * params_per_stage(spec, t, 1, ep)[0],
            "expert_bytes": 4 * a.layers * expert_params_per_rank(spec, t, ep), "est": est}


# ---------------------------------------------------------------------------- main
def main() -> int:
    global _PROGRAM
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=8, help="timed steps (after the warm-up)")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--rounds", type=int, default=2, help="runs of every layout, pooled")
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--hidden", type=int, default=128)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--kv-heads", type=int, default=4)
    p.add_argument("--experts", type=int, default=8)
    p.add_argument("--top-k", type=int, default=2)
    p.add_argument("--expert-ffn", type=int, default=512, help="one expert's MLP width")
    p.add_argument("--seq", type=int, default=64)
    p.add_argument("--vocab", type=int, default=256)
    p.add_argument("--batch", type=int, default=16, help="global batch (sequences)")
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--alltoall", action="store_true", help="also run ep=2 and ep=4 with the 'alltoall' dispatcher")
    p.add_argument("--only", nargs="*", default=None, help="run only these layouts (names as in the table)")
    a = p.parse_args()

    from rich.console import Console
    from rich.table import Table

    con = Console(width=max(Console().width, 140))
    layouts = {**LAYOUTS, **(ALLTOALL if a.alltoall else {})}
    if a.only is not None:  # any layout by name, the all-to-all ones included
        unknown = set(a.only) - {ONE, *LAYOUTS, *ALLTOALL}
        if unknown:
            p.error(f"--only: unknown layouts {sorted(unknown)}; known: {[ONE, *LAYOUTS, *ALLTOALL]}")
        layouts = {k: v for k, v in {**LAYOUTS, **ALLTOALL}.items() if k in a.only}
    n_params = sum(q.numel() for q in make_model(a).parameters())
    con.print(f"[bold]model[/]: HF Mixtral hidden={a.hidden} layers={a.layers} heads={a.heads} (kv {a.kv_heads}) "
              f"experts={a.experts} top-{a.top_k} expert width={a.expert_ffn} vocab={a.vocab}, {n_params / 1e6:.2f}M "
              f"parameters; batch {a.batch} x seq {a.seq}; AdamW; warm-up {a.warmup} + {a.steps} timed steps")
    con.print(f"torch {torch.__version__}, {os.cpu_count()} CPUs, load avg at start "
              f"{'/'.join(f'{x:.2f}' for x in os.getloadavg())}; ranks: gloo, 1 thread each")

    t_all = time.perf_counter()
    core = measure_core()
    con.print(f"this machine (one core): fp32 GEMM {core['flops'] / 1e9:.1f} GFLOP/s, "
              f"copy {core['bw'] / 1e9:.1f} GB/s, "
              f"a tiny op {core['op'] * 1e6:.1f} us")
    x0, y0 = make_batches(a)[0]
    programs, compile_s = {}, {}
    for name, layout in layouts.items():
        world = layout.get("tp", 1) * layout.get("dp", 1)
        rows = a.batch // layout.get("dp", 1)
        t0 = time.perf_counter()
        programs[name] = autopar.parallelize(make_model(a), world_size=world, example_inputs=(x0[:rows],),
                                             example_targets=y0[:rows], **layout)
        compile_s[name] = time.perf_counter() - t0
    con.print("compiled: " + ", ".join(f"{k} {v:.1f} s" for k, v in compile_s.items()))
    names = ([ONE] if a.only is None or ONE in a.only else []) + list(layouts)
    runs: dict[str, dict] = {}
    links: dict[int, list[tuple[float, float]]] = {}
    for rnd in range(a.rounds):
        for name in (names if rnd % 2 == 0 else names[::-1]):
            con.print(f"[bold]{name}[/] (round {rnd + 1}/{a.rounds})")
            if name == ONE:
                r = one_process(a) | {"link": None, "world": 1, "layout": None}
            else:
                layout = layouts[name]
                world = layout.get("tp", 1) * layout.get("dp", 1)
                _PROGRAM = programs[name]
                res = autopar.spawn(worker, world, (a,), inherit=True)
                r = res[0] | {"world": world, "layout": layout, "rank_losses": [x["losses"][-1] for x in res]}
                links.setdefault(world, []).append(r["link"])
            if name in runs:
                runs[name]["times"] += r["times"]
            else:
                runs[name] = r
    for r in runs.values():  # each world's link as its least disturbed measurement found it
        if r["world"] > 1:
            r["link"] = (max(x[0] for x in links[r["world"]]), min(x[1] for x in links[r["world"]]))
    total_s = time.perf_counter() - t_all

    tab = Table(title="rank 0 per step (forward + backward + AdamW), measured median and the performance model's "
                      "prediction; parameter KiB the rank holds (all, and its routed experts'), measured / predicted")
    for col in ("layout", "ranks", "median ms", "IQR ms", "predicted ms", "param KiB", "expert KiB", "experts",
                "loss 1st/last"):
        tab.add_column(col, justify="left" if col == "layout" else "right")
    med, pred = {}, {}
    per_expert_bytes = 4 * a.layers * 3 * a.hidden * a.expert_ffn  # one expert of every layer, fp32
    for name, r in runs.items():
        m = statistics.median(r["times"])
        q = statistics.quantiles(r["times"], n=4) if len(r["times"]) > 1 else [m, m, m]
        pr = predict(a, r["layout"], core, r["link"])
        med[name], pred[name] = m, pr["step_s"]
        tab.add_row(name, str(r["world"]), f"{m * 1e3:.1f}", f"{(q[2] - q[0]) * 1e3:.1f}", f"{pr['step_s'] * 1e3:.1f}",
                    f"{r['param_bytes'] / 1024:.0f} / {pr['param_bytes'] / 1024:.0f}",
                    f"{r['expert_bytes'] / 1024:.0f} / {pr['expert_bytes'] / 1024:.0f}",
                    f"{r['expert_bytes'] / per_expert_bytes:g}", f"{r['losses'][0]:.4f}/{r['losses'][-1]:.4f}")
    con.print(tab)
    for world in sorted(links):
        bw, lat = max(x[0] for x in links[world]), min(x[1] for x in links[world])
        con.print(f"  gloo all-reduce over {world} ranks: {bw / 1e9:.2f} GB/s, {lat * 1e6:.0f} us per step "
                  f"(the best of {len(links[world])} spawns)")
    for name, r in runs.items():
        if r.get("rank_losses") and max(r["rank_losses"]) - min(r["rank_losses"]) > 1e-5:
            con.print(f"[red]WARNING[/]: {name}: ranks disagree on the loss {r['rank_losses']}")

    pairs = [("ep=2 / tp=2", "ep=2", "tp=2"), ("ep=4 / tp=4", "ep=4", "tp=4"),
             ("ep=2 a2a / ep=2", "ep=2 a2a", "ep=2"), ("ep=4 a2a / ep=4", "ep=4 a2a", "ep=4"),
             ("ep=4 a2a / tp=4", "ep=4 a2a", "tp=4"),
             ("ep=2 / 1 process", "ep=2", ONE), ("tp=2 / 1 process", "tp=2", ONE),
             ("ep=4 / 1 process", "ep=4", ONE), ("tp=4 / 1 process", "tp=4", ONE),
             ("ep=2 a2a / 1 process", "ep=2 a2a", ONE), ("ep=4 a2a / 1 process", "ep=4 a2a", ONE)]
    rt = Table(title="ratios of median step times (<1: the first is faster), measured and predicted")
    for col in ("ratio", "measured", "predicted"):
        rt.add_column(col, justify="left" if col == "ratio" else "right")
    for label, num, den in pairs:
        if num in med and den in med:
            rt.add_row(label, f"{med[num] / med[den]:.3f}", f"{pred[num] / pred[den]:.3f}")
    con.print(rt)
    checks = []
    for name, r in runs.items():
        ep = (r["layout"] or {}).get("ep", 1)
        if ep > 1:
            want = a.experts // ep * per_expert_bytes
            checks.append(f"{name}: expert bytes {r['expert_bytes']} == E/ep = {a.experts // ep} experts' "
                          f"{want}: {r['expert_bytes'] == want}")
    if "ep=4" in med and "tp=4" in med:
        checks.append(f"step time at ep=4 below tp=4's: {med['ep=4'] < med['tp=4']} "
                      f"({med['ep=4'] * 1e3:.1f} vs {med['tp=4'] * 1e3:.1f} ms)")
    for line in checks:
        con.print("  " + line)
    con.print(f"total wall time: {total_s:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
