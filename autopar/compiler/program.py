"""``Program``: everything autopar decided, for all ranks.

Cheap and inspectable without a process group: the traced graph, the
sharding plan, the rank graph and its chunks (and their evaluation graphs),
the training schedule and its forward-only form, and the questions
a user asks of them (``summary``, ``code``, ``local_shapes``,
``collectives``, ...). ``materialize`` builds one rank's engine.
"""

from __future__ import annotations

import math
import operator
from collections import Counter
from dataclasses import dataclass, field

import torch
import torch.fx as fx
import torch.nn as nn

from autopar.compiler.batch_roles import BatchRoles, find_batch_roles
from autopar.compiler.local_shapes import param_local_shape, propagate_local_shapes
from autopar.compiler.report import render_summary
from autopar.compiler.tp_traffic import tp_traffic
from autopar.core.activation_recompute import Checkpointed
from autopar.core.chunks import PipelineSplit
from autopar.core.collectives import collective_of
from autopar.core.comm.cp_layout import ContextSplit
from passes.experts import ExpertLayer
from autopar.compiler.context_report import ring_bytes
from passes.context_parallel import ContextPlan, context_inputs
from autopar.core.config import ParallelConfig
from autopar.core.errors import AutoparError
from autopar.core.flops import node_bytes
from autopar.core.graph import TracedModel, module_path, source_line
from autopar.core.tensor_placement import Replicate, Shard
from autopar.planning.cost.hardware import Hardware
from autopar.schedules import Schedule
from passes.async_tp import AsyncTPPlan
from passes.layers import LayerInfo, layer_of_node, layer_of_param
from passes.sequence_parallel import SequenceParallelPlan
from passes.sharding import ShardingPlan

__all__ = ["Program", "ProgramError"]


class ProgramError(AutoparError, ValueError):
    """A question the program cannot answer: a rank outside its mesh, a chunk on another stage."""

_aten = torch.ops.aten
# ops whose output shares its input's storage: not counted as activation memory
_VIEWS = {_aten.view.default, _aten._unsafe_view.default, _aten.transpose.int, _aten.permute.default,
          _aten.expand.default, _aten.t.default, _aten.unsqueeze.default, _aten.alias.default,
          _aten.squeeze.dim, _aten.reshape.default, _aten.split.Tensor, _aten.slice.Tensor, _aten.select.int,
          operator.getitem}

_CONTRACTIONS = {"mm", "bmm", "matmul", "addmm", "baddbmm", "linear", "einsum", "convolution", "conv1d", "conv2d",
                 "conv3d", "conv_transpose1d", "conv_transpose2d", "conv_transpose3d", "_grouped_mm", "tensordot"}


def _contracts(node: fx.Node) -> bool:
    """A matmul-like or convolution op, or one of another library (its weights are its business)."""
    target = node.target
    if not isinstance(target, torch._ops.OpOverload):
        return True
    return target.namespace != "aten" or target._schema.name.split("::")[-1] in _CONTRACTIONS


def _module_code(module: nn.Module) -> str:
    """The code a chunk runs: its graph, or with recomputation the graph that calls its
    checkpointed regions, each region's code below it, marked."""
    if isinstance(module, Checkpointed):
        return f"\n# checkpointed ({module.label}): recomputed in the backward{_module_code(module.inner)}"
    if not isinstance(module, fx.GraphModule):
        return f"\n# {type(module).__name__}\n"
    text = module.code
    for name, child in module.named_children():
        if isinstance(child, (Checkpointed, fx.GraphModule)):
            inner = _module_code(child).replace("\n", "\n    ")
            text += f"\n    # self.{name}:{inner}"
    return text


def _eval_code(chunk) -> str:
    """A chunk's evaluation graph, what changed from its training graph listed above it."""
    changes = chunk.eval_notes or ("nothing: the chunk has no training-mode behaviour",)
    header = "".join(f"\n# eval: {line}" for line in changes)
    return f"{header}{chunk.eval_gm.code}"


