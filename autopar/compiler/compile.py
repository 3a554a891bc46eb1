"""The compile pipeline: from a model, an example microbatch and a loss to a frozen ``Program``.

Named passes run in this order; each reads what the ones before produced and
none patches the program afterwards:

    trace                  (inputs, targets) -> loss as an fx graph      compiler/trace.py
    normalize              canonical forms (x @ W.T -> linear, ...)      passes/normalize.py
    find_layers            the repeated blocks, found once               passes/layers.py
    analyze_sharding       a placement for every value                   passes/sharding.py
    apply_tensor_parallel  the rank graph with f/g and vocab ops         passes/tensor_parallel.py
    annotate_local_shapes  one rank's shapes in meta["local_val"]        compiler/local_shapes.py
    context_parallel       with cp > 1: every layer on 1/cp of the       passes/context_parallel.py
                           tokens, attention around the ring; shapes again
    sequence_parallel      norms, dropout, residuals on 1/t of the tokens passes/sequence_parallel.py
                           (g -> reduce-scatter, f -> all-gather); shapes annotated again
    async_tp               with overlap 'tp': those collectives fused     passes/async_tp.py
                           with their GEMMs in ring steps; shapes again
    find_experts           the mixture-of-experts layers                 passes/experts.py
    expert_parallel        with ep > 1: E/ep experts per rank, the rows  passes/expert_parallel.py
                           sent to them and back; shapes again
    split_pipeline         p*v cost-balanced chunks                      passes/pipeline_split.py
    recompute              checkpointed regions in each chunk            passes/recompute.py
    eval_mode              each chunk's evaluation graph (no dropout)    passes/eval_mode.py
    schedule               training and forward-only (evaluation)        schedules/
                           schedules, generated, lowered (receives early
                           with overlap 'p2p'), validated

Nothing here needs a process group.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import torch
import torch.nn as nn

from autopar.compiler.batch_roles import BatchRoles, find_batch_roles
from autopar.compiler.local_shapes import annotate_local_shapes, param_local_shape
from autopar.compiler.program import Program
from autopar.compiler.trace_reuse import traced as trace_once
from autopar.core.chunks import PipelineSplit
from autopar.core.comm.cp_layout import ContextParallelError
from autopar.core.config import ParallelConfig
from autopar.core.gc_paused import gc_paused
from autopar.core.tensor_placement import Replicate
from autopar.schedules import Schedule, forward_only, generate, lower, receives_early, validate
from passes.async_tp import apply_async_tp, async_tp_refusal
from passes.context_parallel import apply_context_parallel, context_inputs
from passes.eval_mode import eval_graph
from passes.expert_parallel import apply_expert_parallel, expert_parallel_errors, expert_params
from passes.expert_lists import stack_expert_lists
from passes.experts import ExpertError, expert_candidates, find_experts
from passes.layers import LayerInfo, find_layers
from passes.normalize import normalize
from passes.pipeline_split import split_pipeline
from passes.recompute import with_recompute
from passes.sequence_parallel import apply_sequence_parallel
from passes.sharding import ShardingPlan, analyze_sharding
from passes.tensor_parallel import apply_tensor_parallel

__all__ = ["compile_program", "PASSES"]

PASSES: tuple[str, ...] = ("trace", "normalize", "stack_expert_lists", "find_layers", "analyze_sharding", "apply_tensor_parallel",
                           "annotate_local_shapes", "context_parallel", "sequence_parallel", "async_tp", "find_experts", "expert_parallel",
                           "split_pipeline", "recompute", "eval_mode", "schedule")
"""The pipeline's passes, in the order they run."""


