"""The errors a new user meets say the cause, the place in the user's code and a fix that works.

- a tp that does not divide the model's heads, key/value heads or MLP width
  names them (read from the graph's views), the model's source line, and every
  tp that splits the whole model, each of which then compiles;
- a loss function or forward that cannot take what tracing passes says the
  expected signature, its own, and the fix;
- batch tensors carry the model's argument names everywhere;
- a layout that does not fill the world says how many ranks it needs, and the
  summary says where the data-parallel size came from;
- the summary's collective bytes are what one rank of each stage moves: its
  own chunks, counted against a real 4-rank run.
"""

from __future__ import annotations

import re

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from families import SEQ, batches
from helpers import calls_into_dist, compiled, spawn_ranks

import autopar
from autopar.reference.models import ModelConfig, build

VOCAB = 320


def _hf_llama(intermediate: int = 512) -> nn.Module:
    """8 attention heads, 4 key/value heads, an MLP 512 wide: tp must divide 4."""
    import transformers

    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=intermediate,
                                   num_hidden_layers=2, num_attention_heads=8, num_key_value_heads=4,
                                   max_position_embeddings=SEQ, bos_token_id=0, eos_token_id=0, pad_token_id=None)
    return transformers.LlamaForCausalLM(cfg)


def _seeded_ids(rows: int = 2) -> torch.Tensor:
    return torch.randint(0, VOCAB, (rows, SEQ), generator=torch.Generator().manual_seed(0))


def _compile_on_ids(model: nn.Module, **config) -> autopar.ParallelProgram:
    x = _seeded_ids()
    return autopar.parallelize(model, example_inputs=(x,), example_targets=x, **config)


# ---------------------------------------------------------------- tensor-parallel degrees


def test_a_tp_that_does_not_divide_the_heads_names_them_and_the_tps_that_work():
    model = _hf_llama()
    with pytest.raises(autopar.ShardingError) as err:
        _compile_on_ids(model, tp=3)
    msg = str(err.value)
    # the cause: the heads, read from the graph's (heads, head_dim) views, and the MLP width
    assert "tp=3 cannot split LlamaForCausalLM" in msg
    assert "the 8 attention heads of model.layers.0.self_attn" in msg
    assert "the 4 key/value heads of model.layers.0.self_attn" in msg
    assert "the 512 output features of model.layers.0.mlp.gate_proj" in msg
    # the place: the model's own line, not torch's nn.Linear
    assert "modeling_llama.py:" in msg and "self.q_proj(hidden_states).view(" in msg
    assert "linear.py" not in msg
    # the vocabulary is padded: 320 does not limit tp
    assert "the vocabulary of 320 (lm_head) is padded" in msg
    works = [int(t) for t in re.search(r"tp values that split the whole model: ([\d, ]+)", msg).group(1).split(", ")]
    assert works == [1, 2, 4]  # the divisors of gcd(8 heads, 4 key/value heads, 512)
    for tp in works:  # each suggestion compiles, every linear split
        program = _compile_on_ids(model, tp=tp)
        assert program.plan.rejected == [] and program.fallbacks() == []


def test_the_tps_the_old_message_suggested_fail_on_the_key_value_heads():
    model = _hf_llama()
    for tp in (8, 16):
        with pytest.raises(autopar.ShardingError) as err:
            _compile_on_ids(model, tp=tp)
        msg = str(err.value)
        assert "the 4 key/value heads" in msg and "tp=4" in msg
        assert ("the 8 attention heads" in msg) == (tp == 16)


def test_an_mlp_width_alone_is_named_as_output_features():
    model = build("llama", ModelConfig(n_head=8, n_kv_head=8, d_model=64, d_ff=100, vocab_size=VOCAB))
    with pytest.raises(autopar.ShardingError) as err:
        _compile_on_ids(model, tp=8)  # 8 divides the heads, not the 100-wide MLP
    msg = str(err.value)
    assert "the 100 output features of layers.0.feed_forward.w1, layers.0.feed_forward.w3" in msg
    assert "heads of" not in msg  # only what fails is listed
    assert "tp values that split the whole model: 1, 2, 4:" in msg  # gcd(8 heads, 100) = 4
    assert "Fix: use tp=4 (or another of [1, 2, 4])" in msg


# ---------------------------------------------------------------- the loss and the forward


def _default_gpt() -> nn.Module:
    torch.manual_seed(0)
    return build("gpt", ModelConfig(vocab_size=VOCAB, seq_len=SEQ))


def test_a_loss_that_wants_more_targets_says_the_signature_and_the_fix():
    def loss(out, a, b):
        return F.cross_entropy(out.flatten(0, 1), a.flatten()) + b.float().mean()

    with pytest.raises(autopar.TraceError) as err:
        _compile_on_ids(_default_gpt(), loss_fn=loss)
    msg = str(err.value)
    assert "loss_fn must have the signature loss_fn(output, *targets) -> scalar tensor" in msg
    assert "autopar calls it as loss_fn(output, target)" in msg and "the 1 tensor of example_targets" in msg
    assert re.search(r"The loss_fn passed is .*loss\(out, a, b\) \(defined at test_user_errors\.py:\d+\)", msg)
    assert "Fix: pass example_targets with 2 tensors (a, b: one microbatch, in that order)" in msg
    assert "<string>" not in msg and "control flow" not in msg


