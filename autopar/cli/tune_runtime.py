"""What autopar's runtime costs beyond its kernels, measured: per step, per chunk action, per graph node
of a layer, per checkpointed region, and the optimizer's step per parameter.

A training step of the engine runs, besides the model's kernels, the schedule's interpreter (each
action a Python call that looks up its context, posts its messages, records its statistics), the fx
chunks' generated code node by node with autograd recording each op and its saved tensors, and the
backward's autograd engine. On a CPU these fixed costs (about 6 us per graph node, forward and
backward together, and a few hundred us per action on this repository's machine) are a large part of
a small model's step; the eager per-op overhead of ``compute.eager_op_seconds`` (a bare add, no
autograd) misses most of them.

They are measured on the engine itself: a tiny reference GPT (``TINY``: its kernels cost microseconds,
so what its step takes is overhead) compiled for one rank and stepped at 1 and 3 layers, 1 and 4
microbatches, and at 3 layers and 4 microbatches with every layer recomputed, the five engines stepped
in turns; each the median of its ``repeats`` steps. With T(L, m) a step of L layers and m microbatches:

- per microbatch: u(L) = (T(L, 4) - T(L, 1)) / 3; a layer's forward and backward: (u(3) - u(1)) / 2,
  per graph node of its forward (``node_s``): that over the layer's ``call_function`` nodes;
- per step (``step_s``): T(1, 1) - u(1);
- per action (``action_s``, a chunk's F or B): (u(1) - one layer - the embedding's and head's nodes) / 2;
- per checkpointed region (``checkpoint_s``): (T_rc(3, 4) - T(3, 4)) / 12 less a layer's forward
  (a third of its forward and backward: the backward runs about two ops per forward op);
- per pipeline send (``send_s``, beside its bytes) and per forward graph node of a chunk whose backward is
  split into B and W (``split_node_s``; ``pipeline_seconds``): the tiny GPT of 4 layers over 2 ranks,
  1F1B at 2 and 8 microbatches and ZB-H1 at 8, the slopes less the 1-rank figures' share;
- a tensor-parallel collective's latency in a step, measured on its all-reduces (``tp_collective_s``: ``tp_all_reduce_in_step_seconds``):
  the tiny GPT of 2 layers over 2 ranks at t = 2, at 2 and 8 microbatches, its per-microbatch slope less
  the 1-rank figures', over the all-reduces the chunks call per microbatch (counted);
- a multi-rank step's own cost (``world_step_s``: ``world_step_seconds``): the tiny GPT of 1 layer data
  parallel over 2 ranks, 1 microbatch, its step less its gradient reduction (timed apart) less the
  1-rank step of the same (the failure board's read, the loss's all-reduce, the non-finite check's);
- the distributed optimizer's own step (``distopt_step_s``: ``distributed_optimizer_seconds``): the same
  2-rank engine's optimizer step, the engine's distributed optimizer against PyTorch's AdamW;
- the optimizer (``optimizer_per_param_s``): ``torch.optim.AdamW``'s step (PyTorch's default
  implementation) over 2^20 fp32 parameters in 64 tensors, per parameter, the caches
  flushed before each step (a training step's forward and backward leave the optimizer's state out).

Each rank of ``autopar tune`` runs ``measure`` in a child process of its own (``measure_in_subprocess``):
the engine of one rank cannot start inside a process that already joined a larger group. The ranks
run it at once, as they train. The figures that take 2 ranks (``measure_forked``: the send, the split
backward, the in-step collective, the multi-rank step) come after, from rank 0's child alone, its 2
ranks forked from it while the other ranks wait.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time

import torch

__all__ = ["TINY", "RuntimeFigures", "measure", "measure_in_subprocess", "graph_node_counts"]

TINY = dict(vocab_size=64, seq_len=8, n_head=2, d_model=16)
"""The reference GPT whose steps are all overhead."""

RuntimeFigures = dict
"""``step_s``, ``action_s``, ``node_s``, ``checkpoint_s``, ``optimizer_per_param_s`` and the tiny GPT's
``layer_nodes`` and ``end_nodes``: a profile's ``runtime`` section (``hardware.RuntimeOverheads``)."""


