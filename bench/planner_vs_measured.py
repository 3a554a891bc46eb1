"""The planner against every runnable layout of 2 CPU ranks: predicted and measured step time and
peak memory side by side.

For the reference GPT (``autopar.reference.models.build("gpt")``) and a small HF Llama:

1. a hardware profile of this machine: ``autopar tune --nproc 2 --quick`` over the model's GEMMs at
   the smallest micro-batch, fp32 (or ``--profile PATH``, used for both models);
2. every layout of 2 ranks the cost model and the compiler accept (``enumerate_layouts``): t, p in
   {1, 2}, d = 2 / (t p); with p = 2 the schedules 1F1B, ZB-H1 (v = 1), interleaved and ZB-V (v = 2);
   two micro-batch sizes; recomputation none or layer; sequence parallelism on and off at t = 2; the
   distributed optimizer on and off at d = 2;
3. per layout, predicted: ``step_estimate.estimate(spec, Cluster(2, profile, B), layout,
   simulate=True)`` with the spec read from the model's graph (``spec_from_model``), fp32 byte
   sizes (``RUNTIME_FP32``) and eager kernels (``fused_kernels=False``), as the runtime runs;
   measured: each layout compiled here once, its 2 ranks forked (``autopar.spawn(..., inherit=True)``,
   1 thread each), AdamW, a barrier before each step, ``--warmup`` (2) + ``--steps`` (5) timed steps of
   ``train_step`` + the optimizer step (+ the distributed optimizer's parameter gathers);
   ``--rounds`` repeats every layout, the order reversed every other round, and pools the steps;
4. the table, the median and largest absolute error, Spearman's rank correlation of predicted
   against measured step time, and where the planner's first choice (the least predicted step
   time among these layouts) stands among the measured.

What memory is compared. Measured, per rank, the largest over ranks: parameter bytes + gradient
bytes (after ``train_step``) + the optimizer's state (AdamW's moments and step counts, and the
distributed optimizer's fp32 master and gradient shards, ``buffer_bytes()``) + the engine's
``peak_activation_bytes`` (what autograd saved for the pending backwards at its peak, max over the
timed steps). Predicted, on the fullest stage: ``Memory.weights + grads + optimizer + kept``: the
same four parts. Not compared: the working set of a layer's backward or the loss, DDP-style
gradient buckets, allocator slack (the engine counts none of them). The engine counts each kept
storage once (a view saved beside its base, a checkpointed region's inputs) and the chunks' outputs,
after each forward and, in ZB-H1 and ZB-V, after each B (docs/performance-model.md, section 4a).

    PYTHONPATH=$PWD .venv/bin/python bench/planner_vs_measured.py                 # both models, 3 rounds
    PYTHONPATH=$PWD .venv/bin/python bench/planner_vs_measured.py --models gpt --rounds 1 --steps 3
    PYTHONPATH=$PWD .venv/bin/python bench/planner_vs_measured.py --profile hw.json --limit 4
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist

import autopar
from autopar.compiler.model_spec import spec_from_model
from autopar.core.errors import AutoparError
from autopar.planning.cost.hardware import Hardware
from autopar.planning.cost.hardware_profile import load_hardware
from autopar.planning.cost.layout import Cluster, Layout, layout_errors
from autopar.planning.cost.models import ModelSpec
from autopar.planning.cost.precision import RUNTIME_FP32
from autopar.planning.cost.step_estimate import Estimate, estimate
from autopar.planning.errors import PlanError

WORLD = 2
MiB = 2**20
_HERE = Path(__file__).resolve().parent
_PROGRAM = None  # the program the next spawn's ranks run (forked with it: inherit=True)

PIPELINE_SCHEDULES: tuple[tuple[str, int], ...] = (("1f1b", 1), ("zb-h1", 1), ("interleaved", 2), ("zbv", 2))
"""(schedule, v) run with p = 2."""


# ---------------------------------------------------------------------------- the layouts
def enumerate_layouts(spec: ModelSpec, hardware: Hardware, global_batch: int, micro_batches: tuple[int, ...] = (1, 2),
                      world: int = WORLD) -> list[Layout]:
    """Every layout of ``world`` ranks the cost model accepts for ``spec`` (``layout_errors``, the
    schedule's rules included): t, p dividing the world, d = world / (t p); the pipeline schedules of
    ``PIPELINE_SCHEDULES`` when p > 1; each micro-batch size; recomputation none and layer; sequence
    parallelism off and on when t > 1; the distributed optimizer off and on when d > 1. fp32 and
    eager kernels, the gradient reduction overlapping the backward, as autopar's runtime runs."""
    cluster = Cluster(world, hardware, global_batch)
    out = []
    for t in (k for k in range(1, world + 1) if world % k == 0):
        for p in (k for k in range(1, world // t + 1) if (world // t) % k == 0):
            d = world // (t * p)
            for schedule, v in (PIPELINE_SCHEDULES if p > 1 else (("1f1b", 1),)):
                for b in micro_batches:
                    for recompute in ("none", "layer"):
                        for sp in ((False, True) if t > 1 else (False,)):
                            for distopt in ((False, True) if d > 1 else (False,)):
                                lay = Layout(t=t, p=p, d=d, b=b, v=v, schedule=schedule, recompute=recompute,
                                             dp_overlap=True, sequence_parallel=sp, distributed_optimizer=distopt,
                                             fused_kernels=False, precision=RUNTIME_FP32)
                                if not layout_errors(spec, cluster, lay):
                                    out.append(lay)
    return out


def parallelize_kwargs(lay: Layout, global_batch: int) -> dict:
    """``autopar.parallelize``'s layout arguments for ``lay`` (the distributed optimizer is the
    engine's, chosen when the ranks build their optimizer)."""
    return dict(tp=lay.t, pp=lay.p, dp=lay.d, world_size=lay.world, virtual_stages=lay.v,
                microbatches=global_batch // (lay.d * lay.b), schedule=lay.schedule, recompute=str(lay.recompute),
                sequence_parallel=lay.sp)


# ---------------------------------------------------------------------------- the figures
def ranks(xs: list[float]) -> list[float]:
    """1-based ranks of ``xs``, ties sharing the mean of their ranks."""
    order = sorted(range(len(xs)), key=lambda i: xs[i])
    out = [0.0] * len(xs)
    i = 0
    while i < len(order):
        j = i
        while j + 1 < len(order) and xs[order[j + 1]] == xs[order[i]]:
            j += 1
        for k in range(i, j + 1):
            out[order[k]] = (i + j) / 2 + 1
        i = j + 1
    return out


def spearman(xs: list[float], ys: list[float]) -> float:
    """Spearman's rank correlation: Pearson's correlation of the ranks (ties averaged)."""
    if len(xs) != len(ys) or len(xs) < 2:
        raise PlanError(f"spearman needs two lists of the same length, at least 2 values each; got {len(xs)} "
                        f"and {len(ys)} values")
    rx, ry = ranks(xs), ranks(ys)
    mx, my = statistics.fmean(rx), statistics.fmean(ry)
    cov = sum((a - mx) * (b - my) for a, b in zip(rx, ry))
    vx, vy = sum((a - mx) ** 2 for a in rx), sum((b - my) ** 2 for b in ry)
    return cov / (vx * vy) ** 0.5 if vx and vy else float("nan")


def error(predicted: float, measured: float) -> float:
    """Signed relative error of a prediction, (predicted - measured) / measured."""
    return (predicted - measured) / measured


@dataclass
class Row:
    """One layout: predicted and measured step seconds and peak bytes per rank."""

    name: str
    pred_s: float
    meas_s: float
    """Rank 0's median step over the timed steps of every round."""
    pred_bytes: float
    meas_bytes: float
    min_s: float = 0.0
    """Rank 0's fastest step: the least disturbed by other work on a shared machine."""
    parts: dict = field(default_factory=dict)
    """Predicted and measured parts (seconds, bytes) for the breakdown of errors."""

    @property
    def time_err(self) -> float:
        return error(self.pred_s, self.meas_s)

    @property
    def mem_err(self) -> float:
        return error(self.pred_bytes, self.meas_bytes)


def format_table(rows: list[Row]) -> str:
    """The side-by-side table, one line per layout, fastest measured first."""
    head = (f"{'layout':<34} {'pred ms':>8} {'meas ms':>8} {'err':>7} {'min ms':>8} {'err':>7} {'pred MiB':>9} "
            f"{'meas MiB':>9} {'err':>7}")
    lines = [head, "-" * len(head)]
    for r in sorted(rows, key=lambda r: r.meas_s):
        lines.append(f"{r.name:<34} {r.pred_s * 1e3:8.1f} {r.meas_s * 1e3:8.1f} {r.time_err:+7.1%} "
                     f"{r.min_s * 1e3:8.1f} {error(r.pred_s, r.min_s) if r.min_s else 0.0:+7.1%} "
                     f"{r.pred_bytes / MiB:9.2f} {r.meas_bytes / MiB:9.2f} {r.mem_err:+7.1%}")
    return "\n".join(lines)


def figures(rows: list[Row]) -> dict:
    """Median and largest absolute errors, Spearman's rank correlation of step times, and the
    planner's pick (least predicted) among the measured: its rank (1 = fastest) and its gap."""
    t_err = [abs(r.time_err) for r in rows]
    m_err = [abs(r.mem_err) for r in rows]
    pick = min(rows, key=lambda r: r.pred_s)
    fastest = min(rows, key=lambda r: r.meas_s)
    by_meas = sorted(rows, key=lambda r: r.meas_s)
    return _fastest_step_figures(rows, pick) | {"layouts": len(rows), "time_median_abs_err": statistics.median(t_err), "time_max_abs_err": max(t_err),
            "time_over_25": sum(e > 0.25 for e in t_err),
            "spearman": spearman([r.pred_s for r in rows], [r.meas_s for r in rows]),
            "pick": pick.name, "pick_rank": by_meas.index(pick) + 1, "fastest": fastest.name,
            "pick_gap": pick.meas_s / fastest.meas_s - 1,
            "mem_median_abs_err": statistics.median(m_err), "mem_max_abs_err": max(m_err),
            "mem_over_10": sum(e > 0.10 for e in m_err)}


def _fastest_step_figures(rows: list[Row], pick: Row) -> dict:
    """The figures against each layout's fastest step instead of its median ({} when not measured)."""
    if not all(r.min_s for r in rows):
        return {}
    by_min = sorted(rows, key=lambda r: r.min_s)
    err = [abs(error(r.pred_s, r.min_s)) for r in rows]
    return {"min_median_abs_err": statistics.median(err), "min_max_abs_err": max(err),
            "min_spearman": spearman([r.pred_s for r in rows], [r.min_s for r in rows]),
            "min_pick_rank": by_min.index(pick) + 1, "min_pick_gap": pick.min_s / by_min[0].min_s - 1,
            "min_fastest": by_min[0].name}


def format_figures(f: dict) -> str:
    """``figures`` in words, one line each."""
    return "\n".join([
        f"layouts: {f['layouts']}",
        f"step time: median |error| {f['time_median_abs_err']:.1%}, max {f['time_max_abs_err']:.1%}, "
        f"{f['time_over_25']} over 25%",
        f"Spearman rank correlation (predicted vs measured step time): {f['spearman']:.3f}",
        f"planner's first choice (least predicted): {f['pick']}, measured rank {f['pick_rank']} of "
        f"{f['layouts']}, {f['pick_gap']:+.1%} vs the fastest measured ({f['fastest']})",
        f"peak memory per rank: median |error| {f['mem_median_abs_err']:.1%}, max {f['mem_max_abs_err']:.1%}, "
        f"{f['mem_over_10']} over 10%",
    ] + ([f"against each layout's fastest step: median |error| {f['min_median_abs_err']:.1%}, max "
          f"{f['min_max_abs_err']:.1%}, Spearman {f['min_spearman']:.3f}, the planner's pick ranked "
          f"{f['min_pick_rank']}, {f['min_pick_gap']:+.1%} vs the fastest ({f['min_fastest']})"]
         if "min_spearman" in f else []))


# ---------------------------------------------------------------------------- the models
@dataclass(frozen=True)
class Model:
    """A model of the bench: how to build it, and the flags ``autopar tune`` reads its GEMMs from."""

    name: str
    build: Callable[[], torch.nn.Module]
    """A fresh model, the same weights every call (seeded)."""
    tune_flags: tuple[str, ...]


def gpt_model(a) -> Model:
    """The reference GPT of ``--layers --hidden --heads --seq --vocab``."""
    from autopar.reference.models import build

    def make():
        torch.manual_seed(0)
        return build("gpt", vocab_size=a.vocab, seq_len=a.seq, n_layer=a.layers, n_head=a.heads, d_model=a.hidden)
    flags = ("--layers", str(a.layers), "--hidden", str(a.hidden), "--heads", str(a.heads), "--seq-len", str(a.seq),
             "--vocab", str(a.vocab))
    return Model("gpt", make, flags)


def llama_model(a, folder: str) -> Model:
    """An HF Llama of the same size (half the heads as kv heads), its config saved in ``folder`` for
    ``autopar tune --hf-config``."""
    import transformers

    config = transformers.LlamaConfig(vocab_size=a.vocab, hidden_size=a.hidden, intermediate_size=a.llama_ffn,
                                      num_hidden_layers=a.layers, num_attention_heads=a.heads,
                                      num_key_value_heads=a.heads // 2, max_position_embeddings=a.seq,
                                      bos_token_id=0, eos_token_id=0, pad_token_id=None)
    config.save_pretrained(folder)

    def make():
        torch.manual_seed(0)
        return transformers.LlamaForCausalLM(config)
    return Model("hf-llama", make, ("--hf-config", folder, "--seq-len", str(a.seq)))


def batch(a) -> tuple[torch.Tensor, torch.Tensor]:
    """The global batch (inputs, targets) every layout trains on."""
    g = torch.Generator().manual_seed(1)  # the same data in every layout
    return (torch.randint(0, a.vocab, (a.batch, a.seq), generator=g),
            torch.randint(0, a.vocab, (a.batch, a.seq), generator=g))


def tune(model: Model, a, out: str) -> str:
    """``autopar tune --nproc 2 --quick`` over ``model``'s GEMMs at the smallest micro-batch, fp32."""
    cmd = [sys.executable, "-m", "autopar.cli", "tune", "--nproc", str(WORLD), "--quick", *model.tune_flags,
           "--micro-batch", str(min(a.micro_batches)), "--dtypes", "fp32", "--out", out]
    print("$ autopar " + " ".join(cmd[3:]), flush=True)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(_HERE.parent), os.environ.get("PYTHONPATH")])))
    subprocess.run(cmd, check=True, env=env)
    return out