def compile_program(model: nn.Module, config: ParallelConfig, example_inputs: Any, example_targets: Any,
                    loss_fn: Callable, output_fn: Callable | None = None,
                    program_type: type[Program] = Program) -> Program:
    """Run every pass over ``model`` with ``loss_fn`` for ``config``; the result is frozen."""
    traced = trace_once(model, example_inputs, example_targets, loss_fn, output_fn)
    with gc_paused():  # the passes build graphs and tables that live on in the program (gc_paused.py)
        normalize(traced.gm, set(traced.param_of))
        expert_lists = stack_expert_lists(traced, model)
        layers = find_layers(traced.gm)
        plan = analyze_sharding(traced, config.tp, _whole_experts(traced, config))
        rank_module = apply_tensor_parallel(traced, plan)
        local_shape = _param_local_shapes(traced, plan, config.tp).__getitem__
        annotate_local_shapes(rank_module, config.tp, traced.param_of, local_shape)
        roles = find_batch_roles(traced)
        _check_context_loss(config.cp, config.loss_reduction, roles)
        context = apply_context_parallel(rank_module, traced.param_of, [*traced.input_names, *traced.target_names],
                                         config.cp, type(model).__name__)
        inputs = {} if context is None else context_inputs(traced, rank_module, context.split)
        if context is not None:
            annotate_local_shapes(rank_module, config.tp, traced.param_of, local_shape, inputs)
        sequence = apply_sequence_parallel(rank_module, traced.param_of, plan.param_specs, config.tp,
                                           config.sequence_parallel)
        if sequence is not None:
            annotate_local_shapes(rank_module, config.tp, traced.param_of, local_shape, inputs)
        async_tp = None
        if async_tp_refusal(config, sequence is not None) is None:
            async_tp = apply_async_tp(rank_module)
            annotate_local_shapes(rank_module, config.tp, traced.param_of, local_shape, inputs)
        experts = find_experts(rank_module, traced.param_of)
        errs = expert_parallel_errors(experts, config.ep, type(model).__name__, expert_candidates(traced, expert_lists))
        if errs:
            raise ExpertError("\n".join(errs))
        expert_split = expert_params(experts, traced.param_of, config.ep)
        if expert_split:
            apply_expert_parallel(rank_module, experts, config.ep, config.expert_dispatch, config.mesh.rows_split)
            shapes = _param_local_shapes(traced, plan, config.tp)
            for name, _ in expert_split.items():
                shapes[name] = (shapes[name][0] // config.ep, *shapes[name][1:])
            annotate_local_shapes(rank_module, config.tp, traced.param_of, shapes.__getitem__, inputs)
        schedule, eval_schedule = _schedules(config)
        split = _split(traced, rank_module, config, layers, schedule.chunk_stages)
        param_names = tuple(traced.param_of[n.name] for n in traced.gm.graph.nodes if n.name in traced.param_of)
        param_stages = _param_stages(split, traced.param_of, schedule, param_names)
        shared = [(n, param_stages[n]) for n in expert_split if len(param_stages[n]) > 1]
        if shared:  # its gradient would be summed over stages and averaged over every replica, not its own
            name, stages = shared[0]
            raise ExpertError(f"ep={config.ep}: the stacked expert weight {name} is read by chunks on pipeline "
                              f"stages {list(stages)}: expert parallelism does not split expert weights shared "
                              f"across stages. Fix: use ep=1, or a pipeline cut (pp, virtual_stages) that keeps "
                              f"the layers sharing it on one stage")
        return program_type(
            model=model, config=config, traced=traced, layers=layers, plan=plan, rank_module=rank_module,
            split=split, schedule=schedule, eval_schedule=eval_schedule, param_names=param_names,
            param_stages=param_stages, tied_params={n: s for n, s in param_stages.items() if len(s) > 1},
            sequence=sequence, async_tp=async_tp, experts=tuple(experts), expert_params=expert_split,
            context=None if context is None else context.split, context_plan=context, batch_roles=roles)


def _check_context_loss(cp: int, loss_reduction: str, roles: BatchRoles) -> None:
    """Context parallelism computes the loss on each rank's tokens; the step's is the mean over every
    counted target, which needs a token-mean loss weighted by the counts ('tokens')."""
    if cp == 1:
        return
    if roles.loss is None:
        raise ContextParallelError(f"cp={cp} computes the loss on each rank's 1/cp of the tokens, and joins the "
                                   f"ranks' losses as a mean over every counted target: that needs a token-mean "
                                   f"loss (a mean-reduced cross-entropy or nll over the targets), and this loss is "
                                   f"not one ({roles.why_not_tokens}). Fix: such a loss, or cp=1")
    if loss_reduction != "tokens":
        raise ContextParallelError(f"cp={cp} joins the ranks' losses weighted by their counted targets, and "
                                   f"loss_reduction={loss_reduction!r} weighs microbatches equally without counting "
                                   f"them. Fix: loss_reduction='tokens' (the default), or cp=1")


def _whole_experts(traced, config: ParallelConfig) -> dict[str, str]:
    """With ``expert_tp=1`` under tensor parallelism: each expert grouped matmul -> why the sharding
    analysis leaves it whole ({} otherwise)."""
    if config.mesh.rows_split == 1:
        return {}
    return {g: f"expert_tp=1: the experts of {layer.module or 'the model'} stay whole on the ranks holding them "
               f"(the tp ranks share the token rows instead)"
            for layer in find_experts(traced.gm, traced.param_of) for g in layer.grouped}


def _param_local_shapes(traced, plan: ShardingPlan, tp: int) -> dict[str, tuple[int, ...]]:
    """Parameter name -> its shape on one tensor-parallel rank."""
    placeholders = {n.name: n for n in traced.gm.graph.nodes if n.op == "placeholder"}
    return {name: param_local_shape(tuple(placeholders[ph].meta["val"].shape),
                                    plan.param_specs.get(ph, Replicate()), tp)
            for ph, name in traced.param_of.items()}


def _split(traced, rank_module, config: ParallelConfig, layers: LayerInfo,
           chunk_stages: tuple[int, ...]) -> PipelineSplit:
    """The pipeline cut (balanced per stage under the schedule's placement ``chunk_stages``), then recomputation applied to each chunk (so ``program.code`` shows it),
    and each chunk's evaluation graph (no recomputation: an evaluation keeps nothing for a backward). Built with
    the cyclic garbage collector held off (``core/gc_paused.py``): the chunk graphs all live on, and a full
    collection would walk the whole heap to free nothing."""
    global_shapes = {n.name: tuple(n.meta["val"].shape) for n in traced.gm.graph.nodes
                     if isinstance(n.meta.get("val"), torch.Tensor)}
    with gc_paused():
        split = split_pipeline(rank_module, config.pp * config.virtual_stages, traced.param_of, global_shapes, layers,
                               chunk_stages)
        chunks = []
        for c in split.chunks:
            evaluation = eval_graph(c.gm, last=c.index == split.n - 1)  # the last one returns the logits too
            chunks.append(dataclasses.replace(c, module=with_recompute(c.gm, config.recompute, layers),
                                              eval_gm=evaluation.gm, eval_notes=evaluation.notes))
    return dataclasses.replace(split, chunks=chunks)


def _schedules(config: ParallelConfig) -> tuple[Schedule, Schedule]:
    """The lowered training schedule, and its forward-only form for evaluation steps (lowered the same way;
    with ``overlap`` 'p2p', each receive posted as early as the exchanges allow), each validated once,
    here: what is validated is what the program runs. Plain data without reference cycles, built with
    the cyclic garbage collector held off (``core/gc_paused.py``)."""
    with gc_paused():
        compute = generate(config.schedule, config.pp, config.virtual_stages, config.microbatches)
        schedule, eval_schedule = lower(compute, check=False), lower(forward_only(compute), check=False)
        if "p2p" in config.overlap:
            schedule, eval_schedule = receives_early(schedule), receives_early(eval_schedule)
        validate(schedule)
        validate(eval_schedule)
    return schedule, eval_schedule


def _param_stages(split: PipelineSplit, param_of: dict[str, str], schedule: Schedule,
                  param_names: tuple[str, ...]) -> dict[str, tuple[int, ...]]:
    """Parameter -> the pipeline stages whose chunks read it, under the schedule's chunk placement
    (stage 0 for one no chunk reads). A tied embedding and head on one stage (ZB-V's V puts the
    first and last chunks on stage 0) is held once there, not tied across stages."""
    stages: dict[str, set[int]] = {}
    for c in split.chunks:
        for ph in c.params:
            stages.setdefault(param_of[ph], set()).add(schedule.stage_of(c.index))
    return {n: tuple(sorted(stages.get(n, {0}))) for n in param_names}
