"""The ``autopar`` command line's parsers: ``plan``, ``simulate``, ``tune``, ``run`` and ``export``.

``build_parser`` is the whole command line; the flags that describe a model, a cluster and a
layout are shared by ``plan`` and ``simulate`` (``add_model_args``), the model's by ``tune`` too
(``add_model_flags``). The tables here map a
flag's words to what the planner takes (``RECOMPUTE_FLAG``, ``FEATURE_FLAG``) and name the
model features its dimensions do not say (``FEATURES``).
"""

from __future__ import annotations

import argparse
import os

from autopar.core.config import SCHEDULE_NAMES, Recompute
from autopar.planning.cost.hardware import PROFILES
from autopar.planning.cost.layout import PRICED_RECOMPUTE

__all__ = ["build_parser", "add_model_args", "add_model_flags", "hardware_name", "degrees", "FEATURES", "FEATURE_FLAG", "RECOMPUTE_FLAG"]

RECOMPUTE_FLAG: dict[str, tuple[Recompute, ...]] = {
    "layer": (Recompute.LAYER,),
    "full": (Recompute.LAYER,),  # Megatron's name for per-layer recomputation, kept as an alias
    "none": (Recompute.NONE,),
    "any": PRICED_RECOMPUTE,
}
"""``--recompute`` -> the recomputation modes the planner tries."""

FEATURE_FLAG: dict[str, tuple[bool, ...]] = {"off": (False,), "on": (True,), "search": (False, True)}
"""``--sequence-parallel`` / ``--distributed-optimizer`` -> the choices the planner tries."""

FEATURES = (
    ("fused-attention", True, "attention as one fused kernel (FlashAttention, sdpa) keeping no s x s scores"),
    ("dropout", False, "dropout after the embedding, on the attention and before each residual add"),
    ("tied-head", False, "the LM head uses the word embedding's table (GPT-2) instead of its own (Llama)"),
    ("learned-positions", False, "a learned position table (GPT-2) instead of rotary positions (Llama)"),
)
"""(flag, default for a model given by its dimensions, what it is): what the dimensions do not say
(``ModelSpec``'s fields of the same names); the defaults fit current models (Llama, Mistral, Qwen)."""


def degrees(text: str) -> tuple[int, ...]:
    """``4`` or ``1,2,4``: the degrees a flag names, each a positive integer."""
    try:
        values = tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        values = ()
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"expected positive integers separated by commas (4 or 1,2,4), got {text!r}")
    return tuple(dict.fromkeys(values))


def add_model_flags(ap: argparse.ArgumentParser) -> None:
    """The flags that describe a model (``model_args.model_spec`` reads them): ``plan``, ``simulate``, ``tune``."""
    g = ap.add_argument_group("model (a preset, a HuggingFace config, or dimensions)")
    g.add_argument("--model", help="preset: gpt-1.7b, gpt-3.6b, gpt-7.5b, gpt-18b, gpt-39b, gpt-76b, "
                                   "gpt-145b, gpt-310b, gpt-530b, gpt-1t")
    g.add_argument("--hf-config", help="a HuggingFace config.json (or its folder): the model is built on the "
                                       "meta device and its dimensions read from its traced graph "
                                       "(needs transformers; --seq-len sets the sequence, default 2048)")
    g.add_argument("--layers", type=int)
    g.add_argument("--hidden", type=int)
    g.add_argument("--heads", type=int)
    g.add_argument("--seq-len", type=int, default=None)
    g.add_argument("--vocab", type=int, default=None)
    g.add_argument("--ffn", type=int, default=None, help="MLP width (default 4 * hidden)")
    g.add_argument("--kv-heads", type=int, default=None, help="key/value heads (default: heads)")
    g.add_argument("--gated-mlp", action="store_true", help="SwiGLU MLP (three projections)")
    g.add_argument("--experts", type=int, default=None,
                   help="routed experts E of each mixture-of-experts layer (default: none, dense MLPs)")
    g.add_argument("--top-k", type=int, default=None, help="experts per token k (default 1)")
    g.add_argument("--expert-ffn", type=int, default=None, help="one expert's MLP width (default: --ffn)")
    g.add_argument("--shared-expert-ffn", type=int, default=None,
                   help="width of a shared expert every token goes through (default: none)")
    g.add_argument("--moe-every", type=int, default=None,
                   help="every n-th layer is mixture-of-experts (default 1: every layer)")
    for flag, default, what in FEATURES:
        g.add_argument(f"--{flag}", action=argparse.BooleanOptionalAction, default=None,
                       help=f"{what} (dimensions: default {'on' if default else 'off'}, as current models; "
                            f"--model: the preset's; --hf-config reads it from the model)")


