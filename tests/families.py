"""Model families the tests run: built deterministically, in any process."""

from __future__ import annotations

import contextlib
import math

import torch
import torch.nn as nn
import torch.nn.functional as F

from autopar.reference.models import GPT, MLP, ModelConfig, build

BATCH, SEQ = 2, 16


def _hf_gpt2(vocab: int, layers: int = 2) -> nn.Module:
    import transformers

    cfg = transformers.GPT2Config(vocab_size=vocab, n_positions=SEQ, n_embd=64, n_layer=layers, n_head=4,
                                  resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                                  bos_token_id=0, eos_token_id=0)
    return transformers.GPT2LMHeadModel(cfg)


def _hf_llama(vocab: int, layers: int = 2) -> nn.Module:
    import transformers

    cfg = transformers.LlamaConfig(vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
                                   num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=SEQ,
                                   bos_token_id=0, eos_token_id=0, pad_token_id=None)
    return transformers.LlamaForCausalLM(cfg)


def hf_gptj(vocab: int = 320, layers: int = 2) -> nn.Module:
    """GPT-J: parallel blocks (attention and the MLP read the same normed input, one all-reduce per
    layer); not in FAMILIES, whose structural tests count two all-reduces per layer."""
    import transformers

    cfg = transformers.GPTJConfig(vocab_size=vocab, n_positions=SEQ, n_embd=64, n_layer=layers, n_head=4,
                                  rotary_dim=8, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                                  bos_token_id=0, eos_token_id=0)
    return transformers.GPTJForCausalLM(cfg)


class SortMLP(MLP):
    """An MLP with a side op (sort over the split dim) that has no sharding rule."""

    def forward(self, x):
        h = F.gelu(self.fc(x))
        return self.proj(h) + h.sort(dim=-1).values[..., -1:]


class GPTWithFallback(GPT):
    def __init__(self, cfg: ModelConfig):
        super().__init__(cfg)
        for block in self.h:
            block.mlp = SortMLP(cfg)


# name -> (factory(vocab) -> model, vocabulary size). Vocabularies differ from
# every hidden/FFN size so a full-vocabulary dim is recognisable; 257 is prime.
FAMILIES = {
    "nanogpt": (lambda v, n=2: build("gpt", vocab_size=v, seq_len=SEQ, n_layer=n, n_head=4, d_model=64), 320),
    "gpt2-fused": (lambda v, n=2: build("gpt2-fused", vocab_size=v, seq_len=SEQ, n_layer=n, n_head=4, d_model=64),
                   257),
    "llama": (lambda v, n=2: build("llama", vocab_size=v, seq_len=SEQ, n_layer=n, n_head=8, n_kv_head=4,
                                   d_model=64, d_ff=96), 320),
    "hf-gpt2": (_hf_gpt2, 257),
    "hf-llama": (_hf_llama, 320),
}


def tiny_mixtral(seed: int | None = 0, device: str | None = None, **config) -> nn.Module:
    """A small HuggingFace Mixtral (4 experts, top-2, one layer of width 16 unless ``config`` says
    otherwise), seeded first unless ``seed`` is None, built on ``device`` (e.g. 'meta') if given."""
    import transformers

    cfg = transformers.MixtralConfig(**{**dict(vocab_size=64, hidden_size=16, intermediate_size=24,
                                                  num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=2,
                                                  num_local_experts=4, num_experts_per_tok=2), **config})
    if seed is not None:
        torch.manual_seed(seed)
    with torch.device(device) if device is not None else contextlib.nullcontext():
        return transformers.MixtralForCausalLM(cfg)


def make(family: str, seed: int = 0, layers: int = 2) -> tuple[nn.Module, int]:
    factory, vocab = FAMILIES[family]
    torch.manual_seed(seed)
    return factory(vocab, layers), vocab


def batches(vocab: int, steps: int = 3, seed: int = 1, rows: int = BATCH, seq: int = SEQ):
    """``steps`` batches of ``rows`` random sequences of ``seq`` token ids: ``[((inputs,), (targets,))]``."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(steps):
        x = torch.randint(0, vocab, (rows, seq), generator=g)
        y = torch.randint(0, vocab, (rows, seq), generator=g)
        out.append(((x,), (y,)))
    return out


def train_steps(engine, data, lr: float, clip: float | None = None):
    """AdamW steps on ``data`` (a list of (inputs, targets)); each step's loss and full (clipped) gradients."""
    opt = torch.optim.AdamW(engine.parameters(), lr=lr)
    losses, grads = [], []
    for inputs, targets in data:
        losses.append(engine.train_step(*inputs, *targets))
        if clip is not None:
            engine.clip_grad_norm_(clip)
        grads.append(engine.full_grads())
        opt.step()
        opt.zero_grad()
    return losses, grads


# After an AdamW step, whose first update lr*sign(g) turns gradient elements that are zero up to
# rounding into +-lr steps, gradients are compared per tensor: ||g - g_ref|| <= 1e-4 ||g_ref|| + 1e-6.
AFTER_ADAMW = {"rel_norm": 1e-4, "atol": 1e-6, "rtol": 1e-5}


