"""The model the performance model prices: a GPT-shaped decoder given by its dimensions
(``ModelSpec``), the paper's presets, and its parameters (in all, per pipeline stage).

A mixture-of-experts model is the same decoder whose MLP, in the layers ``moe_every`` says,
is E routed experts (each an MLP of width ``expert_ffn``, gated as the dense MLP is) of which
each token takes ``top_k``, chosen by a router (an h x E linear), plus, optionally, one shared
expert every token goes through (width ``shared_expert_ffn``). Under expert parallelism
(``Layout.ep``) a rank holds E/ep whole experts, each split t ways on its width
(``expert_params_per_rank``)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache

from autopar.planning.cost.saved_shares import SavedCensus
from autopar.planning.errors import PlanError

__all__ = ["ModelSpec", "PRESETS", "MOE_PRESETS", "get_model", "param_count", "params_per_stage",
           "expert_params_per_stage",
           "expert_params_per_rank", "moe_layers_in", "max_moe_layers_per_chunk"]


@dataclass(frozen=True)
class ModelSpec:
    """A GPT-shaped decoder given by its dimensions."""

    layers: int
    """Transformer blocks, l."""
    hidden: int
    """Hidden size, h."""
    heads: int
    """Attention (query) heads, a."""
    seq_len: int = 2048
    """Sequence length, s."""
    vocab: int = 51200
    """Vocabulary size, V (already padded as Megatron pads it)."""
    ffn: int | None = None
    """MLP inner size; None means 4h."""
    kv_heads: int | None = None
    """Key/value heads (grouped-query attention); None means ``heads``."""
    gated_mlp: bool = False
    """SwiGLU-style MLP (three projections) instead of GeLU (two)."""
    dropout: bool = True
    """Dropout after the embedding, on the attention probabilities and before each residual add
    (the paper's GPT); False when the model trains without dropout (no masks kept)."""
    fused_attention: bool = False
    """The attention runs as one fused kernel that keeps only its output and the log-sum-exp
    per query for the backward (FlashAttention, ``scaled_dot_product_attention`` without
    dropout on the CPU); False for the paper's attention, which keeps the s x s scores."""
    tied_head: bool = True
    """The LM head multiplies by the word embedding's table (the paper's GPT, GPT-2): one
    parameter, its gradient summed between the first and the last stage; False for a head of
    its own (Llama, most current large models): V h more parameters, no cross-stage sum."""
    learned_positions: bool = True
    """A learned position embedding (an s x h table on the first stage, the paper's GPT);
    False for positions computed in the attention (rotary) with no parameters."""
    experts: int = 0
    """Routed experts of a mixture-of-experts layer, E; 0: every MLP is dense."""
    top_k: int = 1
    """Experts each token is routed to, k (Switch: 1, Mixtral: 2); read only when ``experts`` > 0."""
    expert_ffn: int | None = None
    """Width of one expert's MLP; None means ``ffn`` (Mixtral's experts are its dense MLP's size)."""
    shared_expert_ffn: int = 0
    """Width of a shared expert every token goes through beside its routed ones (Qwen-MoE,
    DeepSeek-MoE), split over t as a dense MLP; 0 for none."""
    moe_every: int = 1
    """Which layers are mixture-of-experts: layer i (from 0) is when (i + 1) % moe_every == 0:
    1 every layer (Mixtral), 2 every other one (Switch, GShard). The others keep the dense MLP."""
    name: str = ""
    """Display name, e.g. ``gpt-39b``."""
    causal: bool = True
    """Causal (decoder) attention: under context parallelism the sequence is cut into 2 cp chunks
    (the load-balanced layout); False for bidirectional attention (cp contiguous chunks)."""
    graph_nodes: tuple[int, int, int] | None = None
    """(embedding, one layer, head and loss) forward graph nodes of the model's traced graph, which a
    tuned profile's per-node runtime overhead prices (``op_times.node_overheads``); None for a spec given
    by its dimensions."""
    saved: SavedCensus | None = None
    """What one layer, the embedding and the head save for the backward per token, counted on the
    model's traced graph (``compiler/saved_census.py``), for the sequence length ``seq_len``; None
    for a spec given by its dimensions (the activation formulas then count the paper's GPT layer)."""

    def __post_init__(self) -> None:
        if self.experts < 0 or self.moe_every < 1 or self.shared_expert_ffn < 0:
            raise PlanError(f"experts ({self.experts}) and shared_expert_ffn ({self.shared_expert_ffn}) must be "
                            f">= 0 and moe_every ({self.moe_every}) >= 1")
        if self.experts and not 1 <= self.top_k <= self.experts:
            raise PlanError(f"top_k ({self.top_k}) must be between 1 and the {self.experts} experts: each token "
                            f"is routed to k distinct experts")
        if self.experts and self.expert_ffn is not None and self.expert_ffn <= 0:
            raise PlanError(f"expert_ffn must be positive, got {self.expert_ffn}")
        if self.hidden % self.heads:
            raise PlanError(f"hidden ({self.hidden}) must be a multiple of heads ({self.heads})")
        if self.heads % self.kv:
            raise PlanError(f"heads ({self.heads}) must be a multiple of kv_heads ({self.kv})")
        if min(self.layers, self.hidden, self.heads, self.seq_len, self.vocab) <= 0:
            raise PlanError(f"all dimensions must be positive: {self}")

    @property
    def ffn_size(self) -> int:
        return self.ffn or 4 * self.hidden

    @property
    def is_moe(self) -> bool:
        """Some layers' MLPs are routed experts."""
        return self.experts > 0 and self.moe_layers > 0

    @property
    def expert_ffn_size(self) -> int:
        return self.expert_ffn or self.ffn_size

    @property
    def moe_layers(self) -> int:
        """Layers whose MLP is experts (0 for a dense model)."""
        return self.layers // self.moe_every if self.experts else 0

    def is_moe_layer(self, i: int) -> bool:
        """Layer i (from 0) is a mixture-of-experts layer (``moe_every``)."""
        return self.experts > 0 and (i + 1) % self.moe_every == 0

    @property
    def expert_params(self) -> int:
        """Parameters of one expert: its up (and gate) and down projections, (3 if gated else 2) h f_e
        (stacked expert weights carry no bias: Mixtral's, the grouped-matmul layers')."""
        return (3 if self.gated_mlp else 2) * self.hidden * self.expert_ffn_size

    @property
    def kv(self) -> int:
        return self.kv_heads or self.heads

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads

    @property
    def is_paper_gpt(self) -> bool:
        """True when the paper's closed-form formulas apply exactly (4h GeLU MLP, MHA)."""
        return (self.ffn_size == 4 * self.hidden and self.kv == self.heads and not self.gated_mlp
                and not self.is_moe)

    @property
    def label(self) -> str:
        return self.name or f"l{self.layers}-h{self.hidden}-a{self.heads}"

    @property
    def layer_signature(self) -> str:
        """A dense layer's dimensions and kind, as ``autopar tune`` names the layers it measures
        (``hardware.MeasuredLayer``): ``h128 a4 kv2 f352 s64 swiglu fused-attn no-dropout``."""
        return " ".join([f"h{self.hidden} a{self.heads} kv{self.kv} f{self.ffn_size} s{self.seq_len}",
                         "swiglu" if self.gated_mlp else "gelu",
                         "fused-attn" if self.fused_attention else "unfused-attn",
                         "dropout" if self.dropout else "no-dropout", "causal" if self.causal else "bidirectional"])

    @property
    def features(self) -> str:
        """What the dimensions do not say, in words: ``SwiGLU MLP, fused attention, no dropout,
        untied head, no position table``."""
        moe = []
        if self.is_moe:
            every = "every layer" if self.moe_every == 1 else f"every {self.moe_every}th layer"
            shared = f" + shared {self.shared_expert_ffn}" if self.shared_expert_ffn else ""
            moe = [f"{self.experts} experts top-{self.top_k} of width {self.expert_ffn_size}{shared} on {every}"]
        return ", ".join(moe + [
            f"{'SwiGLU' if self.gated_mlp else 'GeLU'} MLP {self.ffn_size}",
            f"{self.heads} heads" + (f" ({self.kv} key/value)" if self.kv != self.heads else ""),
            f"vocab {self.vocab}", f"seq {self.seq_len}",
            "fused attention" if self.fused_attention else "unfused attention",
            "dropout" if self.dropout else "no dropout",
            "tied head" if self.tied_head else "untied head",
            "learned positions" if self.learned_positions else "no position table"])


def _gpt(name: str, layers: int, hidden: int, heads: int) -> ModelSpec:
    return ModelSpec(layers=layers, hidden=hidden, heads=heads, name=name)


PRESETS: dict[str, ModelSpec] = {
    # The paper's weak-scaling table (seq 2048, vocab 51200). The first six are
    # the calibration rows; the last four are held out (never fitted).
    "gpt-1.7b": _gpt("gpt-1.7b", 24, 2304, 24),
    "gpt-3.6b": _gpt("gpt-3.6b", 30, 3072, 32),
    "gpt-7.5b": _gpt("gpt-7.5b", 36, 4096, 32),
    "gpt-18b": _gpt("gpt-18b", 40, 6144, 48),
    "gpt-39b": _gpt("gpt-39b", 48, 8192, 64),
    "gpt-76b": _gpt("gpt-76b", 60, 10240, 80),
    "gpt-145b": _gpt("gpt-145b", 80, 12288, 96),
    "gpt-310b": _gpt("gpt-310b", 96, 16384, 128),
    "gpt-530b": _gpt("gpt-530b", 105, 20480, 128),
    "gpt-1t": _gpt("gpt-1t", 128, 25600, 160),
}
MOE_PRESETS: dict[str, ModelSpec] = {
    # Mixtral 8x7B (Jiang et al. 2024): 32 layers, each MLP 8 SwiGLU experts of width 14336, top-2,
    # grouped-query attention (8 key/value heads), rotary positions, untied head, no dropout.
    "mixtral-8x7b": ModelSpec(layers=32, hidden=4096, heads=32, kv_heads=8, seq_len=4096, vocab=32000, ffn=14336,
                              gated_mlp=True, dropout=False, fused_attention=True, tied_head=False,
                              learned_positions=False, experts=8, top_k=2, name="mixtral-8x7b"),
}
"""Mixture-of-experts models by name (``get_model`` knows them beside the paper's ``PRESETS``)."""

_ALIASES = {"gpt-18.4b": "gpt-18b", "gpt-39.1b": "gpt-39b", "gpt-76.1b": "gpt-76b",
            "gpt-145.6b": "gpt-145b", "gpt-310.1b": "gpt-310b", "gpt-529.6b": "gpt-530b",
            "gpt-1008b": "gpt-1t"}


def get_model(name: str) -> ModelSpec:
    """The preset called ``name``; the error lists the known ones."""
    key = _ALIASES.get(name.lower(), name.lower())
    known = {**PRESETS, **MOE_PRESETS}
    if key not in known:
        raise PlanError(f"unknown model preset {name!r}; known: {', '.join(known)}")
    return known[key]


def param_count(spec: ModelSpec) -> int:
    """Exact parameter count (weights and biases, tied embedding counted once; an untied head
    adds its V h, a position table its s h).

    For the paper's GPT this is ``12 l h^2 (1 + 13/(12 h) + (V + s)/(12 l h)) + 2h``
    (the 2h is the final LayerNorm, which the paper's formula leaves out). A mixture-of-experts
    layer counts its attention, router, shared expert and all E experts.
    """
    tables = spec.vocab * (1 if spec.tied_head else 2) + (spec.seq_len if spec.learned_positions else 0)
    dense, moe = spec.layers - spec.moe_layers, spec.moe_layers
    moe_layer = _layer_params(spec, 1, moe=True)[0] + spec.experts * spec.expert_params
    return dense * _layer_params(spec, 1)[0] + moe * moe_layer + tables * spec.hidden + 2 * spec.hidden


def _mlp_params(h: int, f: int, gated: bool) -> tuple[int, int]:
    """(split, replicated) parameters of a dense MLP of width f: fc1 (+gate) weight and bias
    (column-split), fc2 weight (row-split); fc2's bias, added after the reduction, replicated."""
    return (2 if gated else 1) * (h * f + f) + f * h, h


def _layer_params(spec: ModelSpec, t: int, moe: bool = False) -> tuple[int, int]:
    """(parameters of one layer held by one of t ranks, of which replicated); for a
    mixture-of-experts layer (``moe``) without its routed experts (``expert_params_per_rank``):
    the attention, the router (h E, replicated: every tensor-parallel rank routes the same
    tokens) and the shared expert (split as a dense MLP)."""
    h, n = spec.hidden, spec.head_dim
    qkv = (spec.heads + 2 * spec.kv) * n
    split = h * qkv + qkv + h * h  # QKV weight + bias (column-split), proj weight (row-split)
    replicated = h + 4 * h  # proj bias, 2 LayerNorms
    if not moe:
        mlp_split, mlp_rep = _mlp_params(h, spec.ffn_size, spec.gated_mlp)
    elif spec.shared_expert_ffn:
        mlp_split, mlp_rep = _mlp_params(h, spec.shared_expert_ffn, spec.gated_mlp)
        mlp_rep += h * spec.experts
    else:
        mlp_split, mlp_rep = 0, h * spec.experts
    split, replicated = split + mlp_split, replicated + mlp_rep
    return split // t + replicated, replicated


def expert_params_per_rank(spec: ModelSpec, t: int = 1, ep: int = 1) -> int:
    """Routed-expert parameters one rank holds in one mixture-of-experts layer: E/ep whole experts
    (the rank's block of its expert group), each split t ways on its width: E/ep (3|2) h f_e / t."""
    return spec.experts // ep * spec.expert_params // t


def moe_layers_in(spec: ModelSpec, first: int, count: int) -> int:
    """Mixture-of-experts layers among layers ``first`` .. ``first + count - 1`` (those i with
    (i + 1) % moe_every == 0)."""
    if not spec.experts:
        return 0
    return (first + count) // spec.moe_every - first // spec.moe_every


def max_moe_layers_per_chunk(spec: ModelSpec, chunks: int) -> int:
    """The most mixture-of-experts layers one of ``chunks`` model chunks holds, the layers cut in
    contiguous runs of ceil(l / chunks) (the largest chunk's count, as the step prices it)."""
    if not spec.is_moe:
        return 0
    size = math.ceil(spec.layers / chunks)
    return max(moe_layers_in(spec, c * size, min(size, spec.layers - c * size)) for c in range(chunks)
               if c * size < spec.layers)


@lru_cache(maxsize=4096)
def _stage_params(spec: ModelSpec, t: int, p: int, ep: int,
                  head_stage: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(all, routed experts') parameters of one GPU of each stage (``params_per_stage``), cached: the
    planner asks for them several times per layout."""
    base, extra = divmod(spec.layers, p)
    dense_layer, moe_layer = _layer_params(spec, t)[0], _layer_params(spec, t, moe=True)[0]
    per_expert_layer = expert_params_per_rank(spec, t, ep) if spec.is_moe else 0
    total, experts, first = [], [], 0
    for r in range(p):
        layers = base + (1 if r < extra else 0)
        moe = moe_layers_in(spec, first, layers)
        first += layers
        n = (layers - moe) * dense_layer + moe * (moe_layer + per_expert_layer)
        if r == 0:
            n += math.ceil(spec.vocab / t) * spec.hidden + (spec.seq_len * spec.hidden if spec.learned_positions else 0)
        if r == head_stage:
            head = head_stage != 0 or not spec.tied_head
            n += 2 * spec.hidden + (math.ceil(spec.vocab / t) * spec.hidden if head else 0)
        total.append(n)
        experts.append(moe * per_expert_layer)
    return tuple(total), tuple(experts)


def expert_params_per_stage(spec: ModelSpec, t: int, p: int, ep: int = 1) -> list[int]:
    """The routed-expert part of ``params_per_stage``: per stage, its mixture-of-experts layers
    times ``expert_params_per_rank`` (what is reduced over the replicas holding the same experts)."""
    return list(_stage_params(spec, t, p, ep, p - 1)[1])


def params_per_stage(spec: ModelSpec, t: int, p: int, ep: int = 1, head_stage: int | None = None) -> list[int]:
    """Parameters held by one GPU of each pipeline stage 0..p-1.

    Layers are spread evenly (the largest stage gets ceil(l/p)); stage 0 holds
    the vocabulary-parallel word embedding (V h / t) and the position embedding
    (s h, replicated, with ``learned_positions``); the stage of the last chunk (``head_stage``,
    default p - 1; 0 in ZB-V, whose V brings the last chunk back to stage 0) holds the final
    LayerNorm and the LM head's V h / t: its own copy of the tied word embedding
    on another stage than the embedding's, the head's own weight when untied. A mixture-of-experts layer holds its
    attention, router and shared expert as a dense layer holds its own, and E/ep of its
    experts (``expert_params_per_stage``).
    """
    return list(_stage_params(spec, t, p, ep, p - 1 if head_stage is None else head_stage)[0])
