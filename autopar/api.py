"""``autopar.parallelize``: from a model, an example microbatch and a loss to a program.

    program = autopar.parallelize(model, tp=2, example_inputs=(x,),
                                  example_targets=y, loss_fn=F.cross_entropy)
    print(program.summary())        # layout, sharded params, collectives, fallbacks
    print(program.code(rank=1))     # the rank's generated code, collectives visible
    engine = program.materialize()  # inside a process group: local shards only
    loss = engine.train_step(x, y)

Passes run in a fixed order: trace -> layers -> sharding analysis ->
tensor-parallel rewrite (with the vocabulary-parallel embedding and loss).
Nothing here needs a process group except ``materialize``.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
import torch.fx as fx
import torch.nn as nn
import torch.nn.functional as F

from autopar import comm
from autopar.comm import TPGroup, local_slice
from autopar.placement import Replicate, Shard, local_size
from autopar.runtime.engine import RankEngine
from autopar.trace import TracedModel, module_path, source_line, trace
from passes.layers import LayerInfo, find_layers, layer_of_param
from passes.sharding import ShardingError, ShardingPlan, analyze_sharding
from passes.tensor_parallel import apply_tensor_parallel

__all__ = ["parallelize", "ParallelProgram", "ParallelConfig", "lm_cross_entropy"]


def lm_cross_entropy(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Language-model loss: cross-entropy over the last dim of (..., V) logits."""
    return F.cross_entropy(logits.flatten(0, -2), targets.flatten())


@dataclass(frozen=True)
class ParallelConfig:
    tp: int = 1
    """Tensor-parallel degree t: each layer's matrices are split t ways."""
    world_size: int | None = None
    """Ranks that will run the program (checked against tp when known)."""

    def __post_init__(self):
        if self.tp < 1:
            raise ValueError(f"tp must be >= 1, got tp={self.tp}")
        if self.world_size is not None and (self.tp > self.world_size or self.world_size % self.tp):
            raise ValueError(
                f"tp={self.tp} does not fit a world of {self.world_size} ranks: tensor parallelism needs "
                f"tp <= world size and world size divisible by tp. Use tp in "
                f"{[d for d in range(1, self.world_size + 1) if self.world_size % d == 0]} or start more ranks."
            )


_COLLECTIVES = {
    comm.copy_to_tp: ("f (copy_to_tp)", "backward all-reduce"),
    comm.reduce_from_tp: ("g (reduce_from_tp)", "forward all-reduce"),
    comm.gather_from_tp: ("gather_from_tp", "forward all-gather"),
    comm.scatter_to_tp: ("scatter_to_tp", "backward all-gather"),
    comm.vocab_parallel_embedding: ("vocab_parallel_embedding", "forward all-reduce"),
    comm.vocab_parallel_cross_entropy: ("vocab_parallel_cross_entropy", "2 forward all-reduces of (N,) tensors"),
}


