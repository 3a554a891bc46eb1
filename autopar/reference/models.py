"""Small reference transformers in the three shapes autopar must handle.

They are ordinary PyTorch code written the way people write models (nothing in
them knows about parallelism): examples, tests and benches use them.

- ``GPT``       nanoGPT-style: separate Q/K/V projections, GELU MLP, LayerNorm,
                learned positions, LM head tied to the token embedding.
- ``GPT2Fused`` GPT-2-style block: one fused QKV projection split into q, k, v,
                biases everywhere, untied LM head.
- ``Llama``     RMSNorm, SwiGLU MLP, rotary position embeddings, grouped-query
                attention (fewer key/value heads than query heads), no biases.

- ``MoEGPT``    (``gpt-moe``) the GPT with mixture-of-experts MLPs: a router's
                top-k, token rows sorted by expert, stacked SwiGLU experts applied
                by grouped matmuls (``grouped_mm.py``), an optional shared expert
                and dense first layers; the router's load-balancing and z losses
                in its output (the section's comment says why and how to train on them).

Each draws its matrices and biases from N(0, 0.02) when built. Each also has
``_init_weights(module)``, HuggingFace's convention, doing the same to one
module's own parameters, so a model built on the meta device is initialised
from the same distributions by ``autopar.init_weights`` or ``materialize``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import NamedTuple

import torch
import torch.nn as nn
import torch.nn.functional as F

from autopar.core.errors import AutoparError
from autopar.core.grouped_mm import grouped_mm

__all__ = ["ModelConfig", "GPT", "GPT2Fused", "Llama", "MoEConfig", "MoEGPT", "MoEOutput", "moe_lm_loss", "moe_outputs",
           "build", "ModelFamilyError", "MoEConfigError"]


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


# ------------------------------------------------------------------ mixture of experts
# A GPT whose MLP is a mixture of SwiGLU experts, written the way production MoE code is (Mixtral,
# Qwen2-MoE, DeepSeek-MoE, Megatron's token dispatcher), with static shapes throughout:
#
# 1. the router, a linear H -> E, softmax (in fp32), top-k experts per token, their probabilities
#    renormalised to sum to 1 (``norm_topk``);
# 2. the (token, slot) rows sorted by expert id, each row its token's hidden state; the cumulative rows
#    per expert are the group offsets (``histc`` over the E ids, then ``cumsum``: (E,) whatever the
#    routing);
# 3. the experts: stacked weights ``w_gate_up`` (E, H, 2F) and ``w_down`` (E, F, H) applied to each
#    expert's run of rows by a grouped matmul (``grouped_mm.py``), SwiGLU between them;
# 4. each row weighted by its routing probability, put back per token and the k slots summed
#    (``index_add`` over the token ids: Megatron's unpermute);
# 5. optionally a shared expert (a dense SwiGLU MLP every token goes through, DeepSeek-style, ungated)
#    added, and the first ``n_dense`` layers dense (DeepSeek's ``first_k_dense_replace``).
#
# Each MoE layer computes the router's two auxiliary losses over the tokens of the forward's batch (a
# microbatch, under autopar): load balancing (Switch Transformer, Mixtral), E * sum_e f_e * P_e, f_e the
# fraction of the rows sent to expert e (counted, no gradient), P_e the mean router probability of e;
# and the z-loss (ST-MoE), the mean over tokens of logsumexp(router logits)^2. A term whose coefficient
# is 0 is left out of the graph (as Megatron does).
#
# The model returns ``MoEOutput(logits, aux_loss)``, ``aux_loss`` the sum over the MoE layers of
# ``aux_loss_coef * balance + z_loss_coef * z``; the training loss is ``moe_lm_loss``: ``ce_weight``
# times the token-mean cross-entropy, plus ``aux_loss``. Why this shape: autopar traces
# ``loss_fn(output_fn(model(*inputs)), *targets)``, so the auxiliary terms reach the loss through the
# model's output; a loss reading a value the model stashed on itself (DeepSpeed's ``l_aux``) would read
# the wrong model as soon as the model is copied (the single-device reference run trains a deep copy).
# With autopar: ``output_fn=moe_outputs, loss_fn=model.loss`` trains on CE + aux (``train_step`` and
# ``eval_step`` return that loss); the defaults (``output_fn`` picks ``.logits``, cross-entropy) train on
# the cross-entropy alone, and then ``eval_step(outputs=True)`` can return the logits (it needs
# ``output_fn`` to return a tensor).


class MoEConfigError(AutoparError, ValueError):
    """A ``MoEConfig`` that cannot be built: the message names the option and the values that fit."""


@dataclass(frozen=True)
class MoEConfig(ModelConfig):
    n_experts: int = 8
    """E: routed experts per MoE layer."""
    top_k: int = 2
    """k: experts each token is sent to."""
    d_expert: int | None = None
    """F: each routed expert's SwiGLU inner size; None means d_ff (4h when that is None too)."""
    norm_topk: bool = True
    """Renormalise the k chosen probabilities to sum to 1 (Mixtral) or keep them as the softmax gave
    them (Qwen2-MoE's default, DeepSeek)."""
    d_shared: int = 0
    """The shared expert's SwiGLU inner size (a dense MLP added for every token); 0: none."""
    n_dense: int = 0
    """The first n_dense layers have a dense SwiGLU MLP (inner size d_ff) instead of experts."""
    aux_loss_coef: float = 0.01
    """The load-balancing loss's weight in ``aux_loss``."""
    z_loss_coef: float = 0.001
    """The router z-loss's weight in ``aux_loss``."""
    ce_weight: float = 1.0
    """The cross-entropy's weight in ``moe_lm_loss`` (0: the auxiliary losses alone)."""

    @property
    def expert_ffn(self) -> int:
        return self.d_expert or self.ffn


