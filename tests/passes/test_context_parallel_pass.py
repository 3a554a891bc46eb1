"""Context parallelism in the compiler (no process group): what the pass finds and rewrites, and what it refuses.

The rank graph of a cp program runs on one rank's S/cp tokens: every batch
tensor with the attention's sequence length is split along it, every attention
(``scaled_dot_product_attention`` or written out) is one ``cp_attention``,
whole-sequence values (position tables, rotary tables) are cut to the rank's
positions by ``cp_tokens``, and the mask a model builds is read as causal or
full from sampled positions. Each refusal names the node and its source line.
Numbers: tokens per rank in the local shapes, the ring's bytes per microbatch.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import transformers as T

import autopar
from autopar.compiler.context_report import ring_bytes
from autopar.core.comm.context_parallel import cp_attention, cp_tokens
from autopar.core.comm.cp_layout import ContextParallelError
from autopar.reference.models import build

SEQ, VOCAB = 16, 64
HF = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
          num_key_value_heads=2, max_position_embeddings=64)


def _ids(seq: int = SEQ) -> torch.Tensor:
    return torch.randint(0, VOCAB, (2, seq), generator=torch.Generator().manual_seed(0))


def _compile(model: nn.Module, cp: int = 2, seq: int = SEQ, extra: tuple = (), **layout) -> autopar.ParallelProgram:
    x = _ids(seq)
    world = cp * layout.get("tp", 1) * layout.get("pp", 1) * layout.get("dp", 1)
    return autopar.parallelize(model, cp=cp, world_size=world, example_inputs=(x, *extra), example_targets=x.clone(),
                               **layout)


def _calls(program, fn) -> list:
    return [n for n in program.rank_module.graph.nodes if n.op == "call_function" and n.target is fn]


def test_reference_gpt_split_along_its_tokens():
    torch.manual_seed(0)
    program = _compile(build("gpt", vocab_size=VOCAB, seq_len=SEQ, n_layer=2, n_head=4, d_model=32), cp=2)
    split = program.context
    assert (split.cp, split.balanced, split.seq_len) == (2, True, SEQ)
    assert split.seq_dims == {"idx": 1, "targets": 1}
    assert len(_calls(program, cp_attention)) == 2  # one ring attention per layer, causal
    assert all(n.args[5] is True and n.args[6] is True for n in _calls(program, cp_attention))
    narrowed = _calls(program, cp_tokens)
    assert len(narrowed) == 1 and narrowed[0].args[0].args[0].name == "p_model_wpe_weight"  # the learned positions
    shapes = program.local_shapes()
    assert shapes["layer_norm"] == (2, SEQ // 2, 32)  # every layer on 8 of the 16 tokens
    # K and V of (2, 4, 8, 8) fp32 per layer, one hop: 4 KiB forward; the backward adds fp32 dK, dV
    assert ring_bytes(program) == {"forward": 2 * 4096, "backward": 2 * 8192}
    text = program.summary()
    assert "Context parallelism cp=2: the sequence of 16 tokens split 2 ways, 8 per rank" in text
    assert "rank r holds chunks r and 3-r" in text and "2 layer(s) as ring attention (2 causal" in text


@pytest.mark.parametrize("name", ["llama", "gpt2-eager", "bert"])
def test_hf_attention_and_positions_found(name):
    """Llama: rotary tables cut to the rank's positions, the causal mask it builds read as causal;
    GPT-2 written out (eager): softmax(q k^T / sqrt(d) + mask) v found and replaced whole; BERT: the
    all-true mask read as attention over every token, the contiguous layout."""
    torch.manual_seed(0)
    if name == "llama":
        model = T.LlamaForCausalLM(T.LlamaConfig(**HF))
    elif name == "gpt2-eager":
        model = T.GPT2LMHeadModel(T.GPT2Config(vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=4, n_positions=64,
                                               attn_pdrop=0.0, resid_pdrop=0.0, embd_pdrop=0.0,
                                               _attn_implementation="eager"))
    else:
        model = T.BertForMaskedLM(T.BertConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=48,
                                               num_hidden_layers=2, num_attention_heads=4, max_position_embeddings=64,
                                               hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0))
    program = _compile(model, cp=4)
    rings = _calls(program, cp_attention)
    assert len(rings) == 2
    causal = name != "bert"
    assert program.context.balanced is causal and all(n.args[5] is causal for n in rings)
    ops = {str(n.target) for n in program.rank_module.graph.nodes if n.op == "call_function"}
    assert "aten.softmax.int" not in ops and "aten.scaled_dot_product_attention.default" not in ops
    if name == "llama":  # cos and sin of each layer, at the rank's positions
        assert len(_calls(program, cp_tokens)) == 4


def test_tensor_parallel_inside_context_parallel():
    torch.manual_seed(0)
    program = _compile(build("gpt", vocab_size=VOCAB, seq_len=SEQ, n_layer=2, n_head=4, d_model=32), cp=2, tp=2)
    rings = _calls(program, cp_attention)
    assert len(rings) == 2
    shapes = program.local_shapes()
    q = rings[0].args[1].name
    assert shapes[q] == (2, 4 // 2, SEQ // 2, 8)  # heads split by tp, tokens by cp


def _refused(match: str, model: nn.Module, **kwargs) -> None:
    with pytest.raises(ContextParallelError, match=match):
        _compile(model, **kwargs)


def test_what_cp_refuses_names_the_node_and_the_fix():
    torch.manual_seed(0)
    llama = T.LlamaForCausalLM(T.LlamaConfig(**HF))
    _refused(r"2\*cp = 8 equal chunks, but the sequence length is 18 \(18 % 8 = 2\).*multiple of 8 \(here 24 tokens\)",
             llama, cp=4, seq=18)
    _refused(r"node scaled_dot_product_attention in model.layers.0.self_attn \(modeling_mistral.py:\d+.*neither "
             r"causal nor all true \(a sliding window", T.MistralForCausalLM(T.MistralConfig(sliding_window=4, **HF)))

    class WithPadding(nn.Module):
        def __init__(self):
            super().__init__()
            self.m = llama

        def forward(self, ids, mask):
            return self.m(input_ids=ids, attention_mask=mask).logits

    _refused(r"computed from the input mask \(a padding mask\).*Fix: cp=1", WithPadding(),
             extra=(torch.ones(2, SEQ, dtype=torch.long),))
    _refused(r"drops attention weights \(dropout_p=0.1\).*Fix: attention dropout 0",
             T.GPT2LMHeadModel(T.GPT2Config(vocab_size=VOCAB, n_embd=32, n_layer=1, n_head=4, n_positions=64)))
    _refused(r"Sequential has no attention autopar can rewrite", nn.Sequential(nn.Embedding(VOCAB, 32),
                                                                                nn.Linear(32, VOCAB)))

    class Cumulative(nn.Module):
        def __init__(self):
            super().__init__()
            self.m = llama

        def forward(self, ids):
            return self.m(input_ids=ids).logits.cumsum(1)

    _refused(r"node cumsum in the model \(test_context_parallel_pass.py:\d+ .*cumsum.*\) needs the whole sequence",
             Cumulative())


def test_a_loss_the_ranks_cannot_join_is_refused():
    torch.manual_seed(0)
    model = build("gpt", vocab_size=VOCAB, seq_len=SEQ, n_layer=1, n_head=4, d_model=32)
    x = _ids()
    with pytest.raises(ContextParallelError, match=r"loss_reduction='microbatch'.*Fix: loss_reduction='tokens'"):
        autopar.parallelize(model, cp=2, world_size=2, example_inputs=(x,), example_targets=x.clone(),
                            loss_reduction="microbatch")
    with pytest.raises(ContextParallelError, match=r"needs a token-mean loss"):
        autopar.parallelize(model, cp=2, world_size=2, example_inputs=(x,), example_targets=x.clone(),
                            loss_fn=lambda logits, y: logits.float().pow(2).mean())
