"""A GPT on one GPU as lists of kernels: one transformer layer, the embedding and the LM head
(Megatron-LM as in the paper, 2021), and the FLOPs of an iteration.

``layer_ops(spec, b, t)`` lists the kernels of one layer on one of t
tensor-parallel GPUs for micro-batch b: fused softmax, materialised attention
scores, LayerNorm and dropout replicated on the t ranks, the two all-reduces
of g in the forward and of f in the backward. With ``sequence_parallel`` the
LayerNorms, dropouts and residual adds work on s/t tokens per rank and each
all-reduce becomes a reduce-scatter plus an all-gather of the same tensor (the
same bytes on the wire: an all-reduce is those two halves). ``embedding_ops`` (stage 0) and ``head_ops`` (last stage, fp32
vocabulary-parallel cross-entropy) complete the model. ``graph_flops`` sums
them over an iteration; ``paper_flops`` is the paper's closed form;
``iteration_flops`` is what throughput is counted with.

A mixture-of-experts layer (``layer_ops(..., moe=True, ep=, dispatch=)``) replaces fc1/fc2 by
the router, the optional shared expert and the routed experts (``_Experts``): each of the
rank's T tokens goes to k experts, so S = k T rows leave the rank; spread over the expert
group, each rank's E/ep experts compute S rows on average (their share of the group's ep S),
as E/ep grouped GEMMs of S ep / E rows. Between the sort by expert and the grouped GEMMs the
rows travel (ep > 1): ``allgather`` gathers the group's ep S rows and reduce-scatters the
results (forward; the backward is the reverse), ``alltoall`` sends each peer the rows of its
experts and gets the results back; both after all-gathering each rank's E counts per expert
(``expert_route``). Those Ops are of the ``network.EP_KINDS``, priced over the expert group.

Under context parallelism (``cp`` > 1) a rank holds s_l = s/cp tokens of each sequence: every GEMM
and element-wise kernel runs on T = b s/cp tokens, and the attention is ring attention: its
score-shaped kernels cover the rank's s/cp queries against all s keys (1/cp of the whole score
matrix cp = 1 prices, causal or not: ``ring_costs``), and the key/value blocks travel the ring (``ring_kv``,
kind ``cp_ring``: (cp-1) hops of 2 b kv_l s_l d, forward and again backward; the backward's dK/dV
accumulators ``ring_grad``, kind ``cp_ring_grad``, fp32), priced with the overlap
``op_times.phase_time`` gives them. The attention's kernels are marked ``Op.attention``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache

from dataclasses import replace

from autopar.planning.cost.models import ModelSpec
from autopar.planning.cost.op_costs import (
    FP16,
    FP32,
    Op,
    cross_entropy_bytes,
    cross_entropy_flops,
    gemm_backward,
    gemm_op,
    linear_op,
    memory_op,
)
from autopar.planning.cost.ring_costs import ring_traffic
from autopar.planning.errors import PlanError

__all__ = ["PhaseOps", "ExpertRows", "expert_rows", "layer_ops", "replay_ops", "op_by_op", "embedding_ops", "head_ops",
           "graph_flops", "paper_flops", "iteration_flops"]


@dataclass(frozen=True)
class PhaseOps:
    """The kernels of one model piece on one GPU, in execution order."""

    forward: tuple[Op, ...]
    """Forward pass (also what recomputation runs again)."""
    backward: tuple[Op, ...]
    """Backward pass (input and weight gradients, f's all-reduces)."""


@dataclass(frozen=True)
class _Layer:
    """One layer's sizes on one of t ranks ("_l": local), and its GEMMs and all-reduce."""

    b: int
    s: int
    """Tokens of a sequence this rank holds: s, or s/cp under context parallelism."""
    h: int
    n: int
    """Head dimension."""
    T: int
    """Tokens, b s (of this rank)."""
    a_l: int
    kv_l: int
    h_l: int
    f_l: int
    scores: int
    """Attention scores computed, b a_l s_q s: this rank's queries (s/cp of them) against all s keys."""
    cp: int
    ring: tuple[Op, ...]
    """Ring attention's transfers, forward (the key/value blocks); empty at cp = 1."""
    ring_bwd: tuple[Op, ...]
    """Its backward's: the blocks again and the dK/dV accumulators."""
    gated: bool
    tp: bool
    gqa_repeat: bool
    """Key/value heads are repeated to the query heads (grouped-query attention)."""
    T_r: float
    """Tokens the replicated region (norms, dropout, residual) works on: T, or T/t with
    sequence parallelism."""
    qkv: Op
    qk: Op
    pv: Op
    proj: Op
    fc1: Op
    fc2: Op
    allreduce: tuple[Op, ...]
    """g's (forward) or f's (backward) collective: an all-reduce, or with sequence parallelism a
    reduce-scatter and an all-gather."""

    @classmethod
    def of(cls, spec: ModelSpec, b: int, t: int, sp: bool = False, cp: int = 1) -> _Layer:
        s, h, n = spec.seq_len // cp, spec.hidden, spec.head_dim
        keys = spec.seq_len  # every key, for this rank's s/cp queries
        T = b * s
        a_l = spec.heads // t
        ring, ring_bwd = _ring_ops(b, spec.kv // t, s, n, cp)
        qkv_l = (spec.heads + 2 * spec.kv) * n // t
        h_l = a_l * n
        f_l = spec.ffn_size // t
        return cls(
            b=b, s=s, h=h, n=n, T=T, a_l=a_l, kv_l=spec.kv // t, h_l=h_l, f_l=f_l, scores=b * a_l * s * keys,
            cp=cp, ring=ring, ring_bwd=ring_bwd,
            gated=spec.gated_mlp, tp=t > 1, gqa_repeat=spec.heads != spec.kv, T_r=T / t if sp and t > 1 else T,
            qkv=linear_op("qkv", T, h, qkv_l),
            qk=_attention_op(gemm_op("scores", b * a_l, s, keys, n)),
            pv=_attention_op(gemm_op("context", b * a_l, s, n, keys)),
            proj=linear_op("proj", T, h_l, h),
            fc1=linear_op("fc1", T, h, f_l * (2 if spec.gated_mlp else 1)),
            fc2=linear_op("fc2", T, f_l, h),
            allreduce=tp_reduction(T * h * FP16, sp and t > 1),
        )


def _attention_op(op: Op) -> Op:
    return replace(op, attention=True)


def _ring_ops(b: int, kv_l: int, s_l: int, n: int, cp: int) -> tuple[tuple[Op, ...], tuple[Op, ...]]:
    """(forward, backward) transfers of one ring attention on one rank (``ring_costs.ring_traffic``):
    the key/value blocks, and in the backward also the fp32 dK/dV accumulators; none at cp = 1."""
    if cp == 1:
        return (), ()
    traffic = ring_traffic(b, kv_l, s_l, n, cp, FP16)
    kv = float(traffic.forward)
    return ((Op("ring_kv", "cp_ring", 0.0, kv),),
            (Op("ring_kv.bwd", "cp_ring", 0.0, kv), Op("ring_grad", "cp_ring_grad", 0.0, traffic.backward - kv)))


ROUTE_COUNT_BYTES = 8
"""An int64 count of rows per expert (``expert_route`` all-gathers E of them per rank)."""


@dataclass(frozen=True)
class ExpertRows:
    """The routed rows of one mixture-of-experts layer on one rank (micro-batch b)."""

    tokens: int
    """T = b s: the rank's tokens (the MLP's input rows)."""
    sent: int
    """S = k T: rows leaving the rank (each token once per chosen expert), sorted by expert."""
    computed: float
    """Rows the rank's E/ep experts compute: on average their share of the group's ep S rows, S."""
    held: int
    """Rows of the tensors the grouped GEMMs read and write: ep S with the all-gather dispatcher
    (static shapes: the whole group's rows, the rank's own at the front), S otherwise (ep = 1 or
    all-to-all, the balanced share)."""
    local_experts: int
    """E/ep."""


def expert_rows(spec: ModelSpec, b: int, ep: int = 1, dispatch: str = "allgather", cp: int = 1) -> ExpertRows:
    """The rows of one mixture-of-experts layer on one rank of an expert group of ``ep`` (holding s/cp
    tokens of each sequence under context parallelism)."""
    if spec.experts % ep:
        raise PlanError(f"ep={ep} does not divide the {spec.experts} experts of {spec.label}: each rank of an expert "
                        f"group holds E/ep whole experts")
    T = b * spec.seq_len // cp
    S = T * spec.top_k
    return ExpertRows(T, S, float(S), ep * S if ep > 1 and dispatch == "allgather" else S, spec.experts // ep)


def tp_reduction(nbytes: float, sp: bool) -> tuple[Op, ...]:
    """The tensor-parallel reduction of a (T, h) activation: one all-reduce, or with sequence
    parallelism a reduce-scatter and an all-gather (priced as the all-reduce's two halves)."""
    if sp:
        return (Op("reduce_scatter", "tp_reduce_scatter", 0.0, nbytes), Op("allgather", "tp_allgather", 0.0, nbytes))
    return (Op("allreduce", "tp_allreduce", 0.0, nbytes),)


_UNFUSED: dict[str, tuple[tuple[str, float, float, float, float], ...]] = {
    # a fused kernel -> the passes it takes op by op: (name, reads, writes, mask, FLOPs) per element
    "softmax": (("scale", 1, 1, 0, 1), ("mask_fill", 1, 1, 1, 0), ("softmax", 1, 1, 0, 5)),
    "softmax.bwd": (("softmax.bwd", 2, 1, 0, 4), ("mask_fill.bwd", 1, 1, 1, 0), ("scale.bwd", 1, 1, 0, 1)),
    "bias_dropout_add1": (("bias_add1", 1, 1, 0, 1), ("dropout1", 1, 1, 1, 1), ("residual_add1", 2, 1, 0, 1)),
    "bias_dropout_add2": (("bias_add2", 1, 1, 0, 1), ("dropout2", 1, 1, 1, 1), ("residual_add2", 2, 1, 0, 1)),
    "bias_dropout_add1.bwd": (("dropout1.bwd", 1, 1, 1, 1), ("bias1.bwd", 1, 0, 0, 1)),
    "bias_dropout_add2.bwd": (("dropout2.bwd", 1, 1, 1, 1), ("bias2.bwd", 1, 0, 0, 1)),
    "bias_act": (("bias_add_fc1", 1, 1, 0, 1), ("act", 1, 1, 0, 8)),
    "bias_act.bwd": (("act.bwd", 2, 1, 0, 8), ("bias_fc1.bwd", 1, 0, 0, 1)),
}
"""What Megatron's fused element-wise kernels (and a compiled chunk's fusions) are when a chunk runs
op by op, eagerly."""


def op_by_op(ops: tuple[Op, ...]) -> tuple[Op, ...]:
    """``ops`` with each fused element-wise kernel split into the passes eager PyTorch makes, over the
    same elements: about the same FLOPs, more bytes through memory (each pass reads its input and
    writes its output)."""
    out: list[Op] = []
    for op in ops:
        pieces = _UNFUSED.get(op.name) if op.kind == "memory" else None
        if pieces:
            out += [replace(memory_op(n, op.elements, r, w, mask=m, flops_per=f), attention=op.attention)
                    for n, r, w, m, f in pieces]
        else:
            out.append(op)
    return tuple(out)


@lru_cache(maxsize=4096)
def layer_ops(spec: ModelSpec, b: int, t: int, sequence_parallel: bool = False, fused: bool = True,
              moe: bool = False, ep: int = 1, dispatch: str = "allgather", cp: int = 1) -> PhaseOps:
    """One transformer layer on one of t tensor-parallel GPUs, micro-batch b.

    Forward (Megatron-LM, 2021; T = b s tokens; "_l" = local to one rank):
      LN -> QKV (T, h)x(h, (a+2kv) d / t) -> scores (b a_l, s, s) = Q K^T
      -> fused scale/mask/softmax -> dropout -> context (b a_l, s, d) = P V
      -> permute -> proj (T, h/t)x(h/t, h) -> all-reduce (g) -> bias+dropout+residual
      -> LN -> fc1 (T, h)x(h, f/t) -> bias+GeLU -> fc2 (T, f/t)x(f/t, h)
      -> all-reduce (g) -> bias+dropout+residual.
    LayerNorm, dropout and residual work on the full (T, h) on every rank (no
    sequence parallelism in the paper). Backward: two GEMMs per GEMM, the
    element-wise backward kernels, and the all-reduces of f (before QKV, fc1).
    With ``sequence_parallel`` the LayerNorm/dropout/residual kernels touch T/t tokens.
    ``fused=False``: the element-wise kernels as eager PyTorch runs them, one pass each
    (``op_by_op``): a chunk run eagerly rather than compiled. ``moe``: a mixture-of-experts
    layer of ``spec`` on a rank of an expert group of ``ep`` exchanging rows by ``dispatch``
    (``_Experts``); ignored for a dense model. ``cp``: a rank of a context-parallel group of cp, s/cp
    tokens, the attention a ring (the module's docstring).
    """
    layer = _Layer.of(spec, b, t, sequence_parallel, cp)
    experts = _Experts.of(spec, layer, t, ep, dispatch) if moe and spec.is_moe else None
    fwd, bwd = tuple(_layer_forward(layer, experts)), tuple(_layer_backward(layer, experts))
    return PhaseOps(fwd, bwd) if fused else PhaseOps(op_by_op(fwd), op_by_op(bwd))


def replay_ops(spec: ModelSpec, b: int, t: int, sequence_parallel: bool = False, fused: bool = True,
               cp: int = 1) -> tuple[Op, ...]:
    """What recomputing one dense layer under autopar's runtime runs again in its backward, net: the
    layer's forward (``layer_ops``) up to its last op that saves a tensor for the backward, since
    PyTorch's non-reentrant checkpoint stops its replay there (the MLP's reduction and the residual add
    after it are not run again, as ``compiler/tp_traffic.py`` finds on the graph); and under sequence
    parallelism no all-gather net: the replay gathers as the forward did, and inside the checkpointed
    region the consumers keep the gathered value itself, so the backward makes none of the re-gathers
    of kept slices it makes otherwise (``core/comm/kept_slices.py``). A layer at t = 2 replays one
    reduction: an all-reduce, or with sequence parallelism a reduce-scatter (the engine's counts,
    tests/runtime/test_replayed_collectives.py)."""
    layer = _Layer.of(spec, b, t, sequence_parallel, cp)
    fwd = _layer_forward(layer)
    tail = len(layer.allreduce) + 1 if layer.tp else 1  # the trailing reduction and residual add
    ops = [op for op in fwd[:-tail] if op.kind != "tp_allgather"]
    return tuple(ops) if fused else tuple(op_by_op(ops))


@dataclass(frozen=True)
class _Experts:
    """A mixture-of-experts MLP on one of t ranks of an expert group of ep: its router, shared
    expert and routed experts' GEMMs, and the row exchange."""

    rows: ExpertRows
    h: int
    E: int
    k: int
    ep: int
    dispatch: str
    fe_l: int
    """One expert's width on this rank, f_e / t."""
    fs_l: int
    """The shared expert's width on this rank, f_s / t (0: none)."""
    gated: bool
    router: Op
    fc1: Op
    fc2: Op
    shared_fc1: Op | None
    shared_fc2: Op | None

    @classmethod
    def of(cls, spec: ModelSpec, layer: _Layer, t: int, ep: int, dispatch: str) -> _Experts:
        rows = expert_rows(spec, layer.b, ep, dispatch, layer.cp)
        h, n_in = spec.hidden, 2 if spec.gated_mlp else 1
        fe_l, fs_l = spec.expert_ffn_size // t, spec.shared_expert_ffn // t
        per_expert = rows.computed / rows.local_experts  # rows per local expert, on average
        shared = fs_l > 0
        return cls(
            rows=rows, h=h, E=spec.experts, k=spec.top_k, ep=ep, dispatch=dispatch, fe_l=fe_l, fs_l=fs_l,
            gated=spec.gated_mlp,
            router=linear_op("router", layer.T, h, spec.experts),
            fc1=gemm_op("expert_fc1", rows.local_experts, per_expert, n_in * fe_l, h),
            fc2=gemm_op("expert_fc2", rows.local_experts, per_expert, h, fe_l),
            shared_fc1=linear_op("shared_fc1", layer.T, h, n_in * fs_l) if shared else None,
            shared_fc2=linear_op("shared_fc2", layer.T, fs_l, h) if shared else None,
        )

    @property
    def exchanged(self) -> bool:
        return self.ep > 1

    def route(self) -> Op:
        """Every rank's E counts of rows per expert, all-gathered over the group."""
        return Op("expert_route", "ep_allgather", 0.0, float(self.ep * self.E * ROUTE_COUNT_BYTES))

    def exchange(self, name: str, forward_gather: bool) -> Op:
        """The rows' trip (``forward_gather``: towards the experts, as the dispatch's all-gather or
        the combine's backward; else back, as the combine's reduce-scatter or the dispatch's
        backward): all-gather / reduce-scatter of the group's ep S rows, or all-to-all of S rows."""
        S, h = self.rows.sent, self.h
        if self.dispatch == "alltoall":
            return Op(name, "ep_alltoall", 0.0, float(S * h * FP16))
        return Op(name, "ep_allgather" if forward_gather else "ep_reduce_scatter", 0.0, float(self.ep * S * h * FP16))


def _moe_forward(x: _Layer, e: _Experts) -> list[Op]:
    """Router, shared expert, sort by expert, exchange, grouped GEMMs, exchange back, weighted sum."""
    T, h, S, R, k = x.T, x.h, e.rows.sent, e.rows.held, e.k
    act = 2 if e.gated else 1
    fwd = [e.router, memory_op("router_softmax_topk", T * e.E, 1, 1, flops_per=5)]
    if e.shared_fc1 is not None:
        fwd += [e.shared_fc1, memory_op("shared_act", T * e.fs_l * act, 1, 0.5 if e.gated else 1, flops_per=8),
                e.shared_fc2]
    fwd.append(memory_op("expert_sort", S * h, 1, 1))  # each token's row once per chosen expert
    if e.exchanged:
        fwd += [e.route(), e.exchange("expert_dispatch", True)]
        # this rank's rows grouped by local expert; the all-gather's rows padded with zeros to ep S
        fwd.append(memory_op("expert_regroup", S * h, 1, 1 + (R - S) / S))
    fwd += [
        e.fc1,
        memory_op("expert_act", R * e.fe_l * act, 1, 0.5 if e.gated else 1, flops_per=8),
        e.fc2,
    ]
    if e.exchanged:
        fwd += [memory_op("expert_spread", S * h, 1, 1 + (R - S) / S), e.exchange("expert_combine", False)]
    fwd.append(memory_op("expert_unsort", S * h, 1, 1 / k, flops_per=2))  # gate-weighted sum per token
    return fwd


def _moe_backward(x: _Layer, e: _Experts) -> list[Op]:
    """``_moe_forward``'s backward, last op first: each exchange's conjugate, both GEMMs of each GEMM."""
    T, h, S, R, k = x.T, x.h, e.rows.sent, e.rows.held, e.k
    act = 2 if e.gated else 1
    bwd = [memory_op("expert_unsort.bwd", S * h, 1 + 1 / k, 1, flops_per=2)]
    if e.exchanged:
        bwd += [e.exchange("expert_combine.bwd", True), memory_op("expert_spread.bwd", S * h, 1, 1)]
    bwd += [
        *gemm_backward(e.fc2),
        memory_op("expert_act.bwd", R * e.fe_l * act, 1.5 if e.gated else 2, 1, flops_per=8),
        *gemm_backward(e.fc1),
    ]
    if e.exchanged:
        bwd += [memory_op("expert_regroup.bwd", S * h, 1, 1), e.exchange("expert_dispatch.bwd", False)]
    bwd.append(memory_op("expert_sort.bwd", S * h, 1, 1 / k))  # the k rows of a token added
    if e.shared_fc1 is not None:
        bwd += [*gemm_backward(e.shared_fc2),
                memory_op("shared_act.bwd", T * e.fs_l * act, 1.5 if e.gated else 2, 1, flops_per=8),
                *gemm_backward(e.shared_fc1)]
    bwd += [memory_op("router_softmax_topk.bwd", T * e.E, 2, 1, flops_per=4), *gemm_backward(e.router)]
    return bwd


def _layer_forward(x: _Layer, experts: _Experts | None = None) -> list[Op]:
    T, h, act, Tr = x.T, x.h, 2 if x.gated else 1, x.T_r
    fwd: list[Op] = [
        memory_op("ln1", Tr * h, 1, 1, flops_per=8),
        x.qkv,
    ]
    if x.gqa_repeat:
        fwd.append(memory_op("kv_repeat", x.b * x.s * 2 * x.a_l * x.n, 0.5 * x.kv_l / x.a_l, 1))
    fwd += [
        *x.ring,
        x.qk,
        _attention_op(memory_op("softmax", x.scores, 1, 1, flops_per=5)),
        _attention_op(memory_op("attn_dropout", x.scores, 1, 1, mask=1)),
        x.pv,
        memory_op("context_permute", T * x.h_l, 1, 1),
        x.proj,
    ]
    if x.tp:
        fwd += x.allreduce
    fwd += [
        memory_op("bias_dropout_add1", Tr * h, 2, 1, mask=1, flops_per=3),
        memory_op("ln2", Tr * h, 1, 1, flops_per=8),
    ]
    if experts is not None:
        fwd += _moe_forward(x, experts)
    else:
        fwd += [x.fc1, memory_op("bias_act", T * x.f_l * act, 1, 0.5 if x.gated else 1, flops_per=8), x.fc2]
    if x.tp:
        fwd += x.allreduce
    fwd.append(memory_op("bias_dropout_add2", Tr * h, 2, 1, mask=1, flops_per=3))
    return fwd


def _layer_backward(x: _Layer, experts: _Experts | None = None) -> list[Op]:
    T, h, act, Tr = x.T, x.h, 2 if x.gated else 1, x.T_r
    bwd: list[Op] = [memory_op("bias_dropout_add2.bwd", Tr * h, 1, 1, mask=1)]
    if experts is not None:
        bwd += _moe_backward(x, experts)
    else:
        bwd += [
            *gemm_backward(x.fc2),
            memory_op("bias_act.bwd", T * x.f_l * act, 1.5 if x.gated else 2, 1, flops_per=8),
            *gemm_backward(x.fc1),
        ]
    if x.tp:
        bwd += x.allreduce  # f before fc1
    bwd += [
        memory_op("ln2.bwd", Tr * h, 2, 1, flops_per=8),
        memory_op("residual_grad_add", Tr * h, 2, 1, flops_per=1),
        memory_op("bias_dropout_add1.bwd", Tr * h, 1, 1, mask=1),
        *gemm_backward(x.proj),
        memory_op("context_permute.bwd", T * x.h_l, 1, 1),
        *x.ring_bwd,
        *map(_attention_op, gemm_backward(x.pv, weight=False)),
        _attention_op(memory_op("attn_dropout.bwd", x.scores, 1, 1, mask=1)),
        _attention_op(memory_op("softmax.bwd", x.scores, 2, 1, flops_per=4)),
        *map(_attention_op, gemm_backward(x.qk, weight=False)),
    ]
    if x.gqa_repeat:
        bwd.append(memory_op("kv_repeat.bwd", x.b * x.s * 2 * x.a_l * x.n, 1, 0.5 * x.kv_l / x.a_l))
    bwd += gemm_backward(x.qkv)
    if x.tp:
        bwd += x.allreduce  # f before QKV
    bwd += [
        memory_op("ln1.bwd", Tr * h, 2, 1, flops_per=8),
        memory_op("residual_grad_add", Tr * h, 2, 1, flops_per=1),
    ]
    return bwd


@lru_cache(maxsize=1024)
def embedding_ops(spec: ModelSpec, b: int, t: int, cp: int = 1) -> PhaseOps:
    """Vocabulary-parallel word embedding + position embedding (with ``learned_positions``)
    + dropout (stage 0), on the s/cp tokens of a context-parallel rank."""
    T, h = b * spec.seq_len // cp, spec.hidden
    fwd = [memory_op("wte_lookup", T * h, 1, 1)]
    if t > 1:
        fwd.append(Op("wte_allreduce", "tp_allreduce", 0.0, T * h * FP16))
    if spec.learned_positions:
        fwd.append(memory_op("wpe_add", T * h, 2, 1, flops_per=1))
    fwd.append(memory_op("emb_dropout", T * h, 1, 1, mask=1))
    bwd = [memory_op("emb_dropout.bwd", T * h, 1, 1, mask=1)]
    if spec.learned_positions:
        bwd.append(memory_op("wpe.bwd", T * h, 1, 0))
    bwd.append(memory_op("wte.bwd", T * h, 2, 1))  # scatter-add rows into the gradient
    return PhaseOps(tuple(fwd), tuple(bwd))


@lru_cache(maxsize=1024)
def head_ops(spec: ModelSpec, b: int, t: int, cp: int = 1) -> PhaseOps:
    """Final LayerNorm, LM head (T, h) x (h, V/t), fp32 vocabulary-parallel
    cross-entropy (three all-reduces of T floats, latency only), last stage; T = b s/cp."""
    T, h = b * spec.seq_len // cp, spec.hidden
    V_l = math.ceil(spec.vocab / t)
    logits = linear_op("lm_head", T, h, V_l)
    fwd = [
        memory_op("ln_f", T * h, 1, 1, flops_per=8),
        logits,
        Op("cross_entropy", "memory", cross_entropy_flops(T, V_l), cross_entropy_bytes(T, V_l)),
    ]
    if t > 1:
        fwd += [Op(f"ce_allreduce{i}", "tp_allreduce", 0.0, T * FP32) for i in range(3)]
    bwd = [
        # softmax - onehot, scaled by the loss gradient in place (8 B), cast back to fp16 (6 B)
        Op("cross_entropy.bwd", "memory", 2.0 * T * V_l, 14.0 * T * V_l),
        *gemm_backward(logits),
    ]
    if t > 1:
        bwd.append(Op("lm_head_allreduce", "tp_allreduce", 0.0, T * h * FP16))
    bwd.append(memory_op("ln_f.bwd", T * h, 2, 1, flops_per=8))
    return PhaseOps(tuple(fwd), tuple(bwd))


def graph_flops(spec: ModelSpec, batch: int, recompute: bool = True) -> float:
    """FLOPs of one iteration summed node by node (t = 1): every layer's
    forward, backward and (with recomputation) second forward, plus the
    embedding and the head. Agrees with ``paper_flops`` within 2% on a GPT. A mixture-of-experts
    layer counts its router, shared expert and k experts per token (the FLOPs do not depend on ep)."""
    def per_layer(moe: bool) -> float:
        lay = layer_ops(spec, 1, 1, moe=moe)
        return sum(o.flops for o in lay.forward) * (2 if recompute else 1) + sum(o.flops for o in lay.backward)

    emb, head = embedding_ops(spec, 1, 1), head_ops(spec, 1, 1)
    rest = sum(o.flops for o in emb.forward + emb.backward + head.forward + head.backward)
    dense, moe = spec.layers - spec.moe_layers, spec.moe_layers
    layers = dense * per_layer(False) + (moe * per_layer(True) if moe else 0.0)
    return batch * (layers + rest)


def paper_flops(spec: ModelSpec, batch: int, recompute: bool = True) -> float:
    """The paper's count: ``96 B s l h^2 (1 + s/(6h) + V/(16 l h))``; 72 without recomputation."""
    s, l, h, V = spec.seq_len, spec.layers, spec.hidden, spec.vocab
    lead = 96 if recompute else 72
    # the logit layer (6 B s h V) is never recomputed
    return lead * batch * s * l * h * h * (1 + s / (6 * h)) + 6.0 * batch * s * h * V


def iteration_flops(spec: ModelSpec, batch: int, recompute: bool = True) -> float:
    """FLOPs that throughput is counted with: the paper's formula on a paper-shaped
    GPT (as the paper counts), the node-by-node sum otherwise."""
    return paper_flops(spec, batch, recompute) if spec.is_paper_gpt else graph_flops(spec, batch, recompute)
