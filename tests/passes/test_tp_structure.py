"""Structure of the tensor-parallel programs, without any process group."""

import math

import pytest
import torch
from families import BATCH, FAMILIES, batches, make, make_fallback_model
from helpers import parallelize_on

import autopar
from autopar.core.tensor_placement import Shard


def _compile(fam, tp):
    model, vocab = make(fam)
    return parallelize_on(model, batches(vocab, steps=1), BATCH, tp=tp, sequence_parallel=False), vocab  # the all-reduces of tensor parallelism alone


@pytest.fixture(scope="module")
def compile_tp(shared):
    """``compile_tp(fam, tp)``: (the family's program at ``tp``, its vocabulary), compiled once for the module;
    the tests only read it."""
    return lambda fam, tp: shared((fam, tp), lambda: _compile(fam, tp))


@pytest.mark.parametrize("fam", list(FAMILIES))
@pytest.mark.parametrize("tp", [2, 4])
def test_two_all_reduces_forward_two_backward_per_layer(fam, tp, compile_tp):
    program, _ = compile_tp(fam, tp)
    per_layer = program.collectives(by_layer=True)
    for layer in range(program.layers.count):
        # g after the attention output and the MLP down projection (forward all-reduces);
        # f before Q/K/V (shared) and before the MLP up projections (backward all-reduces)
        assert per_layer[(layer, "reduce_from_tp")] == 2, per_layer
        assert per_layer[(layer, "copy_to_tp")] == 2, per_layer
        others = {k: n for k, n in per_layer.items() if k[0] == layer and k[1] not in ("reduce_from_tp", "copy_to_tp")}
        assert others == {}, others
    assert program.fallbacks() == []


@pytest.mark.parametrize("fam", list(FAMILIES))
@pytest.mark.parametrize("tp", [2, 4])
def test_no_value_has_the_full_vocabulary(fam, tp, compile_tp):
    program, vocab = compile_tp(fam, tp)
    padded = -(-vocab // tp) * tp
    shapes = program.local_shapes(rank=tp - 1)
    full = {name: s for name, s in shapes.items() if vocab in s or padded in s}
    assert full == {}, f"values with the full vocabulary dim on a rank: {full}"
    assert any(padded // tp in s for s in shapes.values())  # the split logits exist


@pytest.mark.parametrize("fam", list(FAMILIES))
@pytest.mark.parametrize("tp", [2, 4])
def test_layer_parameters_per_rank_are_one_over_t(fam, tp, compile_tp):
    program, _ = compile_tp(fam, tp)
    for layer in range(program.layers.count):
        names = [n for n in program.param_names if program.layer_params(n) == layer]
        matrices = [n for n in names if len(program.full_shape(n)) == 2]
        assert matrices and all(isinstance(program.param_spec(n), Shard) for n in matrices)
        full = sum(math.prod(program.full_shape(n)) for n in matrices)
        local = sum(math.prod(program.local_shape(n)) for n in matrices)
        assert local * tp == full


def test_fused_qkv_shards_each_of_q_k_v_not_thirds(compile_tp):
    program, _ = compile_tp("gpt2-fused", 2)
    spec = program.param_spec("h.0.attn.c_attn.weight")
    assert spec == Shard(0, (64, 64, 64))
    text = program.code(rank=1)
    assert "[32:64) + [96:128) + [160:192)" in text  # rank 1 holds the second half of q, k and v


def test_gqa_splits_key_value_heads(compile_tp):
    program, _ = compile_tp("llama", 4)  # 8 query heads, 4 key/value heads
    assert program.local_shape("layers.0.attention.wk.weight") == (8, 64)  # 1 kv head of 8 dims
    assert program.local_shape("layers.0.attention.wq.weight") == (16, 64)


def test_vocabulary_padding_for_a_prime_vocabulary(compile_tp):
    program, vocab = compile_tp("hf-gpt2", 2)
    assert vocab == 257
    spec = program.param_spec("transformer.wte.weight")
    assert spec == Shard(0, (258,))
    assert program.local_shape("transformer.wte.weight") == (129, 64)
    assert "257 -> 258" in program.summary()


def test_tied_embedding_and_head_share_one_shard(compile_tp):
    program, _ = compile_tp("nanogpt", 2)
    kinds = {d.kind for n, d in program.plan.decisions.items()}
    assert {"vocab_embedding", "vocab_cross_entropy", "column", "row"} <= kinds
    assert program.traced.aliases["wte.weight"] == ["wte.weight", "lm_head.weight"]
    assert isinstance(program.param_spec("wte.weight"), Shard)


def test_code_shows_collectives_and_summary_lists_fallbacks():
    model, vocab = make_fallback_model()
    program = parallelize_on(model, batches(vocab, steps=1), BATCH, tp=2, sequence_parallel=False)
    code = program.code(rank=1)
    for name in ("copy_to_tp", "reduce_from_tp", "vocab_parallel_embedding", "vocab_parallel_cross_entropy",
                 "gather_from_tp"):
        assert name in code
    fallbacks = program.fallbacks()
    assert len(fallbacks) == 2 and all("sort" in reason and "families.py" in src for _, reason, src in fallbacks)
    summary = program.summary()
    assert "Fallbacks: 2 op(s) run replicated" in summary and "families.py" in summary


def test_meta_device_model_compiles_without_memory():
    from autopar.reference.models import ModelConfig, build

    cfg = ModelConfig(vocab_size=50257, seq_len=128, n_layer=4, n_head=32, d_model=4096)
    with torch.device("meta"):
        model = build("gpt", cfg)
    x = torch.zeros(1, 128, dtype=torch.long)
    program = autopar.parallelize(model, tp=8, example_inputs=(x,), example_targets=x)
    assert program.local_shape("h.0.mlp.fc.weight") == (4 * 4096 // 8, 4096)
    assert program.local_shape("wte.weight") == (6283, 4096)  # 50257 padded to 50264
    with pytest.raises(ValueError, match=r"needs tp\(8\) \* pp\(1\) \* dp\(1\) = 8 ranks"):
        program.materialize()  # a meta model is initialised shard by shard, on the 8 ranks it needs
