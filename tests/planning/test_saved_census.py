"""What a traced model saves for its backward, counted on its graph (``compiler/saved_census.py``), against
the paper's per-layer formula (the reference GPT keeps what it counts) and against what an HF Llama's
layer is made of (RMSNorm, rotary positions, SwiGLU: what the formula does not count)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from autopar.compiler.model_spec import spec_from_model
from autopar.planning.cost.activations import activation_bytes_per_layer, head_kept_bytes
from autopar.planning.cost.precision import RUNTIME_FP32
from autopar.reference.models import build

SEQ, VOCAB, HIDDEN, HEADS = 64, 512, 128, 4


def _spec(model):
    torch.manual_seed(0)
    x = torch.randint(0, VOCAB, (1, SEQ))
    return spec_from_model(model, (x,), x)


def test_reference_gpt_layer_saves_what_the_formula_counts():
    spec = _spec(build("gpt", vocab_size=VOCAB, seq_len=SEQ, n_layer=2, n_head=HEADS, d_model=HIDDEN))
    formula = dataclasses.replace(spec, saved=None)
    for t, sp in ((1, False), (2, False), (2, True)):
        for b in (1, 3):
            # the GPT layer (LayerNorm kernels, fused attention, GeLU MLP) is the formula's layer, byte for byte
            assert activation_bytes_per_layer(spec, b, t, sp, RUNTIME_FP32) == \
                activation_bytes_per_layer(formula, b, t, sp, RUNTIME_FP32), (t, sp, b)
    layer = spec.saved.layer
    # per token: LN1 and LN2 inputs and outputs (4h) and their mean and 1/std (4 floats) stay whole
    assert layer.seq == 4 * HIDDEN + 4
    # Q, K, V, the attention's output, its log-sum-exp per head, GeLU's input and fc2's input: split over t
    assert layer.split == 4 * HIDDEN + HEADS + 2 * spec.ffn_size
    # the head: the final LayerNorm's input and output and 2 statistics (whole), the logits' softmax (split)
    assert spec.saved.head.seq == 2 * HIDDEN + 2 and spec.saved.head.split == pytest.approx(VOCAB, abs=1)


def test_hf_llama_layer_counts_its_norms_rotary_and_gated_mlp():
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=352, num_hidden_layers=2,
                                      num_attention_heads=HEADS, num_key_value_heads=HEADS // 2,
                                      max_position_embeddings=SEQ, bos_token_id=0, eos_token_id=0, pad_token_id=None)
    torch.manual_seed(0)
    spec = _spec(transformers.LlamaForCausalLM(config))
    layer, d = spec.saved.layer, spec.head_dim
    # two RMSNorms, each keeping its input, the normalised product and the projections' input (3h), and a rsqrt
    assert layer.seq == 6 * HIDDEN + 2
    # rotary positions: cos and sin of one head, whatever t or the heads
    assert layer.whole == 2 * d
    # at least Q, K, V, the output, the log-sum-exp and the SwiGLU's gate, up, SiLU and product (4 f)
    assert layer.split >= (HEADS + 2 * spec.kv + HEADS) * d + HEADS + 4 * spec.ffn_size
    formula = dataclasses.replace(spec, saved=None)
    counted = activation_bytes_per_layer(spec, 1, 1, False, RUNTIME_FP32)
    assert counted > 1.3 * activation_bytes_per_layer(formula, 1, 1, False, RUNTIME_FP32)
    # the final RMSNorm keeps 3h, the LayerNorm formula 2h and two statistics
    assert head_kept_bytes(spec, 1, 1, False, RUNTIME_FP32) > head_kept_bytes(formula, 1, 1, False, RUNTIME_FP32)