def test_no_targets_for_the_default_loss_says_to_pass_them():
    with pytest.raises(autopar.TraceError) as err:
        autopar.parallelize(_default_gpt(), example_inputs=(_seeded_ids(),))
    msg = str(err.value)
    assert "no target, as example_targets was not given" in msg
    assert "lm_cross_entropy(logits, targets) (the default loss" in msg
    assert "Fix: pass example_targets with 1 tensor (targets" in msg


def test_a_loss_that_takes_no_target_says_so():
    with pytest.raises(autopar.TraceError, match=r"<lambda>\(out\) .*too many positional arguments.*Fix: pass a "
                                                 r"loss_fn that takes the output and 1 target \(loss_fn\(output, "
                                                 r"target\)\), or no example_targets"):
        _compile_on_ids(_default_gpt(), loss_fn=lambda out: out.mean())


def test_a_forward_that_cannot_take_the_example_inputs_says_so():
    x = _seeded_ids()
    with pytest.raises(autopar.TraceError, match=r"GPT\.forward\(idx\) cannot be called with the 2 example "
                                                 r"input\(s\).*too many positional arguments.*Fix: pass "
                                                 r"example_inputs as a tuple with one tensor per positional"):
        autopar.parallelize(_default_gpt(), example_inputs=(x, x), example_targets=x)


# ---------------------------------------------------------------- names of the batch tensors


def test_batch_tensors_carry_the_model_and_loss_argument_names():
    x = _seeded_ids()
    mask = torch.ones_like(x)
    program = autopar.parallelize(_hf_llama(intermediate=128), tp=2, example_inputs=(x, mask), example_targets=x)
    assert program.traced.input_names == ["input_ids", "attention_mask"]  # LlamaForCausalLM.forward's
    assert program.traced.target_names == ["targets"]  # lm_cross_entropy(logits, targets)
    placeholders = [n.name for n in program.traced.gm.graph.nodes if n.op == "placeholder"]
    assert {"input_ids", "attention_mask", "targets"} <= set(placeholders)
    assert not any(name.startswith("args_") for name in placeholders)
    code = program.code(rank=0)
    assert "input_ids" in code and "attention_mask" in code and "args_0" not in code
    summary = program.summary()
    assert "inputs input_ids [2, 16] int64, attention_mask [2, 16] int64; targets targets [2, 16] int64" in summary
    assert "data-parallel size 1: by default: no dp and no world size at compile time" in summary


def test_targets_are_named_by_the_loss_parameters():
    x = _seeded_ids()

    def two(out, labels, weights):
        return (F.cross_entropy(out.flatten(0, 1), labels.flatten(), reduction="none") * weights.flatten()).mean()

    program = autopar.parallelize(_default_gpt(), example_inputs=(x,), example_targets=(x, torch.ones(x.shape)),
                                  loss_fn=two)
    assert (program.traced.input_names, program.traced.target_names) == (["idx"], ["labels", "weights"])
    program = autopar.parallelize(_default_gpt(), example_inputs=(x,), example_targets=(x, x),
                                  loss_fn=lambda out, *ys: F.cross_entropy(out.flatten(0, 1), ys[0].flatten()))
    assert program.traced.target_names == ["ys_0", "ys_1"]


def test_the_engine_names_the_batch_tensor_with_the_wrong_shape():
    engine = _compile_on_ids(_default_gpt()).materialize()
    wrong = torch.zeros(4, SEQ, dtype=torch.long)
    with pytest.raises(ValueError, match=r"batch tensor 'idx' has shape \(4, 16\)"):
        engine.train_step(wrong, wrong)


# ---------------------------------------------------------------- the mesh and the world


def test_a_layout_that_does_not_fill_the_world_says_how_many_ranks_it_needs():
    with pytest.raises(ValueError) as err:
        _compile_on_ids(_default_gpt(), tp=2, pp=2, microbatches=2, world_size=2)
    msg = str(err.value)
    assert msg.startswith("tp=2 x pp=2 needs a multiple of 4 ranks, the world has 2")
    assert "dp(0)" not in msg
    assert "Fix: start 4, 8, 12, ... ranks, or use a layout that divides 2 ranks: tp=1 x pp=2 (dp=1)" in msg
    with pytest.raises(ValueError, match=r"^tp=2 x pp=2 x dp=3 needs 12 ranks, the world has 8\. Fix: dp=2 "):
        autopar.ParallelConfig(tp=2, pp=2, dp=3, microbatches=2, world_size=8)


@pytest.mark.parametrize("given, says", [
    (dict(world_size=8), "data-parallel size 2: inferred from the world size, 8 ranks / (tp 2 x pp 2)"),
    (dict(dp=3), "data-parallel size 3: given (dp=)"),
    ({}, "data-parallel size 1: by default: no dp and no world size at compile time, so materialize() needs "
         "exactly 4 ranks (compile with dp= or world_size= for more replicas)"),
])
def test_the_summary_says_where_the_data_parallel_size_came_from(given, says):
    config = autopar.ParallelConfig(tp=2, pp=2, microbatches=2, **given)
    assert f"data-parallel size {config.data_parallel}: {config.dp_source}" == says


