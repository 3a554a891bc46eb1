"""Random ops under tensor parallelism, without a process group.

Dropout on a sharded value must draw a different mask on each tp rank, and the
shared stream (used by everything replicated) must advance identically on
every rank and replay under a checkpoint's recomputation.
"""

import torch
from torch.utils.checkpoint import checkpoint

import autopar
from autopar.core.comm import TPGroup, tp_rng_call
from autopar.reference.models import ModelConfig, build

dropout = torch.ops.aten.dropout.default


def test_sharded_dropout_masks_differ_across_ranks_and_shared_stream_stays_in_step():
    x = torch.ones(4, 256)
    masks, after = [], []
    for rank in range(2):
        torch.manual_seed(0)
        masks.append(tp_rng_call(dropout, TPGroup(rank, 2, None), x, 0.5, True))
        after.append(torch.rand(3))  # the next draw of the shared stream
    assert not torch.equal(masks[0], masks[1])
    torch.testing.assert_close(after[0], after[1], rtol=0, atol=0)


def test_sharded_dropout_replays_under_recomputation():
    torch.manual_seed(1)
    x = torch.ones(4, 64, requires_grad=True)
    out = checkpoint(lambda t: tp_rng_call(dropout, TPGroup(1, 2, None), t, 0.5, True) * 3, x, use_reentrant=False)
    out.sum().backward()
    # the gradient is 3 / (1 - p) where the forward kept a value, 0 where it dropped one: the same mask
    torch.testing.assert_close(x.grad, (out.detach() != 0).float() * 6.0)


def test_attention_dropout_on_split_heads_uses_the_rank_stream():
    model = build("gpt", ModelConfig(vocab_size=64, seq_len=8, n_layer=1, n_head=4, d_model=32, dropout=0.1))
    x = torch.randint(0, 64, (2, 8))
    program = autopar.parallelize(model, tp=2, example_inputs=(x,), example_targets=x.clone(),
                                  sequence_parallel=False)  # dropout on the split heads only
    code = program.code(rank=0)
    assert "tp_rng_call(torch.ops.aten.scaled_dot_product_attention.default, tp" in code.replace("autopar_comm_", "")
    # dropout on replicated values (residual branch) stays on the shared stream
    assert code.count("tp_rng_call") == 1