class MoEOutput(NamedTuple):
    """What ``MoEGPT`` returns: the logits (B, T, V) and the weighted auxiliary router losses (a scalar)."""

    logits: torch.Tensor
    aux_loss: torch.Tensor


def moe_outputs(output: MoEOutput) -> MoEOutput:
    """``output_fn`` for training on ``moe_lm_loss``: the whole output (logits and auxiliary loss)."""
    return output


def moe_lm_loss(output: MoEOutput | torch.Tensor, targets: torch.Tensor, ce_weight: float = 1.0) -> torch.Tensor:
    """``ce_weight`` x token-mean cross-entropy of the logits + the auxiliary router losses.

    ``output``: a ``MoEOutput`` (``output_fn=moe_outputs``), or the logits alone (then the
    cross-entropy alone). ``MoEGPT.loss`` passes the model's own ``ce_weight``.
    """
    if isinstance(output, torch.Tensor):
        return F.cross_entropy(output.flatten(0, -2), targets.flatten())
    ce = F.cross_entropy(output.logits.flatten(0, -2), targets.flatten())
    return (ce if ce_weight == 1.0 else ce_weight * ce) + output.aux_loss


class SwiGLUMLP(nn.Module):
    """A dense SwiGLU MLP, no biases (the shared expert, a dense layer's MLP)."""

    def __init__(self, d_model: int, d_ff: int):
        super().__init__()
        self.gate = nn.Linear(d_model, d_ff, bias=False)
        self.up = nn.Linear(d_model, d_ff, bias=False)
        self.down = nn.Linear(d_ff, d_model, bias=False)

    def forward(self, x):
        return self.down(F.silu(self.gate(x)) * self.up(x))


class MoE(nn.Module):
    """Router, top-k, sorted rows, grouped SwiGLU experts, weighted unsort (the section's comment above).

    ``forward(x (B, T, H)) -> (y (B, T, H), aux)``, ``aux`` the layer's weighted router losses.
    """

    def __init__(self, cfg: MoEConfig):
        super().__init__()
        if not 1 <= cfg.top_k <= cfg.n_experts:
            raise MoEConfigError(f"top_k={cfg.top_k} experts per token out of n_experts={cfg.n_experts}: "
                                 f"choose 1 <= top_k <= n_experts")
        self.n_experts, self.top_k, self.norm_topk = cfg.n_experts, cfg.top_k, cfg.norm_topk
        self.aux_coef, self.z_coef = cfg.aux_loss_coef, cfg.z_loss_coef
        f = cfg.expert_ffn
        self.router = nn.Linear(cfg.d_model, cfg.n_experts, bias=False)
        self.w_gate_up = nn.Parameter(torch.empty(cfg.n_experts, cfg.d_model, 2 * f))
        self.w_down = nn.Parameter(torch.empty(cfg.n_experts, f, cfg.d_model))
        self.shared = SwiGLUMLP(cfg.d_model, cfg.d_shared) if cfg.d_shared else None

    def forward(self, x):
        B, T, H = x.shape
        E, k = self.n_experts, self.top_k
        tokens = x.reshape(B * T, H)
        logits = self.router(tokens)  # (N, E)
        probs = logits.float().softmax(dim=-1)
        top_p, top_i = probs.topk(k, dim=-1)  # (N, k)
        if self.norm_topk:
            top_p = top_p / top_p.sum(dim=-1, keepdim=True)
        # (token, slot) rows sorted by expert; each expert's run of rows is one group
        expert_ids, order = top_i.reshape(-1).sort(stable=True)  # (N k,)
        token_of_row = order // k
        rows = tokens[token_of_row]  # (N k, H)
        per_expert = torch.histc(expert_ids.float(), bins=E, min=0, max=E - 1)  # (E,): static shape
        offs = per_expert.cumsum(0).to(torch.int32)
        gate, up = grouped_mm(rows, self.w_gate_up, offs).chunk(2, dim=-1)
        out_rows = grouped_mm(F.silu(gate) * up, self.w_down, offs)  # (N k, H)
        weighted = out_rows * top_p.reshape(-1)[order].unsqueeze(-1).to(out_rows.dtype)
        y = torch.zeros_like(tokens).index_add(0, token_of_row, weighted.to(tokens.dtype))  # unsort, sum k
        if self.shared is not None:
            y = y + self.shared(tokens)
        aux = probs.new_zeros(())
        if self.aux_coef:  # a term with coefficient 0 is left out of the graph, as Megatron does
            balance = E * (per_expert / (B * T * k) * probs.mean(dim=0)).sum()
            aux = aux + self.aux_coef * balance
        if self.z_coef:
            aux = aux + self.z_coef * torch.logsumexp(logits.float(), dim=-1).pow(2).mean()
        return y.view(B, T, H), aux


