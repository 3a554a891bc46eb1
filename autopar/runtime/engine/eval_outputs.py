"""The logits of an evaluation step, whole, on the ranks that ask (``engine.eval_step(outputs=True)``).

The last chunk's evaluation graph returns, besides the loss, the value the
user's ``output_fn`` returned (tracing marks it; ``passes/eval_mode.py``
returns it). On a rank of the last chunk's stage that is one microbatch's
logits as this tensor-parallel rank holds them: split over the tp group as the
compiler placed them (the vocabulary-parallel head leaves them ``Shard(-1)``;
sequence parallelism may split the tokens). ``LogitsOutput.of(program)`` reads
that placement from the program (the sharding plan's decision for the node,
the sequence-parallel plan's split), checked against the node's local shape.

``gather_logits`` then makes them whole:

1. on the last stage, each microbatch's pieces all-gathered over the tp group
   along each split dim (padding beyond the global size dropped, e.g. a
   vocabulary padded to a multiple of t), and the microbatches concatenated
   along the logits' first dim, in order: this replica's rows;
2. with context parallelism (``program.context``, c > 1), this replica's rows
   all-gathered over the cp group and put back in global token order
   (``cp_unshard``) along the logits' sequence dim: the sequence dim of the
   first batch tensor the context names (the inputs first; ``input_ids``'
   dim 1 for a language model's (B, S, V) logits). The logits are assumed to
   keep that dim where the input has it, with this rank's S/c tokens there
   (checked against the graph's shapes; a logits tensor of another layout,
   e.g. flattened tokens, is refused naming the shapes);
3. sent point to point to each rank that asks, from the last-stage rank of the
   replica with the asker's tp index (and cp index: so the t x c ranks of the
   last stage share the sending); with the global batch the asker gets every replica's rows,
   concatenated in replica order (the global batch's row order), with this
   replica's own batch only its replica's.

Memory: the whole logits of a batch are rows x ... x V values (a batch of 8
sequences of 2048 tokens over a 50k vocabulary is 3.3 GB in fp32). Each asker
holds them; each last-stage rank of a replica some rank asks for holds that
replica's whole logits while sending, and its tp pieces until the end of the
step. Ask on the ranks that need them (``to=[0]``, ``to="last"``).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from autopar.core.comm import whole_from_shards
from autopar.core.comm.cp_layout import ContextSplit, cp_unshard
from autopar.core.graph import LOGITS_META, local_val, module_path, source_line
from autopar.core.tensor_placement import Replicate, Shard, local_size
from autopar.runtime.engine.errors import EngineRuntimeError, EngineUsageError

if TYPE_CHECKING:
    from autopar.compiler.program import Program

__all__ = ["LogitsOutput", "askers", "gather_logits"]

_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64, torch.int64, torch.int32, torch.bool)
"""The dtypes the logits can be sent in; the sender tells the askers which one (a header)."""


@dataclass(frozen=True)
class LogitsOutput:
    """The logits as the last chunk's evaluation graph returns them, and how they are split."""

    node: str
    """The node of the evaluation graph (the value ``output_fn`` returned)."""
    shape: tuple[int, ...]
    """Whole over tp, one microbatch (with context parallelism: this cp rank's S/c tokens)."""
    local_shape: tuple[int, ...]
    """On one tensor-parallel rank, one microbatch."""
    splits: tuple[Shard, ...]
    """The dims split over the tp group, each all-gathered back: the tensor-parallel placement
    (the vocabulary), then sequence parallelism's split of the tokens."""
    where: str
    """The node's module path and source line, for messages."""
    context: ContextSplit | None = None
    """With context parallelism: the split of the sequence, gathered back along ``sequence_dim``."""
    sequence_dim: int | None = None
    """The logits' dim holding the tokens split over the cp ranks (None without context parallelism)."""

    @property
    def global_shape(self) -> tuple[int, ...]:
        """One microbatch's logits whole: over tp and over cp (the whole sequence)."""
        if self.context is None:
            return self.shape
        dim = self.sequence_dim
        return self.shape[:dim] + (self.context.seq_len,) + self.shape[dim + 1:]

    @staticmethod
    def of(program: "Program") -> "LogitsOutput":
        """The program's logits, or ``ValueError`` saying why the evaluation graph cannot return them."""
        last = program.split.chunks[-1]
        if last.eval_gm is None:
            raise EngineUsageError("the program has no evaluation graphs (made at compile time by passes/eval_mode.py)")
        output = next(n for n in reversed(last.eval_gm.graph.nodes) if n.op == "output")
        if len(output.args[0]) < 2:
            return _missing(program, last.eval_gm)
        node = output.args[0][1]
        where = " ".join(filter(None, (f"module '{module_path(node)}'" if module_path(node) else "",
                                       source_line(node))))
        where = f"node {node.name}" + (f" ({where})" if where else "")
        decision = program.plan.decisions.get(node.name)
        placement = decision.out if decision is not None else Replicate()
        partial = decision is not None and decision.reduce_out  # a row-parallel output, before its g
        if partial or not isinstance(placement, (Replicate, Shard)):
            raise EngineUsageError(f"the logits ({where}) are {'a partial sum' if partial else placement} on each "
                                   f"tensor-parallel rank, not pieces of the whole value: evaluation outputs need them "
                                   f"replicated or split along a dim (tp=1 avoids the split)")
        sequence = program.sequence.split.get(node.name) if program.sequence is not None else None
        splits = tuple(p for p in (placement, sequence) if isinstance(p, Shard))
        shape = tuple(int(s) for s in node.meta["val"].shape)
        context, sequence_dim = _context_of(program), None
        if context is not None:
            sequence_dim, shape = _context_dim(program, context, shape, where)
        local = list(shape)
        for split in splits:
            local[split.dim] = local_size(shape[split.dim], split, program.config.tp)
        recorded = tuple(int(s) for s in local_val(node).shape)
        if tuple(local) != recorded:
            raise EngineUsageError(f"internal error: the logits ({where}) of shape {shape} split as {list(splits)} "
                                   f"over tp={program.config.tp} are {tuple(local)} on a rank, but the graph "
                                   f"records {recorded}; please report it with the model")
        if not shape:
            raise EngineUsageError(f"the logits ({where}) are a scalar: output_fn must return a tensor with a batch "
                                   f"dim (microbatches are concatenated along the first dim)")
        return LogitsOutput(node.name, shape, tuple(local), splits, where, context, sequence_dim)