def graph_node_counts(model: torch.nn.Module, x: torch.Tensor) -> tuple[int, int]:
    """(call_function nodes of layer 0, those outside the layers) of ``model``'s traced graph, as
    ``autopar.parallelize`` traces it."""
    from autopar.compiler.trace import lm_cross_entropy, trace  # noqa: PLC0415
    from passes.layers import find_layers  # noqa: PLC0415
    from passes.normalize import normalize  # noqa: PLC0415

    traced = trace(model, (x,), x, lm_cross_entropy)
    normalize(traced.gm, set(traced.param_of))
    layers = find_layers(traced.gm)
    calls = [n for n in traced.gm.graph.nodes if n.op == "call_function"]
    return (sum(layers.node_layer.get(n.name) == 0 for n in calls),
            sum(layers.node_layer.get(n.name) is None for n in calls))


def _engine(layers: int, m: int, recompute: str):
    """A one-rank engine of the tiny GPT of ``layers`` layers stepping ``m`` microbatches, and its batch."""
    import autopar  # noqa: PLC0415
    from autopar.reference.models import build  # noqa: PLC0415

    torch.manual_seed(0)
    model = build("gpt", n_layer=layers, **TINY)
    g = torch.Generator().manual_seed(0)
    x = torch.randint(0, TINY["vocab_size"], (m, TINY["seq_len"]), generator=g)
    split = recompute == "split"  # each backward split into B and W: ZB-H1, which one rank runs without a bubble
    program = autopar.parallelize(model, example_inputs=(x[:1],), example_targets=x[:1], world_size=1,
                                  microbatches=m, recompute="none" if split else recompute,
                                  schedule="zb-h1" if split else "1f1b")
    return program.materialize(), x


def _step_seconds(runs: dict, repeats: int, rounds: int = 3) -> dict:
    """Key -> median seconds of a step of each engine of ``runs``, stepped in turns (``rounds`` rounds of
    ``repeats`` steps each, after 3 warm-up steps): a slow moment of a shared machine falls on all alike."""
    engines = {key: _engine(*key) for key in runs}
    times: dict = {key: [] for key in runs}
    for engine, x in engines.values():
        for _ in range(3):
            engine.train_step(x, x)
    for _ in range(rounds):
        for key, (engine, x) in engines.items():
            for _ in range(repeats):
                t0 = time.perf_counter()
                engine.train_step(x, x)
                times[key].append(time.perf_counter() - t0)
    return {key: statistics.median(ts) for key, ts in times.items()}


_PROGRAMS: dict = {}  # the 2-rank programs the forked ranks step (forked with them: spawn(inherit=True))


def _two_rank_steps(batches: dict, repeats: int, rounds: int = 3) -> dict:
    """One rank of the 2-rank programs ``_PROGRAMS`` (key -> program, ``batches`` key -> its batch),
    their engines stepped in turns (``rounds`` rounds of ``repeats`` steps each, after 3 warm-up steps):
    key -> (the median step, the tensor-parallel all-reduces per step: pairwise exchanges,
    ``group._recursive_doubling``, what ``core.comm.group.all_reduce`` runs on a gloo group of 2; the
    median seconds of a step in the data-parallel gradient reduction, ``GradientSync.start`` and
    ``end_step``)."""
    import torch.distributed as dist  # noqa: PLC0415

    from autopar.core.comm import group  # noqa: PLC0415
    from autopar.cli.tune_clock import gradient_sync_clock  # noqa: PLC0415

    calls = [0]
    exchange = group._recursive_doubling

    def counted(*args, **kwargs):
        calls[0] += 1
        return exchange(*args, **kwargs)

    group._recursive_doubling = counted  # this forked rank's own module: counts what the chunks run
    try:
        with gradient_sync_clock() as in_sync:
            engines = {key: program.materialize() for key, program in _PROGRAMS.items()}
            times: dict = {key: [] for key in engines}
            exchanges: dict = {key: 0 for key in engines}
            syncs: dict = {key: [] for key in engines}
            for key, engine in engines.items():
                for _ in range(3):
                    engine.train_step(batches[key], batches[key])
            for _ in range(rounds):
                for key, engine in engines.items():
                    for _ in range(repeats):
                        dist.barrier()
                        calls[0], in_sync[0] = 0, 0.0
                        t0 = time.perf_counter()
                        engine.train_step(batches[key], batches[key])
                        times[key].append(time.perf_counter() - t0)
                        exchanges[key] = calls[0]
                        syncs[key].append(in_sync[0])
    finally:
        group._recursive_doubling = exchange
    return {key: (statistics.median(ts), exchanges[key], statistics.median(syncs[key])) for key, ts in times.items()}