class MoEBlock(nn.Module):
    def __init__(self, cfg: MoEConfig, dense: bool):
        super().__init__()
        self.ln_1 = nn.LayerNorm(cfg.d_model)
        self.attn = CausalSelfAttention(cfg)
        self.ln_2 = nn.LayerNorm(cfg.d_model)
        self.mlp = SwiGLUMLP(cfg.d_model, cfg.ffn) if dense else MoE(cfg)

    def forward(self, x, aux):
        x = x + self.attn(self.ln_1(x))
        h = self.mlp(self.ln_2(x))
        if isinstance(h, tuple):
            h, layer_aux = h
            aux = aux + layer_aux
        return x + h, aux


class MoEGPT(nn.Module):
    """The reference GPT with mixture-of-experts MLPs; returns ``MoEOutput(logits, aux_loss)``."""

    def __init__(self, cfg: MoEConfig):
        super().__init__()
        if cfg.dropout:
            raise MoEConfigError(f"MoEGPT has no dropout (dropout={cfg.dropout}): use dropout=0")
        self.cfg = cfg
        self.wte = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.wpe = nn.Embedding(cfg.seq_len, cfg.d_model)
        self.h = nn.ModuleList([MoEBlock(cfg, dense=i < cfg.n_dense) for i in range(cfg.n_layer)])
        self.ln_f = nn.LayerNorm(cfg.d_model)
        self.lm_head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        if cfg.tie_embeddings:
            self.lm_head.weight = self.wte.weight
        _init(self, cfg)

    def _init_weights(self, module: nn.Module) -> None:
        _init_module(module)

    def forward(self, idx) -> MoEOutput:
        T = idx.shape[1]
        x = self.wte(idx) + self.wpe(torch.arange(T, device=idx.device))
        aux = x.new_zeros((), dtype=torch.float32)
        for block in self.h:
            x, aux = block(x, aux)
        return MoEOutput(self.lm_head(self.ln_f(x)), aux)

    def loss(self, output: MoEOutput | torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """``moe_lm_loss`` with this model's ``ce_weight``: a ``loss_fn`` (with ``output_fn=moe_outputs``)."""
        return moe_lm_loss(output, targets, self.cfg.ce_weight)


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


FAMILIES = {"gpt": GPT, "gpt2-fused": GPT2Fused, "llama": Llama, "gpt-moe": MoEGPT}
CONFIGS = {"gpt-moe": MoEConfig}
"""A family's config class when it is not ``ModelConfig``."""


def build(family: str, cfg: ModelConfig | None = None, **overrides) -> nn.Module:
    """Build a reference model by family name: ``gpt``, ``gpt2-fused``, ``llama`` or ``gpt-moe`` (whose
    options are ``MoEConfig``'s)."""
    if family not in FAMILIES:
        raise ModelFamilyError(f"unknown model family {family!r}; choose one of {sorted(FAMILIES)}")
    cfg = cfg or CONFIGS.get(family, ModelConfig)(**overrides)
    return FAMILIES[family](cfg)