@dataclass
class ParallelProgram:
    """Everything autopar decided, for all ranks; cheap, inspectable, no process group."""

    model: nn.Module
    config: ParallelConfig
    traced: TracedModel
    layers: LayerInfo
    plan: ShardingPlan
    rank_module: fx.GraphModule
    param_names: list[str] = field(default_factory=list)

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
        shape = list(self.full_shape(name))
        spec = self.param_spec(name)
        if isinstance(spec, Shard):
            shape[spec.dim] = local_size(shape[spec.dim], spec, self.tp)
        return tuple(shape)

    def local_numel(self) -> int:
        return sum(math.prod(self.local_shape(n)) for n in self.param_names)

    def collectives(self, by_layer: bool = False) -> Counter:
        """Count the collective calls in the rank program (optionally keyed by layer)."""
        counts: Counter = Counter()
        for node in self.rank_module.graph.nodes:
            if node.op == "call_function" and node.target in _COLLECTIVES:
                name = node.target.__name__
                if by_layer:
                    counts[(self._layer_of_node(node), name)] += 1
                else:
                    counts[name] += 1
        return counts

    def _layer_of_node(self, node: fx.Node) -> int | None:
        path = module_path(node)
        prefix = self.layers.prefix
        if prefix and path.startswith(prefix + "."):
            head = path[len(prefix) + 1 :].split(".")[0]
            return int(head) if head.isdigit() else None
        return None

    def local_shapes(self, rank: int = 0) -> dict[str, tuple[int, ...]]:
        """Shape of every value of the rank program on one rank, by fake-tensor propagation.

        Runs without memory or communication (collectives of an inspection
        ``TPGroup`` only produce the right shapes), so it works for a
        meta-device model of any size.
        """
        from torch._subclasses.fake_tensor import FakeTensorMode
        from torch.fx.passes.fake_tensor_prop import FakeTensorProp

        mode = FakeTensorMode(allow_non_fake_inputs=True)
        args = [TPGroup(rank, self.tp, None)]
        feeds = {**{ph: self.traced.param_of[ph] for ph in self.traced.param_of}}
        for node in list(self.rank_module.graph.nodes)[1:]:
            if node.op != "placeholder":
                break
            val = node.meta["val"]
            shape = self.local_shape(feeds[node.name]) if node.name in feeds else tuple(val.shape)
            with mode:
                args.append(torch.empty(shape, dtype=val.dtype, device="meta" if val.device.type == "meta" else "cpu"))
        FakeTensorProp(self.rank_module, mode).propagate(*args)
        out = {}
        for node in self.rank_module.graph.nodes:
            val = node.meta.get("val")
            if isinstance(val, torch.Tensor):
                out[node.name] = tuple(val.shape)
        return out

    def fallbacks(self) -> list[tuple[str, str, str]]:
        """(node, reason, source line) of every op run replicated for want of a rule."""
        nodes = {n.name: n for n in self.traced.gm.graph.nodes}
        return [(name, self.plan.decisions[name].reason, source_line(nodes[name]))
                for name in self.plan.fallbacks]

    def code(self, rank: int = 0) -> str:
        """The generated program of one rank, with its shard ranges as a header."""
        if not 0 <= rank < self.tp:
            raise ValueError(f"rank {rank} is outside tp={self.tp} (ranks 0..{self.tp - 1})")
        lines = [f"# autopar rank program: tp rank {rank} of {self.tp}"]
        for name in self.param_names:
            spec = self.param_spec(name)
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
        return "\n".join(lines) + "\n" + self.rank_module.code

    def summary(self) -> str:
        """Human-readable plan: layout, sharded parameters, collectives, fallbacks."""
        from autopar.report import render_summary

        return render_summary(self)

    # ------------------------------------------------------------ materialize
    def materialize(self, tp_group: Any = None, state_dict: dict[str, torch.Tensor] | None = None) -> RankEngine:
        """Build this rank's engine with its local shards, inside a process group.

        ``tp_group``: the tensor-parallel process group (default: the whole
        world, which must then have exactly ``tp`` ranks). ``state_dict``: full
        weights to use instead of the model's (needed for a meta-device model).
        """
        full = self._full_weights(state_dict)
        if self.tp == 1 and tp_group is None:
            group = TPGroup(0, 1, None)
        else:
            if not dist.is_initialized():
                raise RuntimeError(f"materialize() for tp={self.tp} needs an initialised process group; "
                                   "start ranks with autopar.launch.spawn(...) or torchrun")
            pg = tp_group or dist.group.WORLD
            size = dist.get_world_size(pg)
            if size != self.tp:
                raise ValueError(f"the tensor-parallel group has {size} ranks but the program was compiled for "
                                 f"tp={self.tp}; pass tp_group= with {self.tp} ranks or compile with tp={size}")
            group = TPGroup(dist.get_rank(pg), size, pg)
        local = {}
        for name in self.param_names:
            spec = self.param_spec(name)
            w = full[name].detach()
            if isinstance(spec, Shard):
                w = local_slice(w, group.rank, self.tp, spec.dim, spec.segments)
            local[name] = w.clone().contiguous()
        buffers = self._replicated_inputs(state_dict)
        return RankEngine(self, group, local, buffers)

    def _full_weights(self, state_dict) -> dict[str, torch.Tensor]:
        if state_dict is not None:
            missing = [n for n in self.param_names if n not in state_dict]
            if missing:
                raise KeyError(f"state_dict lacks {len(missing)} parameter(s), e.g. {missing[:3]}")
            return state_dict
        params = dict(self.model.named_parameters())
        meta = [n for n in self.param_names if params[n].is_meta]
        if meta:
            raise ValueError(f"the model's parameters are on the meta device ({meta[0]}, ...): pass "
                             "materialize(state_dict=...) with real weights")
        return params

    def _replicated_inputs(self, state_dict) -> dict[str, torch.Tensor]:
        bufs = dict(self.model.named_buffers())
        out = {}
        for ph, name in self.traced.buffer_of.items():
            out[ph] = (state_dict or {}).get(name, bufs.get(name))
        for ph, name in self.traced.constant_of.items():
            out[ph] = self.traced.constants[name]
        return out

    def __post_init__(self):
        self._phs = {n.name: n for n in self.traced.gm.graph.nodes if n.op == "placeholder"}
        self._placeholder_of = {v: k for k, v in self.traced.param_of.items()}
        if not self.param_names:
            self.param_names = [self.traced.param_of[n.name] for n in self.traced.gm.graph.nodes
                                if n.name in self.traced.param_of]

    def layer_params(self, name: str) -> int | None:
        return layer_of_param(name, self.layers)


def parallelize(
    model: nn.Module,
    tp: int = 1,
    example_inputs: Any = None,
    example_targets: Any = None,
    loss_fn: Callable | None = None,
    output_fn: Callable | None = None,
    world_size: int | None = None,
) -> ParallelProgram:
    """Compile ``model`` (with ``loss_fn``) into a ``tp``-way tensor-parallel program.

    ``loss_fn(logits, *targets) -> scalar``. ``F.cross_entropy`` (the default)
    is applied language-model style: logits (..., V) and targets (...) are
    flattened. ``output_fn`` picks the logits from the model's output (default:
    a tensor, ``.logits``, or the first tensor of a tuple/dict).
    """
    if example_inputs is None:
        raise ValueError("parallelize() needs example_inputs: one microbatch with the real shapes")
    if world_size is None and dist.is_initialized():
        world_size = dist.get_world_size()
    config = ParallelConfig(tp=tp, world_size=world_size)
    if loss_fn is None or loss_fn is F.cross_entropy:
        loss_fn = lm_cross_entropy
    traced = trace(model, example_inputs, example_targets, loss_fn, output_fn)
    layers = find_layers(traced.gm)
    plan = analyze_sharding(traced, config.tp)
    rank_module = apply_tensor_parallel(traced, plan)
    return ParallelProgram(model, config, traced, layers, plan, rank_module)


__all__ += ["ShardingError"]