def _context_of(program: "Program") -> ContextSplit | None:
    """The program's context split when it splits the sequence (c > 1)."""
    context = program.context
    return context if context is not None and context.cp > 1 else None


def _context_dim(program: "Program", context: ContextSplit, shape: tuple[int, ...], where: str
                 ) -> tuple[int, tuple[int, ...]]:
    """(the logits' sequence dim, their shape with this cp rank's S/c tokens there): the dim of the
    first batch tensor the context names (inputs before targets), which the logits are assumed to keep."""
    names = [n for n in program.traced.input_names + program.traced.target_names if n in context.seq_dims]
    local = context.seq_len // context.cp
    if names:
        dim = context.seq_dims[names[0]]
        dim = dim % len(shape) if -len(shape) <= dim < len(shape) else None
        if dim is not None and dim > 0 and shape[dim] in (local, context.seq_len):
            return dim, shape[:dim] + (local,) + shape[dim + 1:]
    raise EngineUsageError(f"the logits ({where}) of shape {shape} have no sequence dim where the batch's is "
                           f"({dict(context.seq_dims)}, {context.seq_len} tokens, {local} on each of cp={context.cp} "
                           f"ranks): eval_step(outputs=True) gathers them over the cp ranks along that dim. Fix: an "
                           f"output_fn returning (batch, sequence, ...) logits, or outputs=False")


def _missing(program: "Program", graph_module) -> LogitsOutput:
    """Why the last chunk's evaluation graph returns the loss alone, as an ``EngineUsageError``."""
    if program.traced.logits is None:
        raise EngineUsageError("the program has no logits to return: output_fn did not return a tensor when the "
                               "model was traced; pass output_fn=lambda out: <the logits tensor> to parallelize()")
    marked = [n.name for n in graph_module.graph.nodes if n.meta.get(LOGITS_META) and n.op != "output"]
    why = (f"{len(marked)} of its nodes carry the logits mark ({', '.join(marked)})" if marked else
           "none of its nodes carries the logits mark: a pass replaced the value by a new node")
    raise EngineUsageError(f"the last chunk's evaluation graph does not return the logits (the value output_fn "
                           f"returned, traced as node {program.traced.logits}): {why}; please report it with the model")


def askers(to: str | int | Iterable[int], world: int, last_stage: list[int]) -> tuple[int, ...]:
    """The global ranks ``to`` names: ``"all"``, ``"last"`` (the last chunk's stage), a rank or ranks.
    ``ValueError`` for anything else, before any work."""
    if to == "all":
        return tuple(range(world))
    if to == "last":
        return tuple(last_stage)
    ranks = [to] if isinstance(to, int) else list(to) if not isinstance(to, str) else None
    if ranks is None or not all(isinstance(r, int) and not isinstance(r, bool) for r in ranks):
        raise EngineUsageError(f"to={to!r}: expected 'all', 'last' (the ranks of the last pipeline stage), a global "
                               f"rank or a list of them")
    bad = sorted({r for r in ranks if not 0 <= r < world})
    if bad:
        raise EngineUsageError(f"to={to!r} names rank(s) {bad} outside the world of {world} ranks (0..{world - 1})")
    return tuple(sorted(set(ranks)))


