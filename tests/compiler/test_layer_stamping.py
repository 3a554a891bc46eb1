"""A deep stack traced from four blocks and stamped: the same graph as tracing every block, and
the models it must not be used on traced whole."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

import autopar
from autopar.compiler import layer_stamping
from autopar.compiler.layer_stamping import same_trace
from autopar.compiler.trace import _trace_whole, lm_cross_entropy, trace
from autopar.reference.models import ModelConfig, build

BLOCKS = 7
VOCAB, SEQ = 64, 8


@pytest.fixture(autouse=True)
def stamp_short_stacks(monkeypatch):
    """Stamp stacks from 6 blocks on, so a small model exercises it."""
    monkeypatch.setattr(layer_stamping, "STAMP_FROM", 6)
    monkeypatch.delenv("AUTOPAR_TRACE", raising=False)


def _batch():
    torch.manual_seed(0)
    x = torch.randint(0, VOCAB, (2, SEQ))
    return x, torch.randint(0, VOCAB, (2, SEQ))


def _both(model):
    x, y = _batch()
    return trace(model, (x,), y, lm_cross_entropy), _trace_whole(model, (x,), y, lm_cross_entropy, None)


@pytest.mark.parametrize("family", ["gpt", "llama", "gpt2-fused"])
def test_stamped_trace_is_the_whole_trace(family):
    model = build(family, ModelConfig(vocab_size=VOCAB, seq_len=SEQ, n_layer=BLOCKS, n_head=2, d_model=16))
    stamped, whole = _both(model)
    assert stamped.stamping is not None and stamped.stamping.blocks == BLOCKS
    assert stamped.stamping.traced == layer_stamping.TRACED
    assert same_trace(stamped, whole) is None  # ops, arguments, names, shapes, module paths, lines
    assert stamped.aliases == whole.aliases  # the tied head and embedding
    assert len(stamped.gm.graph.nodes) == len(whole.gm.graph.nodes)
    # every block's parameters are placeholders of their own, named as the model names them
    names = set(stamped.param_of.values())
    path = stamped.stamping.path
    assert all(any(n.startswith(f"{path}.{i}.") for n in names) for i in range(BLOCKS))


class _Block(nn.Module):
    def __init__(self, d: int):
        super().__init__()
        self.norm = nn.LayerNorm(d)
        self.fc = nn.Linear(d, d)

    def forward(self, x):
        return x + self.fc(self.norm(x))


class _Stack(nn.Module):
    """A small language model whose forward may treat its blocks unequally."""

    def __init__(self, how: str, blocks: int = BLOCKS, d: int = 16):
        super().__init__()
        self.how, self.n = how, blocks
        self.emb = nn.Embedding(VOCAB, d)
        self.blocks = nn.ModuleList(_Block(d) for _ in range(blocks))
        self.head = nn.Linear(d, VOCAB)

    def forward(self, idx):
        x = self.emb(idx)
        if self.how == "by count":  # indexes the list by a count of its own
            for i in range(self.n):
                x = self.blocks[i](x)
        else:
            for i, block in enumerate(self.blocks):
                x = block(x)
                if self.how == "scaled by length":
                    x = x / len(self.blocks)
                if self.how == "last by length" and i == len(self.blocks) - 1:
                    x = torch.tanh(x)
        return self.head(x)


@pytest.mark.parametrize("how", ["plain", "scaled by length", "last by length", "by count"])
def test_a_forward_that_treats_blocks_unequally_is_stamped_only_where_exact(how):
    stamped, whole = _both(_Stack(how))
    assert same_trace(stamped, whole) is None
    if how in ("plain", "last by length"):  # the last block keeps its place (and what follows it)
        assert stamped.stamping is not None
    else:  # the four-block check (or the short trace) fails: every block traced
        assert stamped.stamping is None


def test_blocks_that_differ_are_not_a_stack():
    model = _Stack("plain")
    model.blocks[3].fc = nn.Linear(16, 16, bias=False)
    stamped, _ = _both(model)
    assert stamped.stamping is None
    model = _Stack("plain")
    model.blocks[5].fc.weight = model.blocks[4].fc.weight  # a weight shared between two blocks
    stamped, whole = _both(model)
    assert stamped.stamping is None and same_trace(stamped, whole) is None


def test_short_stacks_and_the_switch_trace_whole(monkeypatch):
    stamped, _ = _both(_Stack("plain", blocks=5))
    assert stamped.stamping is None
    monkeypatch.setenv("AUTOPAR_TRACE", "whole")
    stamped, _ = _both(_Stack("plain"))
    assert stamped.stamping is None


def test_summary_says_the_graph_was_stamped():
    model = build("gpt", ModelConfig(vocab_size=VOCAB, seq_len=SEQ, n_layer=BLOCKS, n_head=2, d_model=16))
    x, y = _batch()
    program = autopar.parallelize(model, tp=2, pp=2, example_inputs=(x,), example_targets=y)
    assert "3 of the 7 blocks of h traced, 4 stamped" in program.summary()


class _BufferedBlock(nn.Module):
    def __init__(self, d: int, i: int):
        super().__init__()
        self.fc = nn.Linear(d, d)
        self.register_buffer("scale", torch.full((d,), 1.0 + i))
        self.register_buffer("shift", torch.full((d,), 0.1 * i), persistent=False)  # the export keeps its value

    def forward(self, x):
        return x + self.fc(x) * self.scale + self.shift


class _SequentialStack(nn.Module):
    def __init__(self, d: int = 8):
        super().__init__()
        self.emb, self.head = nn.Embedding(VOCAB, d), nn.Linear(d, VOCAB)
        self.stack = nn.Sequential(*[_BufferedBlock(d, i) for i in range(BLOCKS)])

    def forward(self, ids):
        return self.head(self.stack(self.emb(ids)))


def test_blocks_with_buffers_in_a_sequential_keep_their_own_values():
    stamped, whole = _both(_SequentialStack())
    assert stamped.stamping is not None and same_trace(stamped, whole) is None
    assert list(stamped.constants) == list(whole.constants)  # every block's non-persistent buffer, in order
    for key, value in whole.constants.items():
        assert stamped.constants[key] is value, key
