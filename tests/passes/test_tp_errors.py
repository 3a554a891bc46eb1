"""Bad input fails before any process starts, naming the place, the numbers and the fix."""

import pytest
import torch
import torch.nn as nn

import autopar
from autopar.reference.models import ModelConfig, build


def _xy(vocab=256, b=2, t=16):
    x = torch.randint(0, vocab, (b, t))
    return (x,), x


def test_heads_not_divisible_by_tp():
    model = build("gpt", ModelConfig(n_head=6, d_model=96, vocab_size=256))
    x, y = _xy()
    with pytest.raises(autopar.ShardingError) as err:
        autopar.parallelize(model, tp=4, example_inputs=x, example_targets=y)
    msg = str(err.value)
    assert "the 6 attention heads of h.0.attn" in msg and "tp=4" in msg
    assert "[1, 2, 3, 6]" in msg  # the tps that would work
    assert "models.py:" in msg  # the user's source line


def test_kv_heads_not_divisible_by_tp():
    model = build("llama", ModelConfig(n_head=8, n_kv_head=2, d_model=64, vocab_size=256))
    x, y = _xy()
    with pytest.raises(autopar.ShardingError, match=r"tp=4 cannot split Llama.*\n.*2 key/value heads of layers\.0\.attention"):
        autopar.parallelize(model, tp=4, example_inputs=x, example_targets=y)


def test_ffn_not_divisible_by_tp():
    model = build("gpt", ModelConfig(n_head=8, d_model=64, d_ff=100, vocab_size=256))
    x, y = _xy()
    with pytest.raises(autopar.ShardingError, match=r"8 does not divide.*\n.*100 output features of h\.0\.mlp\.fc"):
        autopar.parallelize(model, tp=8, example_inputs=x, example_targets=y)


def test_hidden_not_divisible_by_tp():
    model = build("gpt", ModelConfig(n_head=3, d_model=48, d_ff=192, vocab_size=256))
    x, y = _xy()
    with pytest.raises(autopar.ShardingError, match="tp=2"):
        autopar.parallelize(model, tp=2, example_inputs=x, example_targets=y)


class DataDependent(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(256, 32)
        self.out = nn.Linear(32, 256)

    def forward(self, x):
        h = self.emb(x)
        if h.sum() > 0:  # control flow on a tensor value: not traceable
            h = h * 2
        return self.out(h)


def test_untraceable_model_names_the_line():
    x, y = _xy()
    with pytest.raises(autopar.TraceError) as err:
        autopar.parallelize(DataDependent(), tp=2, example_inputs=x, example_targets=y)
    msg = str(err.value)
    assert "DataDependent" in msg and "test_tp_errors.py" in msg and "if h.sum() > 0" in msg
    assert "torch.where" in msg  # what to try


def test_tp_larger_than_world():
    model = build("gpt", ModelConfig(vocab_size=256))
    x, y = _xy()
    with pytest.raises(ValueError, match=r"tp=4 x pp=1 needs a multiple of 4 ranks, the world has 2.*Fix: start 4, 8, 12.*tp=2 x pp=1"):
        autopar.parallelize(model, tp=4, example_inputs=x, example_targets=y, world_size=2)


def test_batch_shape_differs_from_example():
    model = build("gpt", ModelConfig(vocab_size=256))
    x, y = _xy()
    engine = autopar.parallelize(model, tp=1, example_inputs=x, example_targets=y).materialize()
    with pytest.raises(ValueError, match=r"shape \(4, 16\).*expects \(2, 16\).*1 microbatch"):
        engine.train_step(torch.zeros(4, 16, dtype=torch.long), torch.zeros(4, 16, dtype=torch.long))


def _raise_on_rank_one():
    import torch.distributed as dist

    if dist.get_rank() == 1:
        raise RuntimeError("boom on rank 1")
    dist.barrier()  # rank 0 would wait here forever without the launcher's clean-up
    return "unreachable"


@pytest.mark.multiprocess
def test_a_failing_rank_stops_all_ranks():
    import time

    start = time.monotonic()
    with pytest.raises(autopar.RankError, match="rank 1 of 2 failed: RuntimeError: boom on rank 1"):
        autopar.spawn(_raise_on_rank_one, 2, timeout_s=120)
    assert time.monotonic() - start < 60