@dataclass(frozen=True, eq=False)
class Program:
    """Everything autopar decided, for all ranks; built whole by ``compile_program``, then frozen.

    Cheap and inspectable without a process group. The runtime only reads it.
    """

    model: nn.Module
    config: ParallelConfig
    traced: TracedModel
    """The traced graph (global shapes in ``meta["val"]``)."""
    layers: LayerInfo
    """Which nodes belong to which repeated block, found once on the traced graph."""
    plan: ShardingPlan
    rank_module: fx.GraphModule
    """The tensor-parallel rank graph; one rank's shapes in ``meta["local_val"]``."""
    split: PipelineSplit
    """The chunk graphs (p*v of them; one when pp == 1), recomputation applied."""
    schedule: Schedule
    """The lowered, validated schedule every rank interprets in a training step."""
    eval_schedule: Schedule
    """Its forward-only form (``schedules.forward_only``), lowered and validated: an evaluation step."""
    param_names: tuple[str, ...]
    """Every parameter, in graph order (canonical names)."""
    param_stages: dict[str, tuple[int, ...]]
    """Parameter -> the pipeline stages whose chunks read it."""
    tied_params: dict[str, tuple[int, ...]]
    """Parameters read on more than one stage -> those stages."""
    sequence: SequenceParallelPlan | None = None
    """What runs split along the tokens (sequence parallelism); None when it is off."""
    async_tp: AsyncTPPlan | None = None
    """Which sequence-parallel collectives were fused with their GEMMs (``overlap`` 'tp'); None when the
    pass did not run (``passes.async_tp.async_tp_refusal`` says why)."""
    experts: tuple[ExpertLayer, ...] = ()
    """The mixture-of-experts layers found in the graph (``passes/experts.py``), split or not."""
    expert_params: dict[str, int] = field(default_factory=dict)
    """With expert parallelism (ep > 1): each stacked expert weight -> its expert count E; this rank holds
    experts ``expert_range(name, ep_rank)`` of it (its first dim cut ep ways), tp's split inside."""
    context: ContextSplit | None = None
    """With context parallelism (cp > 1): how the sequence is split over the cp ranks, and which batch
    tensors carry it (``passes/context_parallel.py``); None otherwise."""
    context_plan: ContextPlan | None = None
    """What the context-parallel pass rewrote (its attentions, the values cut to the rank's positions)."""
    batch_roles: BatchRoles | None = field(default=None)
    """What the batch tensors are to the traced graph: ids and the tables they index, the token-mean
    loss (``compiler/batch_roles.py``); read from the traced graph when the program is built."""

    @property
    def pp(self) -> int:
        return self.config.pp

    def stage_of_chunk(self, chunk: int) -> int:
        """The pipeline stage that holds chunk ``chunk``: the schedule's placement (``c % pp``
        interleaved; ZB-V's V: ``c`` for ``c < pp``, ``2 pp - 1 - c`` after). The one answer every
        reader of a chunk's stage asks (the engine, the summary, weight loading, export)."""
        return self.schedule.stage_of(chunk)

    def chunks_of_stage(self, stage: int) -> list:
        """The chunks pipeline stage ``stage`` holds, in model order."""
        return [c for c in self.split.chunks if self.stage_of_chunk(c.index) == stage]

    @property
    def microbatches(self) -> int:
        return self.config.microbatches

    @property
    def recompute(self) -> str:
        return self.config.recompute

    @property
    def precision(self) -> str:
        return self.config.precision

    def param_dtype_bytes(self, name: str) -> int:
        return self._phs[self._placeholder_of[name]].meta["val"].element_size()

    def chunk_activation_bytes(self, chunk) -> tuple[float, float]:
        """(kept per microbatch, working set) in bytes for one forward of ``chunk`` (an estimate).

        Kept between a microbatch's forward and its backward: every value the
        chunk computes (views excluded) without recomputation; its input with
        'chunk'; each layer's input with 'layer'. The working set is what one
        recomputation materialises at a time (the chunk, or one layer). Float
        values count 2 bytes per element under bf16 autocast.
        """
        scale = 0.5 if self.precision == "bf16" else 1.0
        values = [n for n in chunk.gm.graph.nodes if n.op == "call_function" and n.target not in _VIEWS]
        total = scale * sum(node_bytes(n) for n in values)
        inputs = sum(b.nbytes for b in chunk.inputs)
        layer_input = max([b.nbytes for b in chunk.inputs + chunk.outputs], default=0) * scale
        n_layers = max(len(chunk.layers), 1)
        if self.recompute == "none":
            return inputs + total, 0.0
        if self.recompute == "chunk":
            return inputs, total
        return inputs + layer_input * (n_layers - 1), total / n_layers

    def tp_communication(self, stage: int) -> dict[tuple[str, str], tuple[int, int]]:
        """What one rank of pipeline stage ``stage`` moves over its tensor-parallel group per step, by
        (where, what): (calls per microbatch, bytes per step). Its own chunks only, recomputation's
        replays and the boundary all-gathers included (``autopar/compiler/tp_traffic.py``)."""
        return tp_traffic(self, stage)

    def sent_sliced(self, b) -> bool:
        """A boundary value sent as 1/t slices and all-gathered on arrival (scatter/gather)."""
        return self.config.scatter_gather and self.tp > 1 and b.replicated and b.numel % self.tp == 0

    def p2p_and_dp_bytes(self) -> dict[tuple[str, str, str], float]:
        """Bytes per step of pipeline point-to-point (per boundary) and data-parallel gradient reduction."""
        out: dict[tuple[str, str, str], float] = {}
        t, m = self.tp, self.microbatches
        sg = self.config.scatter_gather and t > 1
        for c in self.split.chunks[1:]:
            fwd = sum(b.nbytes / (t if self.sent_sliced(b) else 1) for b in c.inputs)
            bwd = sum(b.nbytes / (t if self.sent_sliced(b) else 1) for b in c.inputs if b.requires_grad)
            if self.stage_of_chunk(c.index - 1) != self.stage_of_chunk(c.index):  # a message, not a handover
                label = f"chunk {c.index - 1} -> {c.index}"
                out[(label, "p2p send", "activation fwd, gradient bwd" + (", 1/t each" if sg else ""))] = (fwd + bwd) * m
        if self.config.data_parallel * self.config.cp > 1:  # the cp ranks average their gradients with dp
            d = self.config.data_parallel * self.config.cp
            stage_bytes = max(sum(math.prod(self.local_shape(n)) * 4 for n in self.param_names
                                  if s in self.param_stages.get(n, ()) and n not in self.expert_params)
                              for s in range(self.pp))
            axis, over = ("dp", "d") if self.config.cp == 1 else ("dp x cp", "d*cp")
            out[(axis, "all-reduce grads", f"ring over {over}={d}: 2(d-1)/d of {stage_bytes / 2**20:.1f} MiB")] = \
                2 * (d - 1) / d * stage_bytes
        if self.context_plan is not None:
            ring = ring_bytes(self)
            out[("cp", "ring attention", f"K, V around {self.config.cp} ranks, fwd and bwd, every layer")] = \
                (ring["forward"] + ring["backward"]) * m
            e = d // self.ep
            if self.expert_params and e > 1:  # each expert's gradient over the d/ep replicas holding it
                expert_bytes = max(sum(math.prod(self.local_shape(n)) * 4 for n in self.expert_params
                                       if s in self.param_stages.get(n, ())) for s in range(self.pp))
                out[("edp", "all-reduce expert grads", f"ring over d/ep={e}: 2(e-1)/e of "
                     f"{expert_bytes / 2**20:.1f} MiB")] = 2 * (e - 1) / e * expert_bytes
        return out

    # ------------------------------------------------------------ introspection
    @property
    def tp(self) -> int:
        return self.config.tp

    def param_spec(self, name: str) -> Replicate | Shard:
        ph = self._placeholder_of[name]
        return self.plan.param_specs.get(ph, Replicate())

    def full_shape(self, name: str) -> tuple[int, ...]:
        return tuple(self._phs[self._placeholder_of[name]].meta["val"].shape)

    def local_shape(self, name: str) -> tuple[int, ...]:
        shape = param_local_shape(self.full_shape(name), self.param_spec(name), self.tp)
        if name in self.expert_params:
            shape = (shape[0] // self.ep, *shape[1:])
        return shape

    @property
    def ep(self) -> int:
        return self.config.ep

    def expert_range(self, name: str, ep_rank: int) -> tuple[int, int] | None:
        """(first expert, experts) of parameter ``name`` held by expert-parallel rank ``ep_rank``
        (slice its first dim by these, then apply its tp split), or None for any other parameter."""
        experts = self.expert_params.get(name)
        if experts is None:
            return None
        per = experts // self.ep
        return ep_rank * per, per

    def collectives(self, by_layer: bool = False) -> Counter:
        """Count the collective calls in the rank program (optionally keyed by layer)."""
        counts: Counter = Counter()
        for node in self.rank_module.graph.nodes:
            if node.op == "call_function" and collective_of(node.target) is not None:
                name = node.target.__name__
                if by_layer:
                    counts[(self._layer_of_node(node), name)] += 1
                else:
                    counts[name] += 1
        return counts

    def _layer_of_node(self, node: fx.Node) -> int | None:
        return layer_of_node(node, self.layers)

    def local_shapes(self, rank: int = 0) -> dict[str, tuple[int, ...]]:
        """Shape of every value of the rank program on tensor-parallel rank ``rank``.

        Fake-tensor propagation: no memory, no communication, no change to the
        graph's metadata; works for a meta-device model of any size.
        """
        inputs = {} if self.context is None else context_inputs(self.traced, self.rank_module, self.context)
        vals = propagate_local_shapes(self.rank_module, rank % self.tp, self.tp, self.traced.param_of,
                                      self.local_shape, inputs)
        return {name: tuple(v.shape) for name, v in vals.items() if isinstance(v, torch.Tensor)}

    def replicated_weights(self) -> list[tuple[str, int, str]]:
        """(parameter, elements, why) of every matrix (2-D or more) left whole on each tp
        rank that no rejected linear already explains, other than tables looked up by id: the
        op that reads it, past views and transposes, with its source line. Empty when tp = 1 or
        everything is split."""
        if self.tp == 1:
            return []
        explained = {r.node for r in self.plan.rejected}
        passthrough = {torch.ops.aten.t.default, torch.ops.aten.numpy_T.default, torch.ops.aten.transpose.int,
                       torch.ops.aten.permute.default, torch.ops.aten.view.default, torch.ops.aten.reshape.default,
                       torch.ops.aten.select.int, torch.ops.aten.expand.default, torch.ops.aten._to_copy.default,
                       torch.ops.aten.to.dtype, torch.ops.aten.alias.default, torch.ops.aten.detach.default,
                       torch.ops.aten.unsqueeze.default, torch.ops.aten.squeeze.dim}
        out = []
        for ph, name in self.traced.param_of.items():
            node = self._phs[ph]
            if len(node.meta["val"].shape) < 2 or not isinstance(self.param_spec(name), Replicate):
                continue
            readers, frontier = [], list(node.users)
            while frontier:
                u = frontier.pop(0)
                if u.op == "call_function" and u.target in passthrough:
                    frontier.extend(u.users)
                elif u.op != "output":
                    readers.append(u)
            # tables looked up by id and parameters used element-wise (position embeddings, a
            # learned positional tensor) stay whole by design, as in Megatron: only weights that a
            # contraction reads (a matmul, a convolution, an op of another library) are reported
            if not readers or any(r.name in explained or r.target == torch.ops.aten.embedding.default
                                  for r in readers):
                continue
            if not any(_contracts(r) for r in readers):
                continue
            first = readers[0]
            where = source_line(first)
            target = getattr(first.target, "__name__", str(first.target))
            why = f"read by {target} at {where or module_path(first)}, which no sharding rule splits by its weight"
            out.append((name, math.prod(node.meta["val"].shape), why))
        return out

    def fallbacks(self) -> list[tuple[str, str, str]]:
        """(node, reason, source line) of every op run replicated for want of a rule."""
        nodes = {n.name: n for n in self.traced.gm.graph.nodes}
        return [(name, self.plan.decisions[name].reason, source_line(nodes[name]))
                for name in self.plan.fallbacks]

    def code(self, rank: int = 0, chunk: int | None = None, eval: bool = False) -> str:
        """The generated program of one rank (its chunks, or one of them), shard ranges as a header.

        ``eval=True``: the graphs an evaluation step runs (``engine.eval_step``), each chunk's
        changes from its training graph listed above it."""
        shape = self.config.mesh
        if not 0 <= rank < shape.world:
            raise ProgramError(f"rank {rank} is outside the mesh of {shape.world} ranks (tp={shape.tp}, "
                             f"pp={shape.pp}, dp={shape.dp})")
        stage, dp_rank, tp_rank = shape.coords(rank)
        chunks = self.chunks_of_stage(stage)
        if chunk is not None:
            if self.stage_of_chunk(chunk) != stage:
                raise ProgramError(f"chunk {chunk} lives on stage {self.stage_of_chunk(chunk)}, not on rank {rank}'s "
                                 f"stage {stage}")
            chunks = [c for c in chunks if c.index == chunk]
        lines = [f"# autopar rank program: rank {rank} = (pp {stage}, dp {dp_rank}, tp {tp_rank}); "
                 f"chunks {[c.index for c in chunks]}; shards (each chunk's later layers alike):"]
        rank = tp_rank
        used = {self.traced.param_of[p] for c in chunks for p in c.params}
        kinds = self.layers.kinds
        first_layers = {i for c in chunks for i in c.layers  # the first layer of each kind in each chunk
                        if not kinds or all(kinds[j] != kinds[i] for j in c.layers if j < i)}
        for name in self.param_names:
            layer = self.layer_params(name)
            if name not in used or (layer is not None and layer not in first_layers):
                continue  # later layers of a chunk are split like its first
            spec = self.param_spec(name)
            experts = self.expert_range(name, dp_rank % self.ep)
            if experts is not None:
                first, count = experts
                lines.append(f"#   {name}: experts [{first}:{first + count}) of {self.full_shape(name)[0]} "
                             f"(ep rank {dp_rank % self.ep})" + ("" if isinstance(spec, Shard) else
                                                                 f" -> local {list(self.local_shape(name))}"))
            if isinstance(spec, Shard):
                full = self.full_shape(name)
                segs = spec.segments or (full[spec.dim],)
                ranges, start = [], 0
                for s in segs:
                    n = s // self.tp
                    ranges.append(f"[{start + rank * n}:{start + (rank + 1) * n})")
                    start += s
                lines.append(f"#   {name}: dim {spec.dim} rows {' + '.join(ranges)} of {full[spec.dim]}"
                             f"{' (padded to ' + str(sum(segs)) + ')' if sum(segs) != full[spec.dim] else ''}"
                             f" -> local {list(self.local_shape(name))}")
        body = []
        for c in chunks:
            layers = f"layers {c.layers[0]}-{c.layers[-1]}" if c.layers else "no layers"
            if eval:
                body.append(f"# ---- chunk {c.index} ({layers}), evaluation ----{_eval_code(c)}")
            else:
                body.append(f"# ---- chunk {c.index} ({layers}) ----{_module_code(c.module)}")
        return "\n".join(lines) + "\n" + "\n".join(body)

    def summary(self, hardware: str | Hardware | None = None, distributed_optimizer: bool = False) -> str:
        """Human-readable plan: layout, sharded parameters, collectives, fallbacks; with ``hardware`` (a
        preset's name, the path of a profile ``autopar tune`` wrote, or a ``Hardware``) also the step the
        cost model predicts for this program there, where it goes and its memory per rank
        (``predicted_cost``; ``distributed_optimizer``: priced with the ranks' distributed optimizer)."""
        return render_summary(self, hardware=hardware, distributed_optimizer=distributed_optimizer)

    def __post_init__(self):
        if self.batch_roles is None:
            object.__setattr__(self, "batch_roles", find_batch_roles(self.traced))
        object.__setattr__(self, "_phs", {n.name: n for n in self.traced.gm.graph.nodes if n.op == "placeholder"})
        object.__setattr__(self, "_placeholder_of", {v: k for k, v in self.traced.param_of.items()})

    def layer_params(self, name: str) -> int | None:
        """The layer holding parameter ``name`` (None: outside the layers); looked up once per name, as
        ``code`` asks it for every parameter of every rank."""
        found = self.__dict__.setdefault("_layer_of_param", {})
        if name not in found:
            found[name] = layer_of_param(name, self.layers)
        return found[name]