def assert_steps_match(ref_losses, ref_grads, losses, grads, label: str) -> None:
    """Every step's losses so far and gradients: the first element-wise (FP32_TOLERANCE), later ones per tensor."""
    from autopar.reference.parity import FP32_TOLERANCE, assert_parity

    for step in range(len(grads)):
        tol = FP32_TOLERANCE if step == 0 else AFTER_ADAMW
        assert_parity(ref_losses[: step + 1], ref_grads[step], losses[: step + 1], grads[step],
                      label=f"{label} step {step}", **tol)


def make_fallback_model() -> tuple[nn.Module, int]:
    torch.manual_seed(0)
    return GPTWithFallback(ModelConfig(vocab_size=320, seq_len=SEQ, n_layer=2, n_head=4, d_model=64)), 320


# ------------------------------------------------------------------ Meta's Llama, as its reference code writes it
# rotary embeddings through complex numbers, attention written out (q @ k^T, a mask, softmax) or with
# torch.einsum, SwiGLU, RMSNorm by hand: the blocks of the model forms and layer discovery tests
META_DIM, META_HEADS = 64, 4
META_HEAD_DIM = META_DIM // META_HEADS


def precompute_freqs_cis(dim, end, theta=10000.0):
    freqs = 1.0 / (theta ** (torch.arange(0, dim, 2)[: (dim // 2)].float() / dim))
    t = torch.arange(end)
    freqs = torch.outer(t, freqs).float()
    return torch.polar(torch.ones_like(freqs), freqs)


def apply_rotary_emb(xq, xk, freqs_cis):
    xq_ = torch.view_as_complex(xq.float().reshape(*xq.shape[:-1], -1, 2))
    xk_ = torch.view_as_complex(xk.float().reshape(*xk.shape[:-1], -1, 2))
    fc = freqs_cis.view(1, xq_.shape[1], 1, xq_.shape[-1])
    xq_out = torch.view_as_real(xq_ * fc).flatten(3)
    xk_out = torch.view_as_real(xk_ * fc).flatten(3)
    return xq_out.type_as(xq), xk_out.type_as(xk)


class RMSNorm(nn.Module):
    def __init__(s, d, eps=1e-6):
        super().__init__()
        s.eps = eps
        s.weight = nn.Parameter(torch.ones(d))

    def forward(s, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + s.eps) * s.weight


class MetaAttn(nn.Module):  # complex rope, attention written out (or with einsum)
    def __init__(s, einsum=False):
        super().__init__()
        s.einsum = einsum
        s.wq, s.wk, s.wv, s.wo = (nn.Linear(META_DIM, META_DIM, bias=False) for _ in range(4))

    def forward(s, x, freqs_cis):
        b, t, _ = x.shape
        q, k, v = (w(x).view(b, t, META_HEADS, META_HEAD_DIM) for w in (s.wq, s.wk, s.wv))
        q, k = apply_rotary_emb(q, k, freqs_cis)
        if s.einsum:
            scores = torch.einsum("bqhd,bkhd->bhqk", q, k) / math.sqrt(META_HEAD_DIM)
            mask = torch.full((t, t), float("-inf")).triu(1)
            p = F.softmax(scores + mask, dim=-1)
            o = torch.einsum("bhqk,bkhd->bqhd", p, v).reshape(b, t, META_DIM)
        else:
            q, k, v = (z.transpose(1, 2) for z in (q, k, v))
            scores = q @ k.transpose(2, 3) / math.sqrt(META_HEAD_DIM)
            scores = scores + torch.full((t, t), float("-inf")).triu(1)
            o = (F.softmax(scores.float(), dim=-1).type_as(q) @ v).transpose(1, 2).contiguous().view(b, t, META_DIM)
        return s.wo(o)


class FF(nn.Module):
    def __init__(s):
        super().__init__()
        s.w1 = nn.Linear(META_DIM, 96, bias=False)
        s.w2 = nn.Linear(96, META_DIM, bias=False)
        s.w3 = nn.Linear(META_DIM, 96, bias=False)

    def forward(s, x):
        return s.w2(F.silu(s.w1(x)) * s.w3(x))


class TB(nn.Module):
    def __init__(s, einsum):
        super().__init__()
        s.attention = MetaAttn(einsum)
        s.feed_forward = FF()
        s.attention_norm = RMSNorm(META_DIM)
        s.ffn_norm = RMSNorm(META_DIM)

    def forward(s, x, fc):
        h = x + s.attention(s.attention_norm(x), fc)
        return h + s.feed_forward(s.ffn_norm(h))


__all__ = ["FAMILIES", "make", "hf_gptj", "batches", "make_fallback_model", "train_steps", "assert_steps_match",
           "AFTER_ADAMW", "precompute_freqs_cis", "RMSNorm", "FF", "TB"]


class _ResidualTanh(nn.Module):
    def __init__(self, width: int):
        super().__init__()
        self.fc = nn.Linear(width, width)

    def forward(self, x):
        return x + torch.tanh(self.fc(x))


class TinyRegressor(nn.Module):
    """Two residual tanh blocks and a linear head to 4 outputs: a model with no tokens, for what needs
    a real program of two stages but no particular model (``forward(self, x)``)."""

    def __init__(self, width: int):
        super().__init__()
        self.blocks = nn.ModuleList([_ResidualTanh(width), _ResidualTanh(width)])
        self.head = nn.Linear(width, 4)

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return self.head(x)