# ---------------------------------------------------------------- collective bytes per rank


class _TPBytes:
    """Counts the bytes one rank's collectives move over its tensor-parallel group, as torch.distributed
    sees them: an all-reduced buffer once (on gloo with t = 2 it is one pairwise exchange: the buffer
    sent), an all-gather its gathered size."""

    def __init__(self, group):
        self.group, self.nbytes = group, 0
        self._calls = calls_into_dist(("all_reduce", "all_gather", "batch_isend_irecv"), self._seen)

    def __enter__(self):
        self._calls.__enter__()
        return self

    def _seen(self, name: str, args: tuple, kwargs: dict) -> None:
        import torch.distributed as dist

        if name == "all_reduce":
            self._count(kwargs.get("group"), args[0].numel() * args[0].element_size())
        elif name == "all_gather":
            tensors, tensor = args[:2]
            self._count(kwargs.get("group"), tensor.numel() * tensor.element_size() * len(tensors))
        else:  # batch_isend_irecv: the buffers sent
            for op in args[0]:
                if op.op is dist.isend:
                    self._count(op.group, op.tensor.numel() * op.tensor.element_size())

    def _count(self, group, nbytes: int) -> None:
        if group is self.group:
            self.nbytes += nbytes

    def __exit__(self, *exc):
        self._calls.__exit__(*exc)


RECOMPUTE = ("none", "layer", "chunk")


def _tp_bytes_program(recompute: str) -> autopar.ParallelProgram:
    """A 2-layer Llama compiled for tp=2 x pp=2 on 4 ranks (once per process)."""
    torch.manual_seed(0)
    model = build("llama", ModelConfig(n_head=8, n_kv_head=4, d_model=64, vocab_size=VOCAB, n_layer=2, seq_len=SEQ))
    (x,), (y,) = batches(VOCAB, steps=1, seed=1, rows=4)[0]
    return compiled(model, tp=2, pp=2, microbatches=2, world_size=4, recompute=recompute, sequence_parallel=False,
                    example_inputs=(x[:2],), example_targets=y[:2])


def _measure_tp_bytes():
    """On each rank, for each recompute mode: the bytes its tp collectives moved in one step, the
    program's figure for its stage (by row) and the summary's line of totals."""
    import torch.distributed as dist

    out = {}
    for recompute in RECOMPUTE:
        (x,), (y,) = batches(VOCAB, steps=1, seed=1, rows=4)[0]
        program = _tp_bytes_program(recompute)  # inherited from the test process
        engine = program.materialize()
        with _TPBytes(engine.tp.pg) as counter:
            engine.train_step(x, y)
        stage = program.config.mesh.coords(dist.get_rank())[0]
        line = next(s for s in program.summary().splitlines() if s.startswith("tensor-parallel bytes"))
        out[recompute] = (counter.nbytes, program.tp_communication(stage), line)
    return out


ACTIVATION = 2 * 2 * SEQ * 64 * 4
"""Bytes of one (2, 16, 64) fp32 activation, 2 microbatches: what f or g moves per step."""


@pytest.mark.multiprocess
def test_the_summary_counts_the_collective_bytes_a_rank_really_moves():
    for recompute in RECOMPUTE:  # compile once here: the ranks inherit the programs
        _tp_bytes_program(recompute)
    results = spawn_ranks(_measure_tp_bytes, 4)
    for rank, result in enumerate(results):
        stage = rank // 2  # tp=2 x pp=2: ranks 0, 1 on stage 0
        for recompute, (measured, rows, line) in result.items():
            figure = sum(nbytes for _, nbytes in rows.values())
            assert measured == figure, (rank, recompute, measured, figure, rows)  # exact: the same buffers
            assert f"stage {stage} {figure / 1024:.1f} KiB" in line, (line, figure)
            # the stage's one layer, not the model's two: f and g twice each per microbatch
            assert rows[("layers", "copy_to_tp")] == rows[("layers", "reduce_from_tp")] == (2, 2 * ACTIVATION)
            # recomputing a layer replays its attention g (the MLP's g and the residual add that close
            # it save nothing for the backward); a chunk, every forward collective up to its last save
            replayed = {k[1]: v for k, v in rows.items() if k[0] == "replayed by recompute"}
            want = {"none": {}, "layer": {"reduce_from_tp": (1, ACTIVATION)},
                    "chunk": {"vocab_parallel_embedding": (1, ACTIVATION), "reduce_from_tp": (1, ACTIVATION)}
                    if stage == 0 else {"reduce_from_tp": (2, 2 * ACTIVATION),
                                        "vocab_parallel_cross_entropy": rows[("outside layers",
                                                                              "vocab_parallel_cross_entropy")]}}
            assert replayed == want[recompute], (rank, recompute, replayed)