# ---------------------------------------------------------------------------- measuring
def _bytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors if isinstance(t, torch.Tensor))


def worker(x, y, steps: int, warmup: int, distopt: bool) -> dict:
    """One rank: materialize the forked program, time ``warmup + steps`` steps, count its bytes."""
    engine = _PROGRAM.materialize()
    params = list(engine.parameters())
    opt = (engine.distributed_optimizer(torch.optim.AdamW, lr=1e-4) if distopt
           else torch.optim.AdamW(params, lr=1e-4))
    times, act, grads = [], 0, 0
    for i in range(warmup + steps):
        dist.barrier()
        t0 = time.perf_counter()
        engine.train_step(x, y)
        t1 = time.perf_counter()
        grads = max(grads, _bytes(p.grad for p in params))
        opt.step()
        opt.zero_grad(set_to_none=True)
        if distopt:
            engine.wait_parameters()
        t2 = time.perf_counter()
        if i >= warmup:
            times.append((t2 - t0, t1 - t0))
            act = max(act, engine.stats["peak_activation_bytes"])
    state = _bytes(t for s in opt.state.values() for t in s.values())
    buffers = opt.buffer_bytes() if distopt else 0
    return {"times": times, "params": _bytes(params), "grads": grads, "state": state + buffers, "act": act}


