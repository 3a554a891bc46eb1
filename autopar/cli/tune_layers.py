"""The model's own layer, measured on the engine: ``autopar tune``'s ``layers`` section.

The cost model prices a layer from its kernels (the GEMMs at their measured rates, the element-wise
passes at the measured copy bandwidth), its graph nodes' overhead (measured per node on a tiny GPT)
and its tensor-parallel collectives (measured on that tiny GPT too). A model's own layer runs its
own mix: a Llama's many small nodes (rotary slices, RMSNorm's products) cost less than the tiny GPT's
average node, a collective between two busy ranks waits longer for its peer than between two idle
ones. So, given a model it can build (``--hf-config``, or dimensions the reference GPT or Llama
have), ``autopar tune`` times that model's layer on the engine itself, as the ranks will train it:

- for each micro-batch of ``--micro-batch`` and twice it, and each tensor-parallel degree t that
  divides the ranks (and the heads), with and without sequence parallelism when t > 1;
- the model built with 2 and with 4 layers (``LAYER_COUNTS``), compiled for t ranks, ``MICROBATCHES`` microbatches a
  step, as is, and (t = 1) with every layer recomputed and with each backward split into B and W
  (``MODES``), the engines stepped in turns after warm-up steps; a layer's forward and backward is
  (T(4) - T(2)) / (2 MICROBATCHES), the embedding, the head, the step's and the actions' costs
  cancelling; what recomputing it and splitting its backward add, the same differences less the
  plain layer's;
- t = 1 on every rank at once (each in its own process: the machine as loaded as in training);
  t > 1 on t ranks forked together.

The cost model then scales the priced layer of a matching model (``ModelSpec.layer_signature`` and
its graph node count) by measured over priced at the nearest measured micro-batch
(``op_times.layer_scale``), and says so (``Estimate.layer_scale``).
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch

from autopar.planning.cost.hardware import PIPELINE_LAYERS, PIPELINE_MICROBATCHES

__all__ = ["MICROBATCHES", "LayerRun", "model_builder", "layer_runs", "measure_one_rank", "measure_ranks", "spec_of",
           "measure_layers", "measure_pipeline", "PIPELINE_SCHEDULES"]

MICROBATCHES = 4
"""Microbatches a measured step runs: each adds its layers' forward and backward, so the difference of
two layer counts is measured 4 times over."""

LAYER_COUNTS = (2, 4)
"""The two depths the model is built at: their difference is two layers (at least two a model, so that
``recompute='layer'`` finds its repeated layer)."""

LayerRun = tuple[int, int, bool]
"""(micro-batch, t, sequence parallel): one measured layer."""


def model_builder(args: argparse.Namespace) -> tuple[Callable[[int], torch.nn.Module], int, int] | None:
    """(layers -> the model of ``args`` with that many layers, its sequence length, its vocabulary), or
    None when the flags describe no model autopar can build (a preset of the paper, an MoE by its
    dimensions): a HuggingFace config, or dimensions of the reference GPT (GELU MLP) or Llama (SwiGLU)."""
    seq = args.seq_len or 2048
    if getattr(args, "hf_config", None):
        import transformers  # noqa: PLC0415

        config = transformers.AutoConfig.from_pretrained(args.hf_config)

        def hf(layers: int) -> torch.nn.Module:
            torch.manual_seed(0)
            c = config.__class__.from_dict({**config.to_dict(), "num_hidden_layers": layers})
            return transformers.AutoModelForCausalLM.from_config(c)
        return hf, seq, int(config.vocab_size)
    if args.model or args.layers is None or args.experts:
        return None
    from autopar.reference.models import build  # noqa: PLC0415

    vocab = args.vocab or 51200

    def reference(layers: int) -> torch.nn.Module:
        torch.manual_seed(0)
        return build("llama" if args.gated_mlp else "gpt", vocab_size=vocab, seq_len=seq, n_layer=layers,
                     n_head=args.heads, n_kv_head=args.kv_heads, d_model=args.hidden, d_ff=args.ffn)
    return reference, seq, vocab


def layer_runs(micro_batch: int, heads: int, kv_heads: int, world: int) -> list[LayerRun]:
    """What to measure: micro-batches b and 2b; t = 1, and each t > 1 dividing the world and the heads,
    with and without sequence parallelism."""
    out: list[LayerRun] = []
    for t in (k for k in range(1, world + 1) if world % k == 0 and heads % k == 0 and kv_heads % k == 0):
        for b in (micro_batch, 2 * micro_batch):
            out += [(b, t, False)] + ([(b, t, True)] if t > 1 else [])
    return out


def _batch(b: int, seq: int, vocab: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(0)
    return torch.randint(0, vocab, (MICROBATCHES * b, seq), generator=g)


MODES = ("plain", "recompute", "split")
"""How each depth is stepped: as is; every layer recomputed (``recompute='layer'``); each backward split into
B and W (``schedule='zb-h1'``, which one rank runs with no bubble). The last only at t = 1."""


def _program(make: Callable[[int], torch.nn.Module], layers: int, x: torch.Tensor, b: int, t: int, sp: bool,
             mode: str):
    import autopar  # noqa: PLC0415

    return autopar.parallelize(make(layers), example_inputs=(x[:b],), example_targets=x[:b], world_size=t, tp=t,
                               sequence_parallel=sp if t > 1 else False, microbatches=MICROBATCHES,
                               recompute="layer" if mode == "recompute" else "none",
                               schedule="zb-h1" if mode == "split" else "1f1b")


def _all_agree(keep: bool) -> bool:
    """Whether every rank of the default group would go on (each rank's own clock decides its ``keep``):
    ranks that stepped a different number of times would leave one waiting in a collective for a peer
    that has exited."""
    import torch.distributed as dist  # noqa: PLC0415

    flag = torch.tensor([int(keep)])
    dist.all_reduce(flag, op=dist.ReduceOp.MIN)
    return bool(flag.item())


def _alternate(engines: dict, budget_s: float, sync: Callable[[], None] = lambda: None,
               agree: Callable[[bool], bool] = lambda keep: keep) -> dict:
    """Key -> median step of each engine of ``engines`` (key -> (engine, its batch)), stepped in turns
    (3 warm-up steps, then rounds of 2 steps each until ``budget_s`` has passed, 6 rounds at least): every
    configuration measured under the same conditions, a slow moment of the machine falling on all.
    Forked ranks pass ``agree=_all_agree``: they stop on the same round."""
    for engine, x in engines.values():
        for _ in range(3):
            engine.train_step(x, x)
    times: dict = {k: [] for k in engines}
    start, rounds = time.perf_counter(), 0
    while rounds < 6 or agree(time.perf_counter() - start < budget_s and rounds < 60):
        for key, (engine, x) in engines.items():
            for _ in range(2):
                sync()
                t0 = time.perf_counter()
                engine.train_step(x, x)
                times[key].append(time.perf_counter() - t0)
        rounds += 1
    return {k: statistics.median(v) for k, v in times.items()}


def _per_layer(steps: dict, modes: tuple[str, ...]) -> dict[str, float]:
    """Mode -> a layer's seconds: ``seconds`` (plain), ``recompute_seconds`` and ``split_seconds`` (what
    each adds to the plain layer), from the steps at the two depths (``steps``: (depth, mode) -> seconds)."""
    lo, hi = LAYER_COUNTS
    layer = {m: (steps[hi, m] - steps[lo, m]) / ((hi - lo) * MICROBATCHES) for m in modes}
    out = {"seconds": max(layer["plain"], 0.0)}
    for mode, field in (("recompute", "recompute_seconds"), ("split", "split_seconds")):
        out[field] = max(layer[mode] - layer["plain"], 0.0) if mode in modes else 0.0
    return out


def _by_config(steps: dict, modes: tuple[str, ...]) -> dict[tuple, dict[str, float]]:
    """(b, sp) -> ``_per_layer`` of the steps keyed (b, sp, depth, mode)."""
    configs = sorted({(b, sp) for b, sp, _, _ in steps})
    return {(b, sp): _per_layer({(n, m): steps[b, sp, n, m] for n in LAYER_COUNTS for m in modes}, modes)
            for b, sp in configs}


def measure_one_rank(make: Callable[[int], torch.nn.Module], seq: int, vocab: int, micro_batches: list[int],
                     budget_s: float) -> dict[int, dict[str, float]]:
    """Micro-batch -> a layer's figures (``_per_layer``) at t = 1, in this process: every micro-batch's
    engines stepped in turns together."""
    engines = {}
    for b in micro_batches:
        x = _batch(b, seq, vocab)
        engines |= {(b, False, n, m): (_program(make, n, x, b, 1, False, m).materialize(), x)
                    for n in LAYER_COUNTS for m in MODES}
    return {b: figures for (b, _), figures in _by_config(_alternate(engines, budget_s * len(micro_batches)),
                                                         MODES).items()}


_FORKED: dict = {}  # the programs the forked ranks step, with their batches (forked with them: spawn(inherit=True))


def _rank_steps(budget_s: float) -> dict:
    import torch.distributed as dist  # noqa: PLC0415

    torch.set_num_threads(1)
    engines = {key: (program.materialize(), x) for key, (program, x) in _FORKED.items()}
    return _alternate(engines, budget_s, sync=dist.barrier, agree=_all_agree)


def measure_ranks(make: Callable[[int], torch.nn.Module], seq: int, vocab: int, t: int,
                  configs: list[tuple[int, bool]], budget_s: float) -> dict[tuple, dict[str, float]]:
    """(b, sp) -> a layer's forward and backward (``_per_layer``'s ``seconds``) on one of t tensor-parallel
    ranks forked from this process (the slower rank's steps), every configuration's engines stepped in
    turns in one launch, with the steps themselves (``steps``: [layers, seconds] at each depth, and
    ``microbatches``), which the cost model fits the layer to. Recomputation and the split are left to
    t = 1's figures: their differences of differences drown in the collectives' waits here."""
    import autopar  # noqa: PLC0415

    modes = ("plain",)
    for b, sp in configs:
        x = _batch(b, seq, vocab)
        _FORKED.update({(b, sp, n, m): (_program(make, n, x, b, t, sp, m), x) for n in LAYER_COUNTS for m in modes})
    try:
        ranks = autopar.spawn(_rank_steps, t, (budget_s * len(configs),), inherit=True)
    finally:
        _FORKED.clear()
    slower = {key: max(r[key] for r in ranks) for key in ranks[0]}
    return {(b, sp): figures | {"steps": [[n, slower[b, sp, n, "plain"]] for n in LAYER_COUNTS],
                                "microbatches": MICROBATCHES}
            for (b, sp), figures in _by_config(slower, modes).items()}


def _data_parallel_steps(x: torch.Tensor, budget_s: float) -> dict:
    """One forked rank of ``_FORKED["dp"]``: the plain engine (AdamW) and the distributed optimizer's,
    stepped in turns: median seconds of the plain step, its gradient reduction, its optimizer step and
    clearing, and the distributed one's step with its optimizer step, gathers and clearing; the
    parameters held."""
    import torch.distributed as dist  # noqa: PLC0415

    from autopar.cli.tune_clock import gradient_sync_clock  # noqa: PLC0415

    torch.set_num_threads(1)
    with gradient_sync_clock() as in_sync:
        plain, sharded = _FORKED["dp"].materialize(), _FORKED["dp"].materialize()
        adamw = torch.optim.AdamW(list(plain.parameters()), lr=1e-4)
        distopt = sharded.distributed_optimizer(torch.optim.AdamW, lr=1e-4)
        got: dict = {k: [] for k in ("step", "sync", "optimizer", "distopt")}
        t_start, i = time.perf_counter(), 0
        while i < 9 or _all_agree(time.perf_counter() - t_start < budget_s and i < 200):
            dist.barrier()
            in_sync[0] = 0.0
            t0 = time.perf_counter()
            plain.train_step(x, x)
            t1 = time.perf_counter()
            adamw.step()
            adamw.zero_grad(set_to_none=True)
            t2 = time.perf_counter()
            sync = in_sync[0]
            dist.barrier()
            t3 = time.perf_counter()
            sharded.train_step(x, x)
            distopt.step()
            sharded.wait_parameters("tune")
            distopt.zero_grad(set_to_none=True)
            t4 = time.perf_counter()
            if i >= 3:
                for k, v in (("step", t2 - t0), ("sync", sync), ("optimizer", t2 - t1), ("distopt", t4 - t3)):
                    got[k].append(v)
            i += 1
    out = {k: statistics.median(v) for k, v in got.items()}
    return out | {"params": sum(p.numel() for p in plain.parameters())}


def measure_data_parallel(make: Callable[[int], torch.nn.Module], seq: int, vocab: int, b: int,
                          budget_s: float) -> dict:
    """The model of 2 layers over 2 data-parallel ranks forked from this process, 1 microbatch:
    ``MeasuredDataParallel``'s figures (rank 0's)."""
    import autopar  # noqa: PLC0415

    x = _batch(b, seq, vocab)[:b]
    _FORKED["dp"] = autopar.parallelize(make(2), example_inputs=(x,), example_targets=x, world_size=2, dp=2,
                                        microbatches=1, recompute="none")
    try:
        got = autopar.spawn(_data_parallel_steps, 2, (x, budget_s), inherit=True)[0]
    finally:
        _FORKED.clear()
    compute = got["step"] - got["sync"] - got["optimizer"]
    return {"params": int(got["params"]), "sync_seconds": got["sync"], "optimizer_seconds": got["optimizer"],
            "distopt_seconds": max(got["distopt"] - compute, 1e-9)}


PIPELINE_SCHEDULES = (("1f1b", 1, "one_f_one_b"), ("interleaved", 2, "interleaved"), ("zb-h1", 1, "zb_h1"),
                      ("zbv", 2, "zbv"))
"""(schedule, v, the ``MeasuredPipeline`` field's stem) of each measured pipeline step."""


def measure_pipeline(make: Callable[[int], torch.nn.Module], seq: int, vocab: int, b: int,
                     budget_s: float) -> dict | None:
    """The model of ``PIPELINE_LAYERS`` layers over 2 pipeline stages forked from this process, in each
    schedule of ``PIPELINE_SCHEDULES`` at each of ``PIPELINE_MICROBATCHES`` microbatches of ``b``, the
    engines stepped in turns: ``MeasuredPipeline``'s figures (what a microbatch adds to each, the slower
    stage's steps); None when the compiler refuses the model at one of those layouts."""
    import autopar  # noqa: PLC0415
    from autopar.core.errors import AutoparError  # noqa: PLC0415

    lo, hi = PIPELINE_MICROBATCHES
    g = torch.Generator().manual_seed(0)
    x = torch.randint(0, vocab, (hi * b, seq), generator=g)
    try:
        for schedule, v, _ in PIPELINE_SCHEDULES:
            for m in PIPELINE_MICROBATCHES:
                _FORKED[schedule, m] = (autopar.parallelize(make(PIPELINE_LAYERS), example_inputs=(x[:b],),
                                                            example_targets=x[:b], world_size=2, pp=2,
                                                            schedule=schedule, virtual_stages=v, microbatches=m,
                                                            recompute="none"), x[:m * b])
        ranks = autopar.spawn(_rank_steps, 2, (budget_s * len(_FORKED),), inherit=True)
    except AutoparError:
        return None
    finally:
        _FORKED.clear()
    step = {key: max(r[key] for r in ranks) for key in ranks[0]}
    got = {f"{stem}_seconds": (step[schedule, hi] - step[schedule, lo]) / (hi - lo)
           for schedule, _, stem in PIPELINE_SCHEDULES}
    return {"micro_batch": b, **got} if min(got.values()) > 0 else None  # 6 microbatches lost in the noise


def spec_of(make: Callable[[int], torch.nn.Module], seq: int):
    """The planner's ``ModelSpec`` of the model ``make`` builds (at 2 layers), read from its traced graph as
    the planner reads it: its ``layer_signature``, graph node counts, heads."""
    from autopar.compiler.model_spec import spec_from_model  # noqa: PLC0415

    x = torch.zeros(1, seq, dtype=torch.long)
    return spec_from_model(make(2), (x,), x)


def measure_layers(flags: str, micro_batch: int, world: int, forked: bool, quick: bool) -> dict:
    """``{"layers": [...], "data_parallel": [...], "pipeline": [...]}``: the entries this process measures
    for the model of the tune ``flags``: its layer at t = 1 here, or with ``forked`` (rank 0's child, the
    other ranks waiting) its layer at each t > 1 on t ranks forked from it, and its data-parallel side and
    pipeline on 2 (when the world has 2 ranks or more). Empty lists when the flags describe no model autopar
    can build, and with ``"skipped"`` (why) when the model cannot be built at 2 layers or compiled."""
    import shlex  # noqa: PLC0415

    from autopar.cli.arguments import build_parser  # noqa: PLC0415
    from autopar.core.errors import AutoparError  # noqa: PLC0415

    args = build_parser().parse_args(["tune", *shlex.split(flags)])
    built = model_builder(args)
    if built is None:
        return {"layers": [], "data_parallel": [], "pipeline": []}
    make, seq, vocab = built
    try:  # a config that cannot be rebuilt at another depth, or a model the compiler refuses
        spec = spec_of(make, seq)
        _program(make, LAYER_COUNTS[0], _batch(micro_batch, seq, vocab), micro_batch, 1, False, "plain")
    except (AutoparError, ValueError, TypeError, KeyError) as e:
        return {"layers": [], "data_parallel": [], "pipeline": [],
                "skipped": f"{type(e).__name__}: {str(e).splitlines()[0][:300]}"}
    signature, nodes = spec.layer_signature, spec.graph_nodes[1] if spec.graph_nodes else 0
    runs = layer_runs(micro_batch, spec.heads, spec.kv, world)
    budget = 3.0 if quick else 8.0
    dp, pipeline = [], []
    if forked:  # t > 1: each collective's wait moves with the ranks' scheduling, so twice the steps
        timed = {}
        for t in sorted({t for _, t, _ in runs if t > 1}):
            try:
                got = measure_ranks(make, seq, vocab, t, [(b, sp) for b, t_, sp in runs if t_ == t], 2 * budget)
            except AutoparError:  # the compiler refuses this degree for this model: priced from its kernels
                continue
            timed |= {(b, t, sp): figures for (b, sp), figures in got.items()}
        if world >= 2:
            dp = [dict(signature=signature, nodes=nodes,
                       **measure_data_parallel(make, seq, vocab, micro_batch, budget))]
            got = measure_pipeline(make, seq, vocab, micro_batch, budget)
            pipeline = [dict(signature=signature, nodes=nodes, **got)] if got else []
    else:
        one = measure_one_rank(make, seq, vocab, sorted({b for b, t, _ in runs if t == 1}), budget)
        timed = {(b, 1, False): figures for b, figures in one.items()}
    return {"layers": [dict(signature=signature, nodes=nodes, micro_batch=b, tp=t, sequence_parallel=sp, **figures)
                       for (b, t, sp), figures in timed.items() if figures["seconds"] > 0],
            "data_parallel": dp, "pipeline": pipeline}
