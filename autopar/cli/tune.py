"""``autopar tune``: measure the machines in hand and write a hardware profile the planner prices with.

    autopar tune --model gpt-1.7b --nproc 2                 # two local ranks, as `autopar run` starts them
    torchrun --nnodes 2 --nproc-per-node 8 -m autopar.cli tune --model gpt-1.7b   # across nodes
    autopar tune --layers 2 --hidden 64 --heads 4 --seq-len 64 --vocab 256 --quick   # one process: compute only

Every rank times, at once (as they will train): the GEMMs the model runs (``tune_plan.model_gemm_shapes``,
at the micro-batch and each tensor-parallel degree, per dtype), a large copy, a tiny eager op and, with
``--compiled``, a compiled call; then the ranks time every collective over each group size that divides
the world, inside a node and across nodes (``tune_plan.tune_groups``), over a few sizes, and a
point-to-point message between two ranks. Rank 0 fits each collective's alpha and beta
(``hardware_profile.fit_alpha_beta``), writes the profile (``--out``) and prints what it measured beside
the nearest preset. ``autopar plan --hardware PROFILE.json`` and ``autopar simulate`` price with it.
"""

from __future__ import annotations

import argparse
import datetime
import os
import shlex
import time

from rich.console import Console
from rich.table import Table

from autopar.cli.model_args import model_spec
from autopar.core.collectives import ALL_GATHER, ALL_REDUCE, wire_factor
from autopar.planning.cost.hardware import (PIPELINE_LAYERS, PIPELINE_MICROBATCHES, PROFILES, Hardware,
                                            MeasuredDataParallel, MeasuredLayer, MeasuredPipeline)
from autopar.planning.cost.hardware_profile import (
    DTYPE_BYTES,
    GemmFigure,
    HardwareProfile,
    LinkFigure,
    fit_alpha_beta,
    nearest_preset,
    to_hardware,
    write_profile,
)
from autopar.planning.cost.network import inter_node_bw, intra_node_bw
from autopar.planning.cost.tune_plan import divisors, model_gemm_shapes, tune_groups
from autopar.planning.quantities import seconds

__all__ = ["run_tune", "tune_flags"]

_SQUARES = (256, 1024, 2048)
"""Square GEMM sides timed when no model is given."""

_GROUP_OPS = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "tp_all_reduce")
COLLECTIVE_ROUNDS = 7
"""Rounds of back-to-back calls per size whose median is kept: a shared machine's slow moments fall out."""


def tune_flags(argv: list[str]) -> str:
    """The flags after ``tune`` in ``argv``, less ``--nproc``: what measures alike on other ranks."""
    out, skip = [], False
    for a in argv[argv.index("tune") + 1:] if "tune" in argv else argv:
        if skip:
            skip = False
        elif a == "--nproc":
            skip = True
        elif not a.startswith("--nproc="):
            out.append(a)
    return shlex.join(out)


def model_flags(argv: list[str]) -> str:
    """The model's flags among the tune's (``--hf-config``, ``--layers``, ``--seq-len``, ...): what ``autopar
    plan`` needs to price the model this profile measured."""
    from autopar.cli.arguments import add_model_flags  # noqa: PLC0415

    model = argparse.ArgumentParser(add_help=False)
    add_model_flags(model)
    actions = model._option_string_actions
    args = argv[argv.index("tune") + 1:] if "tune" in argv else argv
    out, i = [], 0
    while i < len(args):
        name = args[i].split("=", 1)[0]
        action = actions.get(name)
        if action is None:
            i += 1
            continue
        takes = 0 if "=" in args[i] or action.nargs == 0 else 1
        out += args[i:i + 1 + takes]
        i += 1 + takes
    return shlex.join(out)


def _say(rank: int, console: Console, text: str) -> None:
    if rank == 0:
        console.print(f"autopar tune: {text}", highlight=False)


def _gemm_shapes(args: argparse.Namespace, per_node: int) -> list[tuple[str, tuple[int, int, int, int]]]:
    spec = model_spec(args)
    if spec is None:
        return [(f"square {s}", (1, s, s, s)) for s in _SQUARES]
    tps = args.tp or tuple(divisors(per_node))
    return model_gemm_shapes(spec, args.micro_batch, tps)


def _sizes(device_kind: str, quick: bool) -> list[int]:
    """Bytes each collective is timed at: 4 KiB .. 16 MiB on a CPU, 64 KiB .. 256 MiB on a GPU."""
    lo, hi = (12, 24) if device_kind == "cpu" else (16, 28)
    step = 4 if quick else 2
    return [1 << e for e in range(lo, hi + 1, step)]


