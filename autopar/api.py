"""The face: ``autopar.parallelize`` and ``autopar.plan``.

    program = autopar.parallelize(model, tp=2, pp=2, virtual_stages=2, microbatches=4,
                                  example_inputs=(x,), example_targets=y, loss_fn=F.cross_entropy)
    print(program.summary())        # mesh, layers per chunk, memory, collectives, fallbacks
    print(program.code(rank=1))     # the rank's generated code, collectives visible
    engine = program.materialize()  # inside a process group: local shards only
    loss = engine.train_step(x, y)  # the global batch

``parallelize`` runs the compile pipeline (``autopar/compiler/compile.py``);
the program it returns is frozen, and ``materialize`` hands it to the runtime.
Nothing here needs a process group except ``materialize``.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from autopar.compiler.compile import compile_program
from autopar.compiler.model_spec import spec_from_model
from autopar.compiler.program import Program
from autopar.compiler.trace import lm_cross_entropy
from autopar.core.config import ParallelConfig
from autopar.core.errors import AutoparError
from autopar.planning.cost.hardware import Hardware
from autopar.planning.cost.layout import Cluster, Layout
from autopar.planning.cost.op_times import measured_this_layer
from autopar.planning.search.planner import Plan, SearchSpace, search
from autopar.runtime.engine import RankEngine
from autopar.runtime.launch import launched_world
from autopar.runtime.engine.materialize import materialize
from passes.pipeline_split import PipelineError
from passes.sequence_parallel import SequenceParallelError
from passes.sharding import ShardingError

__all__ = ["parallelize", "plan", "ParallelProgram", "ParallelConfig", "lm_cross_entropy", "ShardingError",
           "PipelineError", "SequenceParallelError", "ArgumentError"]


class ArgumentError(AutoparError, ValueError):
    """A call of ``parallelize`` or ``plan`` missing what it needs; the message says what to pass."""


class ParallelProgram(Program):
    """A compiled program that can be run: ``materialize()`` builds this rank's engine."""

    def materialize(self, state_dict: dict[str, torch.Tensor] | None = None, checkpoint: str | Path | None = None,
                    seed: int | None = None) -> RankEngine:
        """Build this rank's engine: its mesh groups and the local shards of its chunks' parameters.

        Collective: every rank of the world calls it (the groups are created
        here). ``state_dict``: full weights to use instead of the model's (or
        only buffers a meta-device model cannot make). ``checkpoint``: a
        HuggingFace safetensors checkpoint (directory, ``model.safetensors``
        or its sharded index) read slice by slice, only this rank's. With
        neither, a model on the meta device is made by its own
        initialisation, seeded by ``seed`` (default: rank 0's
        ``torch.initial_seed()``): the same full weights for every layout, and
        as ``autopar.init_weights(model, seed)`` on one device.
        """
        return materialize(self, state_dict, checkpoint, seed)


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
    sequence_parallel: bool | None = False,
    loss_reduction: str = "tokens",
    compile: str | bool | None = None,
    overlap: bool | set[str] | None = None,
    ep: int = 1,
    expert_dispatch: str | None = None,
    expert_tp: int | None = None,
    cp: int = 1,
) -> ParallelProgram:
    """Compile ``model`` (with ``loss_fn``) into a tp x cp x pp x dp parallel program.

    ``example_inputs``/``example_targets``: one microbatch (it fixes the
    shapes). ``loss_fn(logits, *targets) -> scalar``; ``F.cross_entropy`` (the
    default) is applied language-model style: logits (..., V) and targets (...)
    are flattened. ``output_fn`` picks the logits from the model's output
    (default: a tensor, ``.logits``, or the first tensor of a tuple/dict).
    ``microbatches`` defaults to pp; ``schedule`` to 'interleaved' when
    ``virtual_stages`` > 1, else '1f1b'; the zero-bubble 'zb-h1' (one chunk per
    stage) and 'zbv' (``virtual_stages=2``, chunks in a V) split each backward
    into B and W (``docs/schedules.md``). Nothing runs and no process starts:
    bad input fails here.

    ``sequence_parallel``: run norms, dropout and residual adds between tensor-parallel regions on
    1/tp of the tokens (reduce-scatter and all-gather instead of all-reduces; ``docs/sequence-parallel.md``).
    None turns it on when tp > 1 and the tokens split t ways after every all-reduce; True asks for
    it (an error if tp = 1 or tp does not divide the token dim); False (the default) leaves it off:
    on CPU gloo ranks it measured slower (``bench/memory_features.py``).

    ``loss_reduction``: 'tokens' (the default) gives the one-device loss of the global batch when the
    loss is a mean cross-entropy / nll with an ignore_index: each microbatch's mean is weighted by its
    share of the counted targets (padding and masks included); 'microbatch' averages the microbatch
    means (``docs/training.md``).

    ``overlap``: what runs under compute. ``{'tp'}`` (with sequence parallelism) decomposes each
    all-gather of the tokens with the GEMMs reading it and each reduce-scatter with the GEMM writing
    it into tp ring steps (async tensor parallelism, ``passes/async_tp.py``); ``{'p2p'}`` posts each
    pipeline receive as early as the exchanges allow; True both where the layout has them; False
    neither, as None (the default): on CPU gloo ranks neither measured faster at the reference sizes
    (``bench/overlap.py``). The summary says what was overlapped, and what was left whole and why.

    ``compile``: each chunk's forward and backward compiled by ``torch.compile`` when the engine first
    runs it: True or 'inductor' (fused kernels), 'aot_eager' (the same graphs on eager kernels, eager's
    bits: for tests and debugging); the tensor- and sequence-parallel collectives stay inside the
    compiled graph. With the zero-bubble schedules the backward graph is split into B (input
    gradients) and W (weight gradients) before it is compiled. ``engine.compiled()`` reports each
    chunk's compile time and graphs; ``engine.compiled_code()`` Inductor's code.

    ``ep``: expert parallelism for a mixture-of-experts model. Its layers are found in the graph (a
    router's top-k, stacked expert weights applied by grouped matmuls); each rank of an expert group
    of ep data-parallel replicas (ep divides dp) holds E/ep whole experts, and the token rows travel
    to the rank holding their expert and back. ``expert_dispatch``: 'alltoall' (each rank sends only
    the rows its peers' experts take; the default) or 'allgather' (static shapes: every rank gathers
    the group's rows, the results are reduce-scattered; the default with ``compile``). Exact either way
    (``docs/experts.md``). ``expert_tp``: with tp > 1, each expert split tp ways like the dense MLPs
    (None, the default), or 1: each expert whole on the rank holding it, the tp ranks of a replica
    sharing its token rows, and the expert groups made of ep ranks of the stage's tp x dp (ep divides
    tp x dp: ep=tp needs no data parallelism).

    ``cp``: context parallelism. Every activation's sequence dim is split over cp ranks (S/cp tokens of
    each sequence on each, in the load-balanced layout under causal attention), attention exchanging
    keys and values around a ring of them (``docs/context-parallel.md``). The cp ranks hold the same
    weights and take the same rows of the batch, each its own tokens; gradients are averaged over the
    dp x cp ranks. The world is tp x cp x pp x dp ranks (dp inferred from the world as world /
    (tp x cp x pp)). Needs a token loss with ``loss_reduction='tokens'``; not combined with ep yet.
    """
    if example_inputs is None:
        raise ArgumentError("parallelize() needs example_inputs: one microbatch with the real shapes")
    if world_size is None:  # the world this process runs in: its group's, or the one a launcher started
        world_size = dist.get_world_size() if dist.is_initialized() else launched_world()
    config = ParallelConfig(
        tp=tp, pp=pp, virtual_stages=virtual_stages, microbatches=microbatches or pp,
        schedule=schedule or ("interleaved" if virtual_stages > 1 else "1f1b"), dp=dp, world_size=world_size,
        scatter_gather=scatter_gather, recompute=recompute, precision=precision,
        sequence_parallel=sequence_parallel, loss_reduction=loss_reduction, compile=compile, overlap=overlap,
        ep=ep, expert_dispatch=expert_dispatch, expert_tp=expert_tp, cp=cp)
    if loss_fn is None or loss_fn is F.cross_entropy:
        loss_fn = lm_cross_entropy
    return compile_program(model, config, example_inputs, example_targets, loss_fn, output_fn,
                           program_type=ParallelProgram)


def plan(model, example_inputs, gpus: int, global_batch: int, hardware: str | Hardware = "dgx-a100-80gb",
         space: SearchSpace | None = None, example_targets=None, loss_fn=None, top: int = 10,
         reference: Layout | None = None) -> Plan:
    """Plan for a user's model: its dimensions are read from its traced graph
    (``autopar.compiler.model_spec``; a model on the meta device costs no memory), then
    ``search`` ranks the layouts for ``gpus`` GPUs of ``hardware`` (a preset's name, the path of a
    profile ``autopar tune`` wrote, or a ``Hardware``) and a global batch
    of ``global_batch`` sequences of the example inputs' length. ``Plan.spec`` says
    what was read. Without ``space`` every layout is searched, with fused kernels (compiled chunks),
    or op by op (eager chunks) where the profile measured this model's own layer on them."""
    spec = spec_from_model(model, example_inputs, example_targets, loss_fn)
    cluster = Cluster.of(gpus, hardware, global_batch)
    if space is None:
        space = SearchSpace(fused_kernels=not measured_this_layer(spec, cluster.hardware))
    return search(spec, cluster, space, top=top, reference=reference)
