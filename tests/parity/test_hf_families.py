"""More HuggingFace families, unmodified, on tp=2 x pp=2 gloo ranks (two layers: one per stage).

Qwen2 (biases on q/k/v, grouped-query attention), Phi-3 (fused QKV taken
apart with slices, fused gate/up chunked), OPT (learned positions with an
offset, a padding row in the tied embedding). Every linear is split (no
fallback, nothing left replicated) and loss and gradients match one process;
tolerances as in test_tp_parity.

Then families that write their blocks differently: GPT-NeoX (one QKV
projection interleaved per head, partial rotary, parallel residual), GPT-J
(parallel attention and MLP; for these and Falcon the two row-parallel outputs
are summed before one all-reduce), Gemma-2 (dtype casts, logit soft-capping,
GeGLU), Falcon (``x @ W.T`` linears), Qwen3 (RMSNorm per head on q and k),
BLOOM (ALiBi added by ``baddbmm`` to scores whose batch dim is batch x heads),
GPTBigCode (multi-query attention through one fused projection, which cannot
be split by key/value heads: it stays whole, and the plan says so), and three
mixtures of experts: Mixtral (stacked expert weights applied as grouped
matmuls, each expert's MLP split, the router whole), OLMoE (RMSNorm over the
whole q and k projections before heads: a local mean and one all-reduce) and
Qwen2-MoE (a shared expert gated by a one-feature linear, which stays whole),
GPT-OSS (experts stored (in, out) with biases, gate and up interleaved as
``h[..., ::2]`` and ``h[..., 1::2]``).
"""

import pytest
import torch
from families import train_steps
from helpers import assert_ranks_match, parallelize_on, reference_run, spawn_ranks, token_batches

pytestmark = pytest.mark.multiprocess
VOCAB, ROWS, M, LR, LAYERS = 250, 8, 2, 1e-3, 2  # a layer on each of the 2 stages


def _hf_family(name):
    import transformers as T

    torch.manual_seed(0)
    common = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=LAYERS,
                  num_attention_heads=4, max_position_embeddings=64, bos_token_id=0, eos_token_id=0,
                  pad_token_id=None)
    if name == "qwen2":
        return T.Qwen2ForCausalLM(T.Qwen2Config(num_key_value_heads=2, **common))
    if name == "phi3":
        return T.Phi3ForCausalLM(T.Phi3Config(num_key_value_heads=2, **common))
    return T.OPTForCausalLM(T.OPTConfig(vocab_size=VOCAB, hidden_size=64, ffn_dim=128, num_hidden_layers=LAYERS,
                                        num_attention_heads=4, max_position_embeddings=64, word_embed_proj_dim=64,
                                        dropout=0.0, attention_dropout=0.0, bos_token_id=0, eos_token_id=0,
                                        pad_token_id=1))


def _make_more(name):
    import transformers as T

    torch.manual_seed(0)
    common = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=LAYERS,
                  num_attention_heads=4, max_position_embeddings=64, bos_token_id=0, eos_token_id=0,
                  pad_token_id=None)
    gpt = dict(vocab_size=VOCAB, n_embd=64, n_layer=LAYERS, n_head=4, n_positions=64, bos_token_id=0, eos_token_id=0)
    if name == "gpt-neox":
        return T.GPTNeoXForCausalLM(T.GPTNeoXConfig(rotary_pct=0.25, use_parallel_residual=True, **common))
    if name == "gpt-j":
        return T.GPTJForCausalLM(T.GPTJConfig(rotary_dim=8, **gpt))
    if name == "gemma2":
        return T.Gemma2ForCausalLM(T.Gemma2Config(num_key_value_heads=2, head_dim=16, **common))
    if name == "falcon":
        return T.FalconForCausalLM(T.FalconConfig(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=LAYERS,
                                                  num_attention_heads=4, multi_query=False, parallel_attn=True,
                                                  bias=True, bos_token_id=0, eos_token_id=0))
    if name == "qwen3":
        return T.Qwen3ForCausalLM(T.Qwen3Config(num_key_value_heads=2, head_dim=16, **common))
    if name == "bloom":
        return T.BloomForCausalLM(T.BloomConfig(vocab_size=VOCAB, hidden_size=64, n_layer=LAYERS, n_head=4,
                                                bos_token_id=0, eos_token_id=0))
    if name == "mixtral":
        return T.MixtralForCausalLM(T.MixtralConfig(num_key_value_heads=2, num_local_experts=4,
                                                    num_experts_per_tok=2, **common))
    if name == "olmoe":
        return T.OlmoeForCausalLM(T.OlmoeConfig(num_key_value_heads=2, num_experts=4, num_experts_per_tok=2,
                                                **common))
    if name == "gpt-oss":
        return T.GptOssForCausalLM(T.GptOssConfig(num_key_value_heads=2, head_dim=16, num_local_experts=4,
                                                  num_experts_per_tok=2, layer_types=["full_attention"] * LAYERS,
                                                  **common))
    if name == "qwen2-moe":
        return T.Qwen2MoeForCausalLM(T.Qwen2MoeConfig(num_key_value_heads=2, num_experts=4, num_experts_per_tok=2,
                                                      moe_intermediate_size=64, shared_expert_intermediate_size=128,
                                                      **common))
    return T.GPTBigCodeForCausalLM(T.GPTBigCodeConfig(multi_query=True, attn_pdrop=0.0, resid_pdrop=0.0,
                                                      embd_pdrop=0.0, **gpt))