def _two_rank_programs(layers: int, runs: dict, repeats: int) -> dict:
    """key -> (the slower rank's median step, exchanges per step, rank 0's seconds of a step in the
    gradient reduction) of the tiny GPT of ``layers`` layers
    compiled for 2 ranks with each of ``runs`` (key -> (microbatches, ``parallelize`` layout arguments)),
    stepped in turns in one launch."""
    import autopar  # noqa: PLC0415
    from autopar.reference.models import build  # noqa: PLC0415

    batches = {}
    for key, (m, layout) in runs.items():
        torch.manual_seed(0)
        g = torch.Generator().manual_seed(0)
        x = batches[key] = torch.randint(0, TINY["vocab_size"], (m, TINY["seq_len"]), generator=g)
        _PROGRAMS[key] = autopar.parallelize(build("gpt", n_layer=layers, **TINY), example_inputs=(x[:1],),
                                             example_targets=x[:1], world_size=2, microbatches=m, **layout)
    try:
        ranks = autopar.spawn(_two_rank_steps, 2, (batches, max(1, repeats // 3)), inherit=True)
    finally:
        _PROGRAMS.clear()
    return {key: (max(r[key][0] for r in ranks), ranks[0][key][1], ranks[0][key][2]) for key in runs}


def pipeline_seconds(node_s: float, action_s: float, end_nodes: int, split_layer: float,
                     repeats: int) -> tuple[float, float, float]:
    """(a pipeline send's cost beside its bytes, a split backward's cost per forward graph node of its
    chunk, and what a split backward costs per microbatch on a pipeline stage beside its layers' own
    split, ``split_layer`` each on one rank), measured on the engine: the tiny GPT of 4 layers over 2
    ranks (2 layers a chunk).

    1F1B at 2 and 8 microbatches: each microbatch adds, on the slower stage, its chunk's forward and
    backward (2 actions, 2 layers' and the head's nodes: the 1-rank figures) and 2 sends (one after F,
    one after B); the rest of the per-microbatch slope, over 2, is one send's (posting it, the peer's
    receive, their waits). ZB-H1 at 8 microbatches runs the same work with each backward split into B
    and W: what it adds per microbatch over 1F1B, less W's action, over the chunk's forward nodes, is
    the split's cost per node (the autograd graph's walk, its retained graph, the store's slots); less the
    chunk's 2 layers' own split (measured on one rank: ZB-H1 runs there without a bubble), what a split
    backward costs a pipeline stage per microbatch beside its layers' (``split_pipeline_s``). The
    three engines are stepped in turns, in one launch."""
    from autopar.reference.models import build  # noqa: PLC0415

    pp = lambda schedule: dict(pp=2, schedule=schedule)  # noqa: E731
    steps = {k: t for k, (t, _, _) in _two_rank_programs(4, {("1f1b", 2): (2, pp("1f1b")), ("1f1b", 8): (8, pp("1f1b")),
                                                         ("zb-h1", 8): (8, pp("zb-h1"))}, repeats).items()}
    slope = (steps["1f1b", 8] - steps["1f1b", 2]) / 6
    layer_nodes = graph_node_counts(build("gpt", n_layer=2, **TINY), torch.zeros(1, TINY["seq_len"], dtype=torch.long))[0]
    chunk_nodes = 2 * layer_nodes + end_nodes  # the head's stage, the slower
    send = max((slope - chunk_nodes * node_s - 2 * action_s) / 2, 0.0)
    per_microbatch = (steps["zb-h1", 8] - steps["1f1b", 8]) / 8 - action_s
    return send, max(per_microbatch / chunk_nodes, 0.0), max(per_microbatch - 2 * split_layer, 0.0)


def tp_all_reduce_in_step_seconds(u1: float, layer: float, repeats: int) -> float:
    """A tensor-parallel collective's latency inside a step, measured on the engine's all-reduces: the
    tiny GPT of 2 layers over 2 ranks at t = 2, 2 and 8 microbatches, stepped in turns in one launch.
    Each microbatch adds what it adds on one rank (``u1 + layer``: its nodes and actions; the tiny
    kernels cost nothing) and its all-reduces, counted as the chunks run them; the rest of the
    per-microbatch slope over that count is one all-reduce's."""
    tp = dict(tp=2, sequence_parallel=False)
    got = _two_rank_programs(2, {2: (2, tp), 8: (8, tp)}, repeats)
    per_mb_calls = (got[8][1] - got[2][1]) / 6
    slope = (got[8][0] - got[2][0]) / 6
    return max((slope - u1 - layer) / per_mb_calls, 0.0) if per_mb_calls > 0 else 0.0


def world_step_seconds(one_rank_step: float, repeats: int) -> float:
    """What a step of a 2-rank engine costs beside a one-rank step of the same work and its gradient
    reduction: the tiny GPT of 1 layer, 1 microbatch, data parallel over 2 ranks; its step less the
    time in ``GradientSync`` (priced apart, by its bytes) less ``one_rank_step`` (the same model's step
    on one rank, measured beside)."""
    (step, _, sync), = _two_rank_programs(1, {"dp": (1, dict(dp=2))}, repeats).values()
    return max(step - sync - one_rank_step, 0.0)


def _optimizer_steps(x: torch.Tensor, repeats: int) -> tuple[float, float]:
    """One forked rank of ``_PROGRAMS["dp"]``: (median seconds of PyTorch's AdamW step, of the engine's
    distributed optimizer's step with its parameters' all-gathers waited for), each after a training step,
    the two engines stepped in turns."""
    import torch.distributed as dist  # noqa: PLC0415

    torch.set_num_threads(1)
    plain, sharded = _PROGRAMS["dp"].materialize(), _PROGRAMS["dp"].materialize()
    optimizers = {"plain": (plain, torch.optim.AdamW(list(plain.parameters()), lr=1e-4)),
                  "sharded": (sharded, sharded.distributed_optimizer(torch.optim.AdamW, lr=1e-4))}
    times: dict = {k: [] for k in optimizers}
    for i in range(3 + repeats):
        for key, (engine, opt) in optimizers.items():
            engine.train_step(x, x)
            dist.barrier()
            t0 = time.perf_counter()
            opt.step()
            engine.wait_parameters("tune")
            opt.zero_grad(set_to_none=True)
            if i >= 3:
                times[key].append(time.perf_counter() - t0)
    return statistics.median(times["plain"]), statistics.median(times["sharded"])


def distributed_optimizer_seconds(repeats: int) -> float:
    """What the distributed optimizer's step costs beside the inner optimizer's (the watch, the gathers'
    launch and wait, the write-back; its bytes are the tiny GPT's few): the tiny GPT of 1 layer data
    parallel over 2 ranks, its step against plain AdamW's, the slower rank's."""
    import autopar  # noqa: PLC0415
    from autopar.reference.models import build  # noqa: PLC0415

    torch.manual_seed(0)
    x = torch.randint(0, TINY["vocab_size"], (1, TINY["seq_len"]), generator=torch.Generator().manual_seed(0))
    _PROGRAMS["dp"] = autopar.parallelize(build("gpt", n_layer=1, **TINY), example_inputs=(x,), example_targets=x,
                                          world_size=2, dp=2, microbatches=1)
    try:
        ranks = autopar.spawn(_optimizer_steps, 2, (x, repeats), inherit=True)
    finally:
        _PROGRAMS.clear()
    return max(max(sharded - plain, 0.0) for plain, sharded in ranks)


def _optimizer_per_param(repeats: int) -> float:
    params = [torch.nn.Parameter(torch.zeros(1 << 14)) for _ in range(64)]  # a model's many tensors
    for p in params:
        p.grad = torch.ones_like(p)
    opt = torch.optim.AdamW(params, lr=1e-4)
    evict = torch.zeros(16 << 20)  # 64 MiB: a step's forward and backward leave none of the state in cache
    times = []
    for i in range(repeats + 2):
        evict.add_(1.0)
        t0 = time.perf_counter()
        opt.step()
        if i >= 2:
            times.append(time.perf_counter() - t0)
    return statistics.median(times) / sum(p.numel() for p in params)


ONE_RANK_BASIS = ("_u1", "_layer", "_t11", "_split_layer")
"""What ``measure_forked`` needs from ``measure``'s steps (kept in its figures, dropped from the profile):
a microbatch of the 1-layer tiny GPT, a layer's forward and backward, a 1-layer 1-microbatch step, what
splitting a layer's backward into B and W adds on one rank (1 and 3 layers, 4 microbatches, ZB-H1)."""


MEASURE_ATTEMPTS = 3
"""How many times ``measure`` steps its engines (each time for longer) while two layers' microbatch
comes out no slower than one layer's: a figure of noise, not of the layers."""


def measure(repeats: int = 20) -> RuntimeFigures:
    """The runtime's overheads on this process's device that one rank measures alone (the module's
    docstring); CPU, one thread. The 2-rank figures are ``measure_forked``'s, 0 here."""
    from autopar.reference.models import build  # noqa: PLC0415

    runs = [(L, m, "none") for L in (1, 3) for m in (1, 4)] + [(3, 4, "layer"), (1, 4, "split"), (3, 4, "split")]
    for attempt in range(1, MEASURE_ATTEMPTS + 1):
        timed = _step_seconds(runs, max(1, repeats // 3) * attempt)
        # two layers' microbatch, the difference every per-node figure rests on: at or below 0 the steps'
        # jitter (a loaded machine) exceeded it, so the engines are stepped again, for longer
        if timed[3, 4, "none"] - timed[3, 1, "none"] > timed[1, 4, "none"] - timed[1, 1, "none"]:
            break
    split_layer = max((timed[3, 4, "split"] - timed[1, 4, "split"] - timed[3, 4, "none"] + timed[1, 4, "none"]) / 8, 0.0)
    T = {(L, m): timed[L, m, "none"] for L in (1, 3) for m in (1, 4)}
    rc = timed[3, 4, "layer"]
    u1, u3 = (T[1, 4] - T[1, 1]) / 3, (T[3, 4] - T[3, 1]) / 3
    layer = max((u3 - u1) / 2, 0.0)
    torch.manual_seed(0)
    layer_nodes, end_nodes = graph_node_counts(build("gpt", n_layer=2, **TINY),
                                               torch.zeros(1, TINY["seq_len"], dtype=torch.long))
    node = layer / layer_nodes
    action = max((u1 - layer - node * end_nodes) / 2, 0.0)
    return {"step_s": max(T[1, 1] - u1, 0.0), "action_s": action,
            "node_s": node, "checkpoint_s": max((rc - T[3, 4]) / 12 - layer / 3, 0.0),
            "optimizer_per_param_s": _optimizer_per_param(repeats), "layer_nodes": layer_nodes,
            "end_nodes": end_nodes, "send_s": 0.0, "split_node_s": 0.0, "split_pipeline_s": 0.0, "tp_collective_s": 0.0,
            "world_step_s": 0.0, "distopt_step_s": 0.0,
            "_u1": u1, "_layer": layer, "_t11": T[1, 1], "_split_layer": split_layer}


FORKED_REPEATS = 2
"""How many times ``measure``'s steps ``measure_forked`` takes: a 2-rank step waits for its peer, and
its figures (differences of such steps) jitter twice as much as one rank's."""


def measure_forked(one: RuntimeFigures, repeats: int = 20) -> RuntimeFigures:
    """The figures that take 2 ranks (forked from this process), given ``measure``'s: a pipeline send, a
    split backward per node, a tensor-parallel collective in a step, a multi-rank step; each over
    ``FORKED_REPEATS`` x ``repeats`` steps."""
    repeats *= FORKED_REPEATS
    send, split, split_pipeline = pipeline_seconds(one["node_s"], one["action_s"], int(one["end_nodes"]),
                                                   one["_split_layer"], repeats)
    return {"send_s": send, "split_node_s": split, "split_pipeline_s": split_pipeline,
            "tp_collective_s": tp_all_reduce_in_step_seconds(one["_u1"], one["_layer"], repeats),
            "world_step_s": world_step_seconds(one["_t11"], repeats),
            "distopt_step_s": distributed_optimizer_seconds(repeats)}


def measure_in_subprocess(repeats: int = 20, forked: dict | None = None, layers: dict | None = None) -> RuntimeFigures:
    """In a child process outside any process group, one thread (as a rank trains): ``measure``, or with
    ``forked`` (``measure``'s figures) ``measure_forked`` (its ranks forked from the child); ``layers``:
    also the model's layers (``tune_layers.measure_layers``' arguments; t = 1 alone, t > 1 when
    forked) and its data-parallel side (forked), returned under ``"model"``."""
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
                        "GROUP_RANK", "ROLE_RANK", "TORCHELASTIC_RUN_ID")}
    out = subprocess.run([sys.executable, "-m", "autopar.cli.tune_runtime", str(repeats), json.dumps(forked),
                          json.dumps(layers)],
                         env=env, capture_output=True, text=True)
    if out.returncode != 0:
        raise SystemExit(f"autopar tune: measuring the runtime {'on forked ranks ' if forked else ''}failed "
                         f"(exit {out.returncode}); its output ends:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


if __name__ == "__main__":
    torch.set_num_threads(1)
    repeats, base, wanted = int(sys.argv[1]), json.loads(sys.argv[2]), json.loads(sys.argv[3])
    figures = measure(repeats) if base is None else measure_forked(base, repeats)
    if wanted:
        from autopar.cli.tune_layers import measure_layers  # noqa: PLC0415

        figures["model"] = measure_layers(forked=base is not None, **wanted)
    print(json.dumps(figures))
