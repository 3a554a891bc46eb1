"""``autopar.parallelize``: from a model, an example microbatch and a loss to a program.

    program = autopar.parallelize(model, tp=2, pp=2, virtual_stages=2, microbatches=4,
                                  example_inputs=(x,), example_targets=y, loss_fn=F.cross_entropy)
    print(program.summary())        # mesh, layers per chunk, memory, collectives, fallbacks
    print(program.code(rank=1))     # the rank's generated code, collectives visible
    engine = program.materialize()  # inside a process group: local shards only
    loss = engine.train_step(x, y)  # the global batch

Passes run in a fixed order: trace -> normalize -> layers -> sharding analysis ->
tensor-parallel rewrite (with the vocabulary-parallel embedding and loss) ->
local shapes -> pipeline cut -> schedule (generated, lowered, validated).
Nothing here needs a process group except ``materialize``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from autopar.config import ParallelConfig
from autopar.program import ParallelProgram
from autopar.schedules import generate, lower, validate
from autopar.trace import trace
from passes.layers import find_layers
from passes.normalize import normalize
from passes.pipeline_split import PipelineError, split_pipeline
from passes.sharding import ShardingError, analyze_sharding
from passes.tensor_parallel import apply_tensor_parallel

__all__ = ["parallelize", "ParallelProgram", "ParallelConfig", "lm_cross_entropy", "ShardingError", "PipelineError"]


def lm_cross_entropy(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Language-model loss: cross-entropy over the last dim of (..., V) logits."""
    return F.cross_entropy(logits.flatten(0, -2), targets.flatten())


def parallelize(
    model: nn.Module,
    tp: int = 1,
    example_inputs: Any = None,
    example_targets: Any = None,
    loss_fn: Callable | None = None,
    output_fn: Callable | None = None,
    pp: int = 1,
    virtual_stages: int = 1,
    microbatches: int | None = None,
    schedule: str | None = None,
    dp: int | None = None,
    world_size: int | None = None,
    scatter_gather: bool = True,
    recompute: str = "none",
    precision: str = "fp32",
) -> ParallelProgram:
    """Compile ``model`` (with ``loss_fn``) into a tp x pp x dp parallel program.

    ``example_inputs``/``example_targets``: one microbatch (it fixes the
    shapes). ``loss_fn(logits, *targets) -> scalar``; ``F.cross_entropy`` (the
    default) is applied language-model style: logits (..., V) and targets (...)
    are flattened. ``output_fn`` picks the logits from the model's output
    (default: a tensor, ``.logits``, or the first tensor of a tuple/dict).
    ``microbatches`` defaults to pp; ``schedule`` to 'interleaved' when
    ``virtual_stages`` > 1, else '1f1b'. Nothing runs and no process starts:
    bad input fails here.
    """
    if example_inputs is None:
        raise ValueError("parallelize() needs example_inputs: one microbatch with the real shapes")
    if world_size is None and dist.is_initialized():
        world_size = dist.get_world_size()
    config = ParallelConfig(
        tp=tp, pp=pp, virtual_stages=virtual_stages, microbatches=microbatches or pp,
        schedule=schedule or ("interleaved" if virtual_stages > 1 else "1f1b"), dp=dp, world_size=world_size,
        scatter_gather=scatter_gather, recompute=recompute, precision=precision)
    if loss_fn is None or loss_fn is F.cross_entropy:
        loss_fn = lm_cross_entropy
    traced = trace(model, example_inputs, example_targets, loss_fn, output_fn)
    normalize(traced.gm, set(traced.param_of))
    layers = find_layers(traced.gm)
    plan = analyze_sharding(traced, config.tp)
    rank_module = apply_tensor_parallel(traced, plan)
    program = ParallelProgram(model, config, traced, layers, plan, rank_module)
    program.local_shapes()  # rank-local shapes on every node (boundary buffers, costs)
    n_chunks = config.pp * config.virtual_stages
    global_shapes = {n.name: tuple(n.meta["val"].shape) for n in traced.gm.graph.nodes
                     if isinstance(n.meta.get("val"), torch.Tensor)}
    program.split = split_pipeline(rank_module, n_chunks, traced.param_of, global_shapes)
    sched = lower(generate(config.schedule, config.pp, config.virtual_stages, config.microbatches))
    validate(sched)
    program.schedule = sched
    stages: dict[str, set[int]] = {}
    for c in program.split.chunks:
        for ph in c.params:
            stages.setdefault(traced.param_of[ph], set()).add(c.index % config.pp)
    program.param_stages = {n: tuple(sorted(stages.get(n, {0}))) for n in program.param_names}
    program.tied_params = {n: s for n, s in program.param_stages.items() if len(s) > 1}
    return program
