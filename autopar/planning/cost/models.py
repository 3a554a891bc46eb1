"""The model the performance model prices: a GPT-shaped decoder given by its dimensions
(``ModelSpec``), the paper's presets, and its parameters (in all, per pipeline stage)."""

from __future__ import annotations

import math
from dataclasses import dataclass

from autopar.planning.errors import PlanError

__all__ = ["ModelSpec", "PRESETS", "get_model", "param_count", "params_per_stage"]


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
    name: str = ""
    """Display name, e.g. ``gpt-39b``."""

    def __post_init__(self) -> None:
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
    def kv(self) -> int:
        return self.kv_heads or self.heads

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads

    @property
    def is_paper_gpt(self) -> bool:
        """True when the paper's closed-form formulas apply exactly (4h GeLU MLP, MHA)."""
        return self.ffn_size == 4 * self.hidden and self.kv == self.heads and not self.gated_mlp

    @property
    def label(self) -> str:
        return self.name or f"l{self.layers}-h{self.hidden}-a{self.heads}"

    @property
    def features(self) -> str:
        """What the dimensions do not say, in words: ``SwiGLU MLP, fused attention, no dropout,
        untied head, no position table``."""
        return ", ".join([
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
_ALIASES = {"gpt-18.4b": "gpt-18b", "gpt-39.1b": "gpt-39b", "gpt-76.1b": "gpt-76b",
            "gpt-145.6b": "gpt-145b", "gpt-310.1b": "gpt-310b", "gpt-529.6b": "gpt-530b",
            "gpt-1008b": "gpt-1t"}


def get_model(name: str) -> ModelSpec:
    """The preset called ``name``; the error lists the known ones."""
    key = _ALIASES.get(name.lower(), name.lower())
    if key not in PRESETS:
        raise PlanError(f"unknown model preset {name!r}; known: {', '.join(PRESETS)}")
    return PRESETS[key]


def param_count(spec: ModelSpec) -> int:
    """Exact parameter count (weights and biases, tied embedding counted once; an untied head
    adds its V h, a position table its s h).

    For the paper's GPT this is ``12 l h^2 (1 + 13/(12 h) + (V + s)/(12 l h)) + 2h``
    (the 2h is the final LayerNorm, which the paper's formula leaves out).
    """
    tables = spec.vocab * (1 if spec.tied_head else 2) + (spec.seq_len if spec.learned_positions else 0)
    return spec.layers * _layer_params(spec, 1)[0] + tables * spec.hidden + 2 * spec.hidden


def _layer_params(spec: ModelSpec, t: int) -> tuple[int, int]:
    """(parameters of one layer held by one of t ranks, of which replicated)."""
    h, n, f = spec.hidden, spec.head_dim, spec.ffn_size
    qkv = (spec.heads + 2 * spec.kv) * n
    split = h * qkv + qkv + h * h  # QKV weight + bias (column-split), proj weight (row-split)
    n_in = 2 if spec.gated_mlp else 1
    split += n_in * (h * f + f) + f * h  # fc1 (+gate) weight + bias, fc2 weight
    replicated = h + h + 4 * h  # proj bias, fc2 bias (added after the reduction), 2 LayerNorms
    return split // t + replicated, replicated


def params_per_stage(spec: ModelSpec, t: int, p: int) -> list[int]:
    """Parameters held by one GPU of each pipeline stage 0..p-1.

    Layers are spread evenly (the largest stage gets ceil(l/p)); stage 0 holds
    the vocabulary-parallel word embedding (V h / t) and the position embedding
    (s h, replicated, with ``learned_positions``); the last stage holds the final
    LayerNorm and the LM head's V h / t: its own copy of the tied word embedding
    when p > 1, the head's own weight when untied.
    """
    per_layer = _layer_params(spec, t)[0]
    base, extra = divmod(spec.layers, p)
    out = []
    for r in range(p):
        n = (base + (1 if r < extra else 0)) * per_layer
        if r == 0:
            n += math.ceil(spec.vocab / t) * spec.hidden + (spec.seq_len * spec.hidden if spec.learned_positions else 0)
        if r == p - 1:
            head = p > 1 or not spec.tied_head
            n += 2 * spec.hidden + (math.ceil(spec.vocab / t) * spec.hidden if head else 0)
        out.append(n)
    return out