def hardware_name(text: str) -> str:
    """``--hardware``: a preset's name, or the path of a JSON profile ``autopar tune`` wrote."""
    if text in PROFILES or text.endswith(".json") or os.path.isfile(text):
        return text
    raise argparse.ArgumentTypeError(f"{text!r} is neither a preset ({', '.join(sorted(PROFILES))}) nor a JSON "
                                     f"profile file; `autopar tune --out {text}.json` writes one")


def add_model_args(ap: argparse.ArgumentParser, required_cluster: bool = True) -> None:
    """The model, cluster and layout flags of ``plan`` and ``simulate``."""
    add_model_flags(ap)
    c = ap.add_argument_group("cluster")
    c.add_argument("--gpus", type=int, required=required_cluster)
    c.add_argument("--batch", type=int, required=required_cluster, help="global batch (sequences)")
    c.add_argument("--hardware", default="dgx-a100-80gb", type=hardware_name, metavar="PRESET|PROFILE.json",
                   help=f"a preset ({', '.join(sorted(PROFILES))}; default dgx-a100-80gb) or a hardware profile "
                        f"`autopar tune` measured on the machines in hand (docs/hardware-profile.md)")
    c.add_argument("--memory-headroom", type=float, default=None,
                   help="fraction of each GPU's HBM a layout may use (default: the profile's, 0.90); "
                        "lower it to keep a margin for fragmentation and buffers the model does not count")
    lay = ap.add_argument_group("layout (fix any of these to restrict the search)")
    lay.add_argument("--tp", type=int, help="tensor-parallel degree t")
    lay.add_argument("--pp", type=int, help="pipeline stages p")
    lay.add_argument("--vp", type=int, help="model chunks per stage v (interleaved when > 1)")
    lay.add_argument("--micro-batch", type=int, help="micro-batch size b")
    lay.add_argument("--schedule", choices=SCHEDULE_NAMES,
                     help="pipeline schedule (default: search 1f1b, interleaved and the zero-bubble 'zb-h1' "
                          "and 'zbv', v=2 in a V)")
    lay.add_argument("--recompute", choices=tuple(RECOMPUTE_FLAG), default="any",
                     help="activation recomputation: 'layer' keeps each layer's input and recomputes the layer "
                          "in the backward ('full' is an alias, Megatron's name), 'none' keeps every activation, "
                          "'any' tries both (default). The cost model does not price 'chunk'.")
    lay.add_argument("--dp-overlap", action="store_true",
                     help="overlap the gradient all-reduce with the backward (PyTorch DDP) in layouts without "
                          "a pipeline (Megatron-LM 2021 could not with one)")
    lay.add_argument("--dp-overlap-pipelined", action="store_true",
                     help="overlap it in pipelined layouts too (autopar's runtime can)")
    lay.add_argument("--no-scatter-gather", action="store_true")
    lay.add_argument("--uneven-layers", action="store_true", help="allow layers not divisible by p*v")
    lay.add_argument("--sequence-parallel", choices=tuple(FEATURE_FLAG), default="off",
                     help="sequence parallelism (norms, dropout, residual adds on s/t tokens; activations /t): "
                          "'off' (default, the paper's Megatron-LM 2021 had none), 'on', or 'search' both when t > 1")
    lay.add_argument("--distributed-optimizer", choices=tuple(FEATURE_FLAG), default="off",
                     help="distributed optimizer (optimizer state 12/d bytes per parameter, gradients "
                          "reduce-scattered, parameters all-gathered): 'off' (default, as in the paper), 'on', "
                          "or 'search' both when d > 1")
    lay.add_argument("--ep", type=int, help="expert-parallel degree (a divisor of d and of the experts; "
                                            "default: every one is searched for a mixture-of-experts model)")
    lay.add_argument("--cp", type=degrees, metavar="CP[,CP...]",
                     help="context-parallel degrees to try (the sequence split over cp ranks, attention as ring "
                          "attention), e.g. 4 or 1,2,4 (default: every one that cuts the sequence evenly when it "
                          "has at least 8192 tokens, else 1; 1 when --tp and --pp fix the layout)")
    lay.add_argument("--expert-dispatch", choices=("allgather", "alltoall", "search"), default="search",
                     help="how routed tokens reach their experts with ep > 1: 'allgather' (all-gather and "
                          "reduce-scatter of the expert group's rows), 'alltoall', or 'search' both (default)")
    lay.add_argument("--kernels", choices=("fused", "op-by-op"), default=None,
                     help="what the chunks run between the GEMMs: 'fused' element-wise kernels (Megatron's "
                          "fused kernels, autopar with compile=True) or 'op-by-op' (autopar's eager chunks: "
                          "each element-wise op its own pass). Default: 'op-by-op' with a --hardware profile in "
                          "which `autopar tune` measured this model's layer (on the eager chunks), else 'fused'")