def gather_logits(holdings, spec: LogitsOutput, pieces: dict[int, torch.Tensor],
                  ranks: tuple[int, ...], global_batch: bool) -> torch.Tensor | None:
    """The whole logits of the step on each rank of ``ranks``, None elsewhere (see the module's
    docstring). Collective over the world: every rank calls it with the same ``ranks``.
    ``holdings``: this rank's ``Holdings`` (its mesh, program, tp group, stage and device).

    ``pieces``: microbatch -> this rank's piece (last stage only, empty elsewhere).
    """
    mesh, program = holdings.mesh, holdings.program
    shape = mesh.shape
    last = program.stage_of_chunk(program.split.n - 1)
    me = mesh.rank

    def replicas_of(rank: int) -> list[int]:
        return list(range(shape.dp)) if global_batch else [shape.coords(rank)[1]]

    mine = None
    if holdings.stage == last and any(mesh.dp_rank in replicas_of(r) for r in ranks):
        mine = _whole_rows(holdings, spec, pieces)
        if spec.context is not None:  # every cp rank's tokens, in the sequence's order
            mine = _whole_sequence(holdings, spec, mine)
    sends = [r for r in ranks if r != me and mine is not None and mesh.dp_rank in replicas_of(r)
             and shape.coords(r)[2] == mesh.tp_rank and shape.cp_of(r) == mesh.cp_rank]
    sources = [] if me not in ranks else [shape.rank(last, d, mesh.tp_rank, mesh.cp_rank) for d in replicas_of(me)]
    receives = [s for s in sources if s != me]
    headers = _exchange([(r, torch.tensor([_DTYPES.index(mine.dtype)], device=holdings.device)) for r in sends],
                        [(s, torch.empty(1, dtype=torch.int64, device=holdings.device)) for s in receives])
    if me not in ranks or sources == [me]:
        _exchange([(r, mine) for r in sends], [])
        return mine if me in ranks else None
    # every replica's rows received straight into their place in the result (no second copy)
    rows = program.microbatches * spec.shape[0]
    dtype = mine.dtype if mine is not None else _DTYPES[int(headers[0])]
    out = torch.empty((len(sources) * rows, *spec.global_shape[1:]), dtype=dtype, device=holdings.device)
    place = {s: out.narrow(0, k * rows, rows) for k, s in enumerate(sources)}
    _exchange([(r, mine) for r in sends], [(s, place[s]) for s in receives])
    if me in place:
        place[me].copy_(mine)
    return out


def _whole_rows(holdings, spec: LogitsOutput, pieces: dict[int, torch.Tensor]) -> torch.Tensor:
    """This replica's logits, whole: each microbatch's pieces all-gathered over tp along each split
    dim into its rows of the result (the microbatches in order along the first dim)."""
    b, m = spec.shape[0], holdings.program.microbatches
    out = None
    for i in range(m):
        x = pieces[i]
        if tuple(x.shape) != spec.local_shape:
            raise EngineRuntimeError(f"the logits ({spec.where}) of microbatch {i} are {tuple(x.shape)} on this rank; "
                                     f"the program recorded {spec.local_shape}")
        for split in reversed(spec.splits):
            x = whole_from_shards(x, holdings.tp, split.dim, split.segments, spec.shape[split.dim])
        if out is None:
            out = torch.empty((m * b, *spec.shape[1:]), dtype=x.dtype, device=x.device)
        out.narrow(0, i * b, b).copy_(x)
    return out


def _whole_sequence(holdings, spec: LogitsOutput, mine: torch.Tensor) -> torch.Tensor:
    """This replica's logits over the whole sequence: every cp rank's tokens (``mine`` here)
    all-gathered over the cp group and put back in global order along the sequence dim."""
    pieces = [torch.empty_like(mine) for _ in range(spec.context.cp)]
    dist.all_gather(pieces, mine.contiguous(), group=holdings.mesh.groups["cp"])
    return cp_unshard(pieces, spec.sequence_dim, spec.context.cp, spec.context.balanced)


def _exchange(sends: list[tuple[int, torch.Tensor]], receives: list[tuple[int, torch.Tensor]]) -> list[torch.Tensor]:
    """Point-to-point sends and receives of one round, posted together; the received buffers."""
    ops = [dist.P2POp(dist.isend, t, peer) for peer, t in sends]
    ops += [dist.P2POp(dist.irecv, t, peer) for peer, t in receives]
    if ops:
        for work in dist.batch_isend_irecv(ops):
            work.wait()
    return [t for _, t in receives]