def run_tune(args: argparse.Namespace, console: Console, argv: list[str]) -> int:
    """``autopar tune``: 0 when the profile was written."""
    from autopar.runtime.launch import init_from_env, launched_world, run_script  # noqa: PLC0415  (loads torch)

    if args.nproc is not None and launched_world() is None:
        return run_script(args.nproc, "autopar.cli", ["tune", *shlex.split(tune_flags(argv))], module=True)
    import torch  # noqa: PLC0415
    import torch.distributed as dist  # noqa: PLC0415

    from autopar.runtime.tuning import compute  # noqa: PLC0415

    rank, world = init_from_env() if launched_world() is not None else (0, 1)
    per_node = int(os.environ.get("LOCAL_WORLD_SIZE", world))
    on_gpu = dist.get_backend() == "nccl" if world > 1 else torch.cuda.is_available()
    device = torch.device("cuda", torch.cuda.current_device()) if on_gpu else torch.device("cpu")
    facts = compute.device_facts(device, per_node if device.type == "cpu" else 1)
    budget = 0.03 if args.quick else 0.2
    start = time.perf_counter()
    _say(rank, console, f"{world} rank(s), {per_node} per node, on {facts['name']}"
                        f"{' (' + dist.get_backend() + ')' if world > 1 else ''}")

    wanted = (args.dtypes or "fp32,bf16").split(",")
    unknown = [d for d in wanted if d not in DTYPE_BYTES]
    if unknown:
        raise SystemExit(f"autopar tune: --dtypes {','.join(unknown)}: known {', '.join(DTYPE_BYTES)}")
    dtypes = [d for d in wanted if compute.dtype_works(d, device)]
    if len(dtypes) < len(wanted):
        _say(rank, console, f"skipped {', '.join(d for d in wanted if d not in dtypes)}: {device} does not run it")
    if not dtypes:
        raise SystemExit(f"autopar tune: none of --dtypes {','.join(wanted)} runs on {device}; try fp32")
    shapes = _gemm_shapes(args, per_node)
    gemm: list[GemmFigure] = []
    for dtype in dtypes:
        for i, (name, shape) in enumerate(shapes):
            sec = compute.time_gemm(shape, dtype, device, budget)
            b, m, n, k = shape
            gemm.append(GemmFigure(dtype, name, b, m, n, k, 2 * b * m * n * k / sec, sec))
        rates = sorted(g.flops_per_s for g in gemm if g.dtype == dtype)
        _say(rank, console, f"GEMM {dtype}: {len(shapes)} shapes, {rates[0] / 1e9:.3g} .. {rates[-1] / 1e9:.4g} GFLOP/s")
    copy_bytes = (1 << 30) if device.type == "cuda" else (64 << 20)  # well beyond the caches
    memory_bw = compute.copy_bandwidth(copy_bytes, device, budget)
    eager = compute.eager_op_seconds(device)
    compiled = compute.compiled_call_seconds(device) if args.compiled else None
    _say(rank, console, f"copy {memory_bw / 1e9:.3g} GB/s, eager op {eager * 1e6:.3g} us"
                        + (f", compiled call {compiled * 1e6:.3g} us" if compiled is not None else ""))

    runtime, layers, data_parallel, pipeline = None, (), (), ()
    if device.type == "cpu":  # the engine's own overheads and the model's layer, on the engine itself
        runtime, layers, data_parallel, pipeline = _measure_runtime(args, argv, rank, world, console)
    if world > 1:
        dist.barrier()
    links = _time_collectives(rank, world, per_node, device, args.quick, console) if world > 1 else []
    if world == 1:
        _say(rank, console, "one process: collectives need ranks; run `autopar tune --nproc N "
                            f"{tune_flags(argv)}` or start it under torchrun to time them")
    if rank != 0:
        return 0
    backend = dist.get_backend() if world > 1 else "none"
    profile = HardwareProfile(
        device_kind=facts["kind"], device_name=facts["name"], devices_per_node=per_node, nodes=world // per_node,
        memory_bytes=facts["memory_bytes"], sm_count=facts["sm_count"], gemm=tuple(gemm), memory_bw=memory_bw,
        eager_op_s=eager, compiled_call_s=compiled, runtime=runtime, layers=layers,
        data_parallel=data_parallel, pipeline=pipeline, collectives=tuple(links),
        sources=_sources(device, copy_bytes, budget, backend, world), tune_flags=tune_flags(argv),
        created=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"), torch=torch.__version__)
    write_profile(profile, args.out)
    console.print(_table(profile, to_hardware(profile, name=args.out)), crop=False)
    model = model_flags(argv)
    _say(rank, console, f"wrote {args.out} in {time.perf_counter() - start:.1f} s; price with it: "
                        f"`autopar plan --hardware {shlex.quote(args.out)} {model + ' ' if model else ''}--gpus N "
                        f"--batch B`")
    return 0


def _measure_runtime(args: argparse.Namespace, argv: list[str], rank: int, world: int,
                     console: Console) -> tuple[dict, tuple[MeasuredLayer, ...], tuple[MeasuredDataParallel, ...],
                                                tuple[MeasuredPipeline, ...]]:
    """The runtime's section and the model's layers (``cli/tune_runtime.py``, ``cli/tune_layers.py``): what
    one rank measures, every rank at once, each in a child process of its own; then, the others waiting
    at a barrier, what takes 2 ranks or t, forked from rank 0's child (the machine otherwise idle)."""
    import torch.distributed as dist  # noqa: PLC0415

    from autopar.cli.tune_runtime import ONE_RANK_BASIS, measure_in_subprocess  # noqa: PLC0415

    # steps per engine in the runtime's measurements (the 2-rank ones take FORKED_REPEATS x as many): each
    # figure is a difference of medians of steps a few hundred microseconds apart; at 10 they moved by half
    # from one tune to the next, at 90 two tunes agreed within ~10%
    repeats = 30 if args.quick else 90
    wanted = dict(flags=tune_flags(argv), micro_batch=args.micro_batch, world=world, quick=args.quick)
    runtime = measure_in_subprocess(repeats, layers=wanted)
    found = runtime.pop("model", {"layers": [], "data_parallel": [], "pipeline": []})
    if world > 1:
        runtime, found["layers"] = _median_over_ranks(runtime, found["layers"], world)
        if rank == 0:
            forked = measure_in_subprocess(repeats, forked=runtime, layers=wanted)
            more = forked.pop("model", {"layers": [], "data_parallel": [], "pipeline": []})
            found = {k: found[k] + more[k] if k != "skipped" else found[k] for k in found}
            runtime |= forked
        dist.barrier()
    for key in ONE_RANK_BASIS:
        runtime.pop(key)
    skipped = found.pop("skipped", None)
    layers = tuple(MeasuredLayer(**x) for x in found["layers"])
    data_parallel = tuple(MeasuredDataParallel(**x) for x in found["data_parallel"])
    pipeline = tuple(MeasuredPipeline(**x) for x in found["pipeline"])
    r = {k: seconds(v) for k, v in runtime.items() if k.endswith("_s")}
    _say(rank, console, f"runtime: step {r['step_s']}, action {r['action_s']}, graph node {r['node_s']}, checkpointed "
                        f"region {r['checkpoint_s']}, pipeline send {r['send_s']}, split backward {r['split_node_s']} "
                        f"per node, tensor-parallel collective in a step {r['tp_collective_s']}, multi-rank step "
                        f"{r['world_step_s']}, distributed optimizer {r['distopt_step_s']}, AdamW "
                        f"{runtime['optimizer_per_param_s'] * 1e9:.3g} ns per parameter")
    _say(rank, console, "the model's layer, forward and backward (at t = 1, recomputed: +, split: +; at t > 1 the "
                        "steps it is fitted to): " + (", ".join(
        f"b={x.micro_batch} t={x.tp}{' sp' if x.sequence_parallel else ''} {x.seconds * 1e3:.3g} ms"
        + (f" (+{x.recompute_seconds * 1e3:.2g}, +{x.split_seconds * 1e3:.2g})" if x.tp == 1 else "")
        + (f" (steps at {'/'.join(str(n) for n, _ in x.steps)} layers: "
           f"{'/'.join(f'{t * 1e3:.4g}' for _, t in x.steps)} ms)" if x.steps else "")
        for x in layers) if layers else f"not measured ({skipped}): its layer is priced from its kernels" if skipped
        else "not measured (give --hf-config, or the dimensions of a GPT or Llama without experts)"))
    for x in data_parallel:
        _say(rank, console, f"the model's data-parallel side ({x.params / 1e6:.3g}M parameters, 2 replicas): gradient "
                            f"reduction {x.sync_seconds * 1e3:.3g} ms, AdamW {x.optimizer_seconds * 1e3:.3g} ms, "
                            f"the distributed optimizer in their place {x.distopt_seconds * 1e3:.3g} ms")
    for x in pipeline:
        _say(rank, console, f"the model's pipeline ({PIPELINE_LAYERS} layers over 2 stages, b={x.micro_batch}): "
                            f"a microbatch adds {x.one_f_one_b_seconds * 1e3:.3g} ms to 1F1B, "
                            f"{x.interleaved_seconds * 1e3:.3g} ms to interleaved 1F1B (v = 2), "
                            f"{x.zb_h1_seconds * 1e3:.3g} ms to ZB-H1, {x.zbv_seconds * 1e3:.3g} ms to ZB-V")
    return runtime, layers, data_parallel, pipeline


def _median_over_ranks(runtime: dict, layers: list[dict], world: int) -> tuple[dict, list[dict]]:
    """Every rank's one-rank figures (each measured them at once, in its own child), each the median over
    the ranks: one rank's slow moment (a difference of differences of its steps, such as a layer's
    recomputation, moved by 2x on one rank in one tune) is outvoted at 3 ranks and halved at 2. A layer
    that a rank left out (its difference came out at or below 0) is the median of the others'."""
    import torch.distributed as dist  # noqa: PLC0415

    gathered: list = [None] * world
    dist.all_gather_object(gathered, (runtime, layers))
    return median_of_ranks(gathered)


def median_of_ranks(gathered: list[tuple[dict, list[dict]]]) -> tuple[dict, list[dict]]:
    """``_median_over_ranks`` of each rank's (runtime figures, layers): every float the median over the
    ranks (rank 0's other values), every layer's figures the median over the ranks that measured it."""
    import statistics  # noqa: PLC0415

    runtime = gathered[0][0]
    merged = {k: statistics.median(r[k] for r, _ in gathered) if isinstance(v, float) else v
              for k, v in runtime.items()}
    by_key: dict = {}
    for _, rank_layers in gathered:
        for x in rank_layers:
            by_key.setdefault(tuple(x[k] for k in ("signature", "nodes", "micro_batch", "tp", "sequence_parallel")),
                              []).append(x)
    figures = ("seconds", "recompute_seconds", "split_seconds")
    return merged, [xs[0] | {k: statistics.median(x[k] for x in xs) for k in figures} for xs in by_key.values()]


def _time_collectives(rank: int, world: int, per_node: int, device, quick: bool, console: Console) -> list[LinkFigure]:
    """Every group of ``tune_groups`` timed and fitted (rank 0's figures; [] elsewhere)."""
    from autopar.runtime.tuning.collectives import time_group, time_pair  # noqa: PLC0415

    sizes = _sizes(device.type, quick)
    out: list[LinkFigure] = []
    for group in tune_groups(world, per_node):
        if group.p2p:
            timed = {"p2p": time_pair(group.ranks[0], group.ranks[1], sizes, device)}
        else:
            timed = time_group(_GROUP_OPS, group.ranks, sizes, device, rounds=COLLECTIVE_ROUNDS,
                               calls=2 if quick else 4)
        for op, (nbytes, seconds) in timed.items():
            alpha, beta = fit_alpha_beta(nbytes, seconds)
            out.append(LinkFigure(op, group.size, group.placement, alpha, beta, tuple(nbytes), tuple(seconds)))
            _say(rank, console, f"{op} over {group.size} ranks {group.placement}-node: alpha {alpha * 1e6:.3g} us, "
                                f"beta {beta / 1e9:.3g} GB/s")
    return out


def _sources(device, copy_bytes: int, budget: float, backend: str, world: int) -> dict[str, str]:
    from autopar.cli.tune_layers import LAYER_COUNTS, MICROBATCHES  # noqa: PLC0415  (loads torch)

    return {
        "gemm": f"torch.matmul on {device}, median seconds of repeats filling {budget} s per shape, every rank "
                f"timing at once (rank 0's clock); FLOP/s = 2 batch M N K / seconds",
        "memory_bw_bytes_per_s": f"a copy of {copy_bytes >> 20} MiB of fp32: read + write bytes / median seconds",
        "eager_op_s": "100 eager adds of 8 elements in a row, per add, median",
        "compiled_call_s": "a call of torch.compile(lambda x: x * 2 + 1) on 8 elements, median (--compiled)",
        "runtime": ("the engine stepping a tiny reference GPT on one rank (cli/tune_runtime.py): "
                    "medians of steps at 1 and 3 layers, 1 and 4 microbatches, recomputed or not; AdamW on 2^20 "
                    "fp32 parameters, per parameter; every rank at once, each figure the median over the ranks; "
                    "world_step_s: the tiny GPT data parallel over 2 ranks, its step less its gradient reduction "
                    "less its one-rank step"),
        "layers": (f"the model of the flags built with {' and '.join(map(str, LAYER_COUNTS))} layers, compiled for t "
                   f"ranks, {MICROBATCHES} microbatches a step, the two engines stepped in turns (cli/tune_layers.py); "
                   f"a layer = the steps' difference over the layers and microbatches (at t > 1 the steps are kept, "
                   f"and the cost model fits the layer to them); t = 1 on every rank at once, each figure the median "
                   f"over the ranks"),
        "data_parallel": ("the model of the flags at 2 layers over 2 data-parallel ranks, 1 microbatch: PyTorch's "
                          "AdamW and the engine's distributed optimizer stepped in turns (cli/tune_layers.py)"),
        "pipeline": (f"the model of the flags at {PIPELINE_LAYERS} layers over 2 pipeline stages, 1F1B, interleaved "
                     f"1F1B (v = 2), ZB-H1 and ZB-V at {' and '.join(map(str, PIPELINE_MICROBATCHES))} microbatches, "
                     f"stepped in turns (cli/tune_layers.py); a microbatch = the two steps' difference over the "
                     f"microbatches, the slower stage's steps"),
        "collectives": (f"{backend} over {world} ranks: per size the median of {COLLECTIVE_ROUNDS} rounds of "
                        f"back-to-back calls (rank 0's clock); tp_all_reduce the runtime's tensor-parallel "
                        f"all-reduce (pairwise exchanges on gloo); p2p half a send/recv round trip; alpha and beta "
                        f"fitted to time = alpha + bytes / beta, least squares on the relative error") if world > 1
        else "none: one process",
    }


# ------------------------------------------------------------------------------ the table


def _preset_link(hw: Hardware, op: str, n: int, inter: bool) -> tuple[float, float]:
    """(alpha, beta) a preset's ring formulas give ``op`` over n ranks inside a node or across nodes."""
    bw, lat = (inter_node_bw(hw), hw.ib_latency) if inter else (intra_node_bw(hw), hw.nvlink_latency)
    if op == "p2p":
        return lat, bw
    if op in ("all_reduce", "tp_all_reduce"):
        return 2 * (n - 1) * lat, bw / wire_factor(ALL_REDUCE, n)
    return (n - 1) * lat, bw / wire_factor(ALL_GATHER, n)  # all-gather, reduce-scatter, all-to-all: (n-1)/n leaves


def _table(profile: HardwareProfile, hw: Hardware) -> Table:
    """What was measured, beside the nearest preset's figures."""
    name = nearest_preset(hw)
    preset = PROFILES[name]
    tab = Table(title=f"measured on {profile.device_name} x {profile.world}, beside the nearest preset {name} "
                      f"({preset.gpu})", title_justify="left")
    for col in ("what", "measured", name):
        tab.add_column(col, justify="left" if col == "what" else "right")
    for dtype in profile.dtypes():
        rates = sorted(g.flops_per_s for g in profile.gemm if g.dtype == dtype)
        tab.add_row(f"GEMM {dtype}, best (median) of {len(rates)} shapes",
                    f"{rates[-1] / 1e12:.3g} ({rates[len(rates) // 2] / 1e12:.3g}) TFLOP/s",
                    f"{preset.peak_flops * preset.eff.gemm / 1e12:.3g} TFLOP/s" if dtype != "fp32" else "-")
    tab.add_row("memory-bound (copy)", f"{profile.memory_bw / 1e9:.3g} GB/s",
                f"{preset.hbm_bw * preset.eff.hbm / 1e9:.4g} GB/s")
    tab.add_row("eager op overhead", f"{profile.eager_op_s * 1e6:.3g} us", f"{preset.eff.kernel_overhead * 1e6:.3g} us")
    if profile.compiled_call_s is not None:
        tab.add_row("compiled call overhead", f"{profile.compiled_call_s * 1e6:.3g} us", "-")
    if profile.runtime is not None:
        rt = profile.runtime
        tab.add_row("runtime: step, action, graph node, checkpoint, send, tp collective",
                    f"{rt['step_s'] * 1e6:.3g}, {rt['action_s'] * 1e6:.3g}, {rt['node_s'] * 1e6:.3g}, "
                    f"{rt['checkpoint_s'] * 1e6:.3g}, {rt['send_s'] * 1e6:.3g}, {rt['tp_collective_s'] * 1e6:.3g} us",
                    "-")
    for c in profile.collectives:
        alpha, beta = _preset_link(preset, c.op, c.ranks, c.placement == "inter")
        tab.add_row(f"{c.op} {c.ranks} ranks {c.placement}: alpha, beta",
                    f"{c.alpha_s * 1e6:.3g} us, {c.beta_bytes_per_s / 1e9:.3g} GB/s",
                    f"{alpha * 1e6:.3g} us, {beta / 1e9:.3g} GB/s")
    if not profile.collectives:
        tab.add_row("collectives", "not timed (one process)", "-")
    return tab