def predict(spec: ModelSpec, hw: Hardware, lay: Layout, global_batch: int) -> Estimate:
    """The planner's estimate of ``lay`` on 2 ranks of ``hw``, the schedule simulated."""
    return estimate(spec, Cluster(WORLD, hw, global_batch), lay, simulate=True)


def predicted_bytes(est: Estimate) -> float:
    """What the engine's figures are compared with: model state + the bytes kept for the backward."""
    m = est.memory
    return m.weights + m.grads + m.optimizer + m.kept


def measured_bytes(per_rank: list[dict]) -> float:
    """The largest over the ranks of parameters + gradients + optimizer state + kept activations."""
    return max(r["params"] + r["grads"] + r["state"] + r["act"] for r in per_rank)


def run_model(model: Model, a, hw: Hardware, log) -> list[Row]:
    """Compile, predict and measure every layout of ``model``; the rows of the table."""
    global _PROGRAM
    x, y = batch(a)
    spec = spec_from_model(model.build(), (x[:1],), y[:1], name=model.name)
    layouts = enumerate_layouts(spec, hw, a.batch, tuple(a.micro_batches))[: a.limit or None]
    log(f"{model.name}: {spec.layers} layers x {spec.hidden}, {spec.heads} heads, seq {spec.seq_len}, vocab "
        f"{spec.vocab}; {len(layouts)} layouts; compiling ...")
    programs, preds = {}, {}
    for lay in layouts:
        kw = parallelize_kwargs(lay, a.batch)
        try:
            programs[lay] = autopar.parallelize(model.build(), example_inputs=(x[:lay.b],), example_targets=y[:lay.b],
                                                **kw)
        except AutoparError as e:
            log(f"  skipped {lay.short}: the compiler refuses it: {str(e).splitlines()[0]}")
            continue
        preds[lay] = predict(spec, hw, lay, a.batch)
    runs: dict[Layout, list[dict]] = {}
    order = list(programs)
    t_start = time.perf_counter()
    for rnd in range(a.rounds):
        for i, lay in enumerate(order if rnd % 2 == 0 else order[::-1]):
            _PROGRAM = programs[lay]
            res = autopar.spawn(worker, WORLD, (x, y, a.steps, a.warmup, lay.distopt), inherit=True)
            prev = runs.setdefault(lay, [dict(r, times=[]) for r in res])
            for acc, r in zip(prev, res):
                acc["times"] += r["times"]
                acc["act"] = max(acc["act"], r["act"])
            med = statistics.median(t for t, _ in res[0]["times"])
            log(f"  [{model.name} round {rnd + 1}/{a.rounds} {i + 1}/{len(order)}] {lay.short:<32} "
                f"{med * 1e3:7.1f} ms (predicted {preds[lay].t_iter * 1e3:.1f})  "
                f"[{time.perf_counter() - t_start:.0f} s]")
    rows = []
    for lay, per_rank in runs.items():
        est = preds[lay]
        r0 = per_rank[0]
        m = est.memory
        worst = max(per_rank, key=lambda r: r["params"] + r["grads"] + r["state"] + r["act"])
        rows.append(Row(lay.short, est.t_iter, statistics.median(t for t, _ in r0["times"]),
                        predicted_bytes(est), measured_bytes(per_rank), min(t for t, _ in r0["times"]), parts={
                            "pred": {"pipeline": est.t_pipeline, "dp_exposed": est.t_dp_exposed,
                                     "emb_sync": est.t_emb_sync, "optimizer": est.t_optimizer,
                                     "chunk_f": est.t_chunk_f, "chunk_b": est.t_chunk_b, "p2p": est.t_p2p,
                                     "bubble": est.bubble, **{f"bd_{k}": v for k, v in est.breakdown.items()}},
                            "meas": {"train_step": statistics.median(s for _, s in r0["times"]),
                                     "optimizer": statistics.median(t - s for t, s in r0["times"]),
                                     "all_steps": r0["times"]},
                            "pred_mem": {"weights": m.weights, "grads": m.grads, "optimizer": m.optimizer,
                                         "kept": m.kept, "stage": m.stage},
                            "meas_mem": {k: worst[k] for k in ("params", "grads", "state", "act")}}))
    return rows