def _family_batches():
    return token_batches(VOCAB, steps=2, rows=ROWS, seed=1)


SPLIT_FULLY = ["qwen2", "phi3", "opt"]
MORE = ["gpt-neox", "gpt-j", "gemma2", "falcon", "qwen3", "bloom", "bigcode", "mixtral", "olmoe", "qwen2-moe",
        "gpt-oss"]


def _model(name):
    return (_hf_family if name in SPLIT_FULLY else _make_more)(name)


def _family_program(name):
    # f and g of tensor parallelism alone are counted per layer
    return parallelize_on(_model(name), _family_batches(), ROWS // M, tp=2, pp=2, microbatches=M,
                          sequence_parallel=False)


def _train_hf_families(names):
    out = {}
    for name in names:
        data = _family_batches()
        program = _family_program(name)  # compiled in the test process before the spawn: inherited
        losses, grads = train_steps(program.materialize(), data, LR)
        per_layer = program.collectives(by_layer=True)
        out[name] = (losses, grads, program.fallbacks(), [r.reason for r in program.plan.rejected],
                     {k: v for k, v in per_layer.items() if k[0] is not None},
                     [w[0] for w in program.replicated_weights()], [r.module for r in program.plan.rejected])
    return out


@pytest.fixture(scope="module")
def family_runs():
    """Every family of both tests trained on the same 4 ranks, each compiled here first (once, not per rank)."""
    names = SPLIT_FULLY + MORE
    for name in names:
        _family_program(name)
    return spawn_ranks(_train_hf_families, 4, names)


def test_more_hf_families_split_fully_and_match_one_process(family_runs):
    for name in SPLIT_FULLY:
        assert_ranks_match(reference_run(_hf_family(name), _family_batches(), lr=LR),
                           [res[name][:2] for res in family_runs], name)
        for rank, res in enumerate(family_runs):
            _, _, fallbacks, rejected, per_layer, _, _ = res[name]
            assert fallbacks == [] and rejected == [], (name, rank, fallbacks, rejected)
            # f and g twice per layer, on each layer
            assert per_layer == {(i, k): 2 for i in range(LAYERS) for k in ("copy_to_tp", "reduce_from_tp")}, per_layer


def test_families_written_differently_match_one_process(family_runs):
    for name in MORE:
        assert_ranks_match(reference_run(_make_more(name), _family_batches(), lr=LR),
                           [res[name][:2] for res in family_runs], name)
        for rank, res in enumerate(family_runs):
            _, _, fallbacks, rejected, per_layer, whole, where = res[name]
            assert fallbacks == [], (name, fallbacks)
            assert whole == [], (name, whole)  # every matrix is split or explained by a rejected linear
            if name in ("gpt-j", "gpt-neox", "falcon"):  # attention and MLP side by side: one g per layer
                assert {n for (_, kind), n in per_layer.items() if kind == "reduce_from_tp"} == {1}, per_layer
            if name in ("mixtral", "olmoe", "gpt-oss"):  # the router (then a top-k over experts) stays whole
                assert rejected and all("topk" in r for r in rejected), rejected
            elif name == "qwen2-moe":  # the router, and the shared expert's one-feature gate
                assert {m.rsplit(".", 1)[-1] for m in where} == {"gate", "shared_expert_gate"}, where
            elif name == "bigcode":  # one key/value head: the fused QKV (and so c_proj) stays whole
                assert {m.rsplit(".", 1)[-1] for m in where} == {"c_attn", "c_proj"}, where
            else:
                assert rejected == [], (name, rejected)
