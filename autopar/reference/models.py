"""Small reference transformers in the three shapes autopar must handle.

They are ordinary PyTorch code written the way people write models (nothing in
them knows about parallelism): examples, tests and benches use them.

- ``GPT``       nanoGPT-style: separate Q/K/V projections, GELU MLP, LayerNorm,
                learned positions, LM head tied to the token embedding.
- ``GPT2Fused`` GPT-2-style block: one fused QKV projection split into q, k, v,
                biases everywhere, untied LM head.
- ``Llama``     RMSNorm, SwiGLU MLP, rotary position embeddings, grouped-query
                attention (fewer key/value heads than query heads), no biases.

Each draws its matrices and biases from N(0, 0.02) when built. Each also has
``_init_weights(module)``, HuggingFace's convention, doing the same to one
module's own parameters, so a model built on the meta device is initialised
from the same distributions by ``autopar.init_weights`` or ``materialize``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

from autopar.core.errors import AutoparError

__all__ = ["ModelConfig", "GPT", "GPT2Fused", "Llama", "build", "ModelFamilyError"]


class ModelFamilyError(AutoparError, ValueError):
    """A reference model family that does not exist; the message lists those that do."""


@dataclass(frozen=True)
class ModelConfig:
    vocab_size: int = 256
    """Number of token ids."""
    seq_len: int = 32
    """Maximum sequence length (positions)."""
    n_layer: int = 2
    """Number of transformer blocks."""
    n_head: int = 4
    """Attention (query) heads."""
    n_kv_head: int | None = None
    """Key/value heads (grouped-query attention); None means n_head."""
    d_model: int = 64
    """Hidden size h."""
    d_ff: int | None = None
    """MLP inner size; None means 4h."""
    dropout: float = 0.0
    """Dropout probability (0 for exact parity tests)."""
    tie_embeddings: bool = True
    """Share the token-embedding matrix with the LM head."""

    @property
    def kv_heads(self) -> int:
        return self.n_kv_head or self.n_head

    @property
    def ffn(self) -> int:
        return self.d_ff or 4 * self.d_model


# --------------------------------------------------------------------------- GPT


class CausalSelfAttention(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.n_head = cfg.n_head
        self.q = nn.Linear(cfg.d_model, cfg.d_model)
        self.k = nn.Linear(cfg.d_model, cfg.d_model)
        self.v = nn.Linear(cfg.d_model, cfg.d_model)
        self.proj = nn.Linear(cfg.d_model, cfg.d_model)
        self.dropout = cfg.dropout

    def forward(self, x):
        B, T, C = x.shape
        hd = C // self.n_head
        q = self.q(x).view(B, T, self.n_head, hd).transpose(1, 2)  # (B, nh, T, hd)
        k = self.k(x).view(B, T, self.n_head, hd).transpose(1, 2)
        v = self.v(x).view(B, T, self.n_head, hd).transpose(1, 2)
        y = F.scaled_dot_product_attention(
            q, k, v, is_causal=True, dropout_p=self.dropout if self.training else 0.0
        )
        y = y.transpose(1, 2).contiguous().view(B, T, C)
        return self.proj(y)


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.fc = nn.Linear(cfg.d_model, cfg.ffn)
        self.proj = nn.Linear(cfg.ffn, cfg.d_model)
        self.drop = nn.Dropout(cfg.dropout)

    def forward(self, x):
        return self.drop(self.proj(F.gelu(self.fc(x))))


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.ln_1 = nn.LayerNorm(cfg.d_model)
        self.attn = CausalSelfAttention(cfg)
        self.ln_2 = nn.LayerNorm(cfg.d_model)
        self.mlp = MLP(cfg)

    def forward(self, x):
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        self.wte = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.wpe = nn.Embedding(cfg.seq_len, cfg.d_model)
        self.drop = nn.Dropout(cfg.dropout)
        self.h = nn.ModuleList([Block(cfg) for _ in range(cfg.n_layer)])
        self.ln_f = nn.LayerNorm(cfg.d_model)
        self.lm_head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        if cfg.tie_embeddings:
            self.lm_head.weight = self.wte.weight
        _init(self, cfg)

    def _init_weights(self, module: nn.Module) -> None:
        _init_module(module)

    def forward(self, idx):
        B, T = idx.shape
        pos = torch.arange(T, device=idx.device)
        x = self.drop(self.wte(idx) + self.wpe(pos))
        for block in self.h:
            x = block(x)
        return self.lm_head(self.ln_f(x))  # (B, T, V)


# ------------------------------------------------------------- GPT-2, fused QKV


class FusedAttention(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.n_head = cfg.n_head
        self.c_attn = nn.Linear(cfg.d_model, 3 * cfg.d_model)
        self.c_proj = nn.Linear(cfg.d_model, cfg.d_model)

    def forward(self, x):
        B, T, C = x.shape
        q, k, v = self.c_attn(x).split(C, dim=2)  # each (B, T, C)
        hd = C // self.n_head
        q = q.view(B, T, self.n_head, hd).transpose(1, 2)
        k = k.view(B, T, self.n_head, hd).transpose(1, 2)
        v = v.view(B, T, self.n_head, hd).transpose(1, 2)
        att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(hd))  # (B, nh, T, T)
        mask = torch.ones(T, T, dtype=torch.bool, device=x.device).tril()
        att = att.masked_fill(~mask, float("-inf")).softmax(dim=-1)
        y = (att @ v).transpose(1, 2).reshape(B, T, C)
        return self.c_proj(y)


class FusedBlock(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.ln_1 = nn.LayerNorm(cfg.d_model)
        self.attn = FusedAttention(cfg)
        self.ln_2 = nn.LayerNorm(cfg.d_model)
        self.mlp = MLP(cfg)

    def forward(self, x):
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT2Fused(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        self.wte = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.wpe = nn.Embedding(cfg.seq_len, cfg.d_model)
        self.h = nn.ModuleList([FusedBlock(cfg) for _ in range(cfg.n_layer)])
        self.ln_f = nn.LayerNorm(cfg.d_model)
        self.lm_head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        _init(self, cfg)

    def _init_weights(self, module: nn.Module) -> None:
        _init_module(module)

    def forward(self, idx):
        T = idx.shape[1]
        x = self.wte(idx) + self.wpe(torch.arange(T, device=idx.device))
        for block in self.h:
            x = block(x)
        return self.lm_head(self.ln_f(x))


# ----------------------------------------------------------------------- Llama


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def reset_parameters(self) -> None:
        nn.init.ones_(self.weight)

    def forward(self, x):
        var = x.pow(2).mean(-1, keepdim=True)
        return self.weight * (x * torch.rsqrt(var + self.eps))


def rotary_tables(seq_len: int, head_dim: int, device=None, base: float = 10000.0):
    inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, device=device).float() / head_dim))
    t = torch.arange(seq_len, device=device).float()
    freqs = torch.outer(t, inv_freq)  # (T, hd/2)
    emb = torch.cat((freqs, freqs), dim=-1)  # (T, hd)
    return emb.cos(), emb.sin()


def rotate_half(x):
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


class LlamaAttention(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.n_head, self.n_kv = cfg.n_head, cfg.kv_heads
        self.hd = cfg.d_model // cfg.n_head
        self.wq = nn.Linear(cfg.d_model, self.n_head * self.hd, bias=False)
        self.wk = nn.Linear(cfg.d_model, self.n_kv * self.hd, bias=False)
        self.wv = nn.Linear(cfg.d_model, self.n_kv * self.hd, bias=False)
        self.wo = nn.Linear(self.n_head * self.hd, cfg.d_model, bias=False)

    def forward(self, x, cos, sin):
        B, T, _ = x.shape
        q = self.wq(x).view(B, T, self.n_head, self.hd).transpose(1, 2)
        k = self.wk(x).view(B, T, self.n_kv, self.hd).transpose(1, 2)
        v = self.wv(x).view(B, T, self.n_kv, self.hd).transpose(1, 2)
        q = q * cos + rotate_half(q) * sin
        k = k * cos + rotate_half(k) * sin
        rep = self.n_head // self.n_kv
        k = k[:, :, None].expand(B, self.n_kv, rep, T, self.hd).reshape(B, self.n_head, T, self.hd)
        v = v[:, :, None].expand(B, self.n_kv, rep, T, self.hd).reshape(B, self.n_head, T, self.hd)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.wo(y.transpose(1, 2).reshape(B, T, -1))


class SwiGLU(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.w1 = nn.Linear(cfg.d_model, cfg.ffn, bias=False)
        self.w3 = nn.Linear(cfg.d_model, cfg.ffn, bias=False)
        self.w2 = nn.Linear(cfg.ffn, cfg.d_model, bias=False)

    def forward(self, x):
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class LlamaBlock(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.attention_norm = RMSNorm(cfg.d_model)
        self.attention = LlamaAttention(cfg)
        self.ffn_norm = RMSNorm(cfg.d_model)
        self.feed_forward = SwiGLU(cfg)

    def forward(self, x, cos, sin):
        x = x + self.attention(self.attention_norm(x), cos, sin)
        return x + self.feed_forward(self.ffn_norm(x))


class Llama(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        self.tok_embeddings = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.layers = nn.ModuleList([LlamaBlock(cfg) for _ in range(cfg.n_layer)])
        self.norm = RMSNorm(cfg.d_model)
        self.output = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        _init(self, cfg)

    def _init_weights(self, module: nn.Module) -> None:
        _init_module(module)

    def forward(self, tokens):
        T = tokens.shape[1]
        cos, sin = rotary_tables(T, self.cfg.d_model // self.cfg.n_head, tokens.device)
        x = self.tok_embeddings(tokens)
        for layer in self.layers:
            x = layer(x, cos, sin)
        return self.output(self.norm(x))


# ----------------------------------------------------------------------- common


def _init(model: nn.Module, cfg: ModelConfig) -> None:
    for name, p in model.named_parameters():
        if p.device.type == "meta":
            continue
        if p.dim() >= 2:
            nn.init.normal_(p, std=0.02)
        elif name.endswith("bias"):
            nn.init.normal_(p, std=0.02)  # non-zero so bias handling is tested


def _init_module(module: nn.Module) -> None:
    """``_init`` for one module's own parameters (the models' ``_init_weights``)."""
    for name, p in module.named_parameters(recurse=False):
        if p.dim() >= 2 or name.endswith("bias"):
            nn.init.normal_(p, std=0.02)


FAMILIES = {"gpt": GPT, "gpt2-fused": GPT2Fused, "llama": Llama}


def build(family: str, cfg: ModelConfig | None = None, **overrides) -> nn.Module:
    """Build a reference model by family name: ``gpt``, ``gpt2-fused`` or ``llama``."""
    if family not in FAMILIES:
        raise ModelFamilyError(f"unknown model family {family!r}; choose one of {sorted(FAMILIES)}")
    cfg = cfg or ModelConfig(**overrides)
    return FAMILIES[family](cfg)