# ---------------------------------------------------------------------------- main
def _args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", nargs="+", default=["gpt", "hf-llama"], choices=["gpt", "hf-llama"])
    ap.add_argument("--profile", default=None, help="a profile `autopar tune` wrote (default: tune here)")
    ap.add_argument("--steps", type=int, default=5, help="timed steps per layout and round")
    ap.add_argument("--warmup", type=int, default=2, help="untimed steps per layout and round")
    ap.add_argument("--rounds", type=int, default=3, help="runs of every layout, pooled (order reversed each round)")
    ap.add_argument("--limit", type=int, default=0, help="only the first N layouts of each model (0: all)")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--hidden", type=int, default=128)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--vocab", type=int, default=512)
    ap.add_argument("--llama-ffn", type=int, default=352, help="the HF Llama's MLP width")
    ap.add_argument("--batch", type=int, default=8, help="global batch (sequences)")
    ap.add_argument("--micro-batches", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--out", default="runs/planner_vs_measured", help="folder for the profiles and the JSON results")
    return ap.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    a = _args(argv)
    os.makedirs(a.out, exist_ok=True)

    def log(text: str) -> None:
        print(text, flush=True)

    log(f"torch {torch.__version__}, {os.cpu_count()} CPUs, load average at start "
        f"{'/'.join(f'{v:.2f}' for v in os.getloadavg())}; {WORLD} gloo ranks, 1 thread each; global batch "
        f"{a.batch} x seq {a.seq}; AdamW; {a.warmup} warm-up + {a.steps} timed steps x {a.rounds} rounds")
    results = {}
    with tempfile.TemporaryDirectory() as folder:
        for name in a.models:
            model = gpt_model(a) if name == "gpt" else llama_model(a, folder)
            profile = a.profile or tune(model, a, os.path.join(a.out, f"{name}-hardware.json"))
            hw = load_hardware(profile, dtype="fp32")
            rows = run_model(model, a, hw, log)
            f = figures(rows)
            log(f"\n{name} (profile {profile}), rank 0's median step; peak bytes per rank (model state + kept "
                f"activations), the largest over the ranks\n" + format_table(rows) + "\n" + format_figures(f) + "\n")
            results[name] = {"figures": f, "rows": [vars(r) for r in rows], "profile": profile}
    log(f"load average at the end {'/'.join(f'{v:.2f}' for v in os.getloadavg())}")
    with open(os.path.join(a.out, "results.json"), "w") as fh:
        json.dump(results, fh, indent=1, default=str)
    return 0


if __name__ == "__main__":
    sys.exit(main())