def build_parser() -> argparse.ArgumentParser:
    """The whole command line: one subcommand per job."""
    ap = argparse.ArgumentParser(prog="autopar", description="3D-parallel training planner and tools.")
    sub = ap.add_subparsers(dest="command", required=True)
    plan = sub.add_parser("plan", help="rank layouts (t, p, d, v, micro-batch, schedule, recompute)")
    add_model_args(plan)
    plan.add_argument("--top", type=int, default=10, help="rows to show")
    plan.add_argument("--json", action="store_true", help="print JSON instead of tables")
    plan.add_argument("--explain", action="store_true", help="print the formulas and their values")
    vs = plan.add_argument_group("versus: a second layout, its terms beside the first's (compute, bubble, "
                                 "imbalance, tensor-parallel, pipeline and data-parallel communication, optimizer)")
    vs.add_argument("--vs-tp", type=int, help="the other layout's t (default: the first's restriction)")
    vs.add_argument("--vs-pp", type=int, help="the other layout's p")
    vs.add_argument("--vs-vp", type=int, help="the other layout's v")
    vs.add_argument("--vs-micro-batch", type=int, help="the other layout's micro-batch")
    sim = sub.add_parser("simulate", help="simulate a pipeline step and draw its timeline")
    add_model_args(sim, required_cluster=False)
    sim.add_argument("--microbatches", type=int, help="m, for unit-cost simulation without a model")
    sim.add_argument("--svg", default="autopar-timeline.svg", help="SVG output path ('' for none)")
    sim.add_argument("--width", type=int, default=0, help="terminal columns for the timeline")
    sim.add_argument("--svg-width", type=int, default=0,
                     help="SVG width in pixels (default: about 34 px per action of the busiest stage)")
    sim.add_argument("--eager", action="store_true",
                     help="draw the planner's model (compute-only schedule, eager blocking sends, as "
                          "Megatron-LM) instead of the lowered schedule autopar's runtime runs")
    sim.add_argument("--measured", "--from-trace", metavar="TRACE", dest="measured",
                     help="a trace engine.write_trace(path, steps=k) wrote: simulate its schedule with the run's "
                          "per-action costs; --svg draws measured above predicted; see --trace-out")
    sim.add_argument("--trace-out", default=None,
                     help="with --measured: a Perfetto trace of the measured steps and the prediction "
                          "(default: TRACE with -vs-predicted.json)")
    run = sub.add_parser("run", help="start N local ranks of a training script (torchrun-style)")
    run.add_argument("--nproc", type=int, required=True, help="number of ranks")
    run.add_argument("--timeout", type=float, default=None, help="stop all ranks after this many seconds")
    run.add_argument("--max-restarts", type=int, default=0,
                     help="when a rank fails, stop the others and start all ranks again, up to this many times "
                          "(TORCHELASTIC_RESTART_COUNT counts the restarts, as under torchrun)")
    run.add_argument("script")
    run.add_argument("script_args", nargs=argparse.REMAINDER)
    tune = sub.add_parser("tune", help="measure the machines in hand: a hardware profile for plan and simulate")
    add_model_flags(tune)
    tune.add_argument("--micro-batch", type=int, default=1, help="sequences per microbatch of the GEMMs timed (default 1)")
    tune.add_argument("--tp", type=degrees, metavar="T[,T...]",
                      help="tensor-parallel degrees whose GEMM shapes to time (default: every divisor of the "
                           "ranks on a node)")
    tune.add_argument("--dtypes", default=None, metavar="DTYPE[,DTYPE...]",
                      help="GEMM dtypes to time: fp32, bf16, fp16 (default: fp32,bf16, those the device runs)")
    tune.add_argument("--nproc", type=int, default=None,
                      help="start this many local ranks (as `autopar run` does) to time collectives; without it "
                           "the ranks are the launch's (torchrun -m autopar.cli tune), or one process")
    tune.add_argument("--quick", action="store_true", help="fewer sizes and repeats (a few seconds; a coarser fit)")
    tune.add_argument("--compiled", action="store_true",
                      help="also time a call of a tiny compiled function (compiles one: seconds more)")
    tune.add_argument("--out", default="autopar-hardware.json", help="the profile to write (rank 0)")
    exp = sub.add_parser("export", help="convert a saved autopar checkpoint to a HuggingFace directory")
    exp.add_argument("checkpoint", help="a checkpoint root (the step its 'latest' file names) or one step directory")
    exp.add_argument("--to-hf", required=True, metavar="DIR",
                     help="the directory to write: safetensors, their index, config.json (from_pretrained loads it)")
    exp.add_argument("--max-shard-size", default="5GB",
                     help="largest weight file, e.g. 5GB, 500MB, 2GiB or bytes (a larger tensor gets a file alone)")
    return ap
