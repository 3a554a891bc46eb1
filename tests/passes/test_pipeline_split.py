"""The pipeline cut, without any process group: balance, relays, placement, errors."""

import dataclasses

import pytest
import torch
import torch.nn as nn
from families import BATCH, SEQ, make

import autopar
from passes.pipeline_split import PipelineError, balance


def _compile_on_random_ids(model, vocab=320, **kw):
    x = torch.randint(0, vocab, (BATCH, SEQ))
    return autopar.parallelize(model, example_inputs=(x,), example_targets=x.clone(), **kw)


def test_balance_is_min_max():
    assert balance([1, 1, 1, 1], 2) == [0, 2]
    assert balance([3, 1, 1, 1], 2) == [0, 1]
    assert balance([1, 1, 1, 1, 1], 2) in ([0, 2], [0, 3])
    # the most expensive run is as cheap as possible: 10 | 4 4 | 4 4 rather than 10 4 | 4 | 4 4
    starts = balance([10, 4, 4, 4, 4], 3)
    runs = [sum([10, 4, 4, 4, 4][s:e]) for s, e in zip(starts, starts[1:] + [5])]
    assert max(runs) == 10


@pytest.mark.parametrize("layers,chunks", [(5, 2), (7, 4), (8, 8), (6, 4)])
def test_uneven_layer_counts_are_balanced_never_dropped(layers, chunks):
    model, vocab = make("nanogpt", layers=layers)
    program = _compile_on_random_ids(model, pp=chunks, microbatches=chunks)
    got = [c.layers for c in program.split.chunks]
    assert sorted(sum(got, [])) == list(range(layers))  # every layer once, in order
    assert all(got) and all(a[-1] + 1 == b[0] for a, b in zip(got, got[1:]))
    costs = program.split.costs
    # the embedding sits in chunk 0 and head + loss in the last chunk, counted in their costs
    assert max(costs) <= 2.2 * min(costs), costs


def test_embedding_first_loss_last_targets_fed_not_sent():
    model, vocab = make("nanogpt", layers=4)
    program = _compile_on_random_ids(model, pp=2, virtual_stages=2, microbatches=2)
    first, last = program.split.chunks[0], program.split.chunks[-1]
    assert "vocab_parallel_embedding" not in first.gm.code  # tp=1: a plain embedding
    assert "embedding" in first.gm.code and "cross_entropy" in last.gm.code
    # each boundary carries only the residual stream (B, T, h): targets are fed to the last chunk directly
    for chunk in program.split.chunks[1:]:
        assert [b.shape for b in chunk.inputs] == [(BATCH, SEQ, 64)]
    assert program.tied_params == {"wte.weight": (0, 1)}  # embedding on stage 0, head on stage 1


class Skip(nn.Module):
    """Layer 0's output is added again after the last layer: relayed through every chunk."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(64, 32)
        self.layers = nn.ModuleList([nn.Sequential(nn.Linear(32, 32), nn.GELU()) for _ in range(4)])
        self.head = nn.Linear(32, 64)

    def forward(self, x):
        h = self.layers[0](self.emb(x))
        skip = h
        for layer in self.layers[1:]:
            h = layer(h)
        return self.head(h + skip)


def test_value_needed_later_is_relayed():
    program = _compile_on_random_ids(Skip(), vocab=64, pp=4, microbatches=4)
    names = [[b.name for b in c.inputs] for c in program.split.chunks]
    skip = names[1][0]
    assert all(skip in n for n in names[1:])  # relayed through chunks 1, 2 and into 3
    assert [len(c.outputs) for c in program.split.chunks] == [1, 2, 2, 0]


def test_schedule_is_shown_and_validated(monkeypatch):
    import autopar.compiler.compile as compile_module
    from autopar.schedules import Kind, ScheduleError, validate

    checked = []

    def spy(schedule):  # the validator the compiler calls, recording what it was given
        checked.append(schedule)
        validate(schedule)

    monkeypatch.setattr(compile_module, "validate", spy)
    model, _ = make("nanogpt", layers=4)
    program = _compile_on_random_ids(model, pp=2, virtual_stages=2, microbatches=4)
    # each schedule validated once, and what was validated is what the program runs: the training
    # schedule and its forward-only form, lowered, with their sends and receives
    assert len(checked) == 2 and checked[0] is program.schedule and checked[1] is program.eval_schedule
    assert program.schedule.is_lowered and program.eval_schedule.is_lowered
    grid = str(program.schedule)
    assert grid.startswith("interleaved p=2 v=2 m=4") and "stage 1:" in grid
    assert "layers per chunk" in program.summary()

    # a (lowered) schedule whose stage 0 runs B0.0 first is refused by that validator, naming B0.0 and F0.0
    lower = compile_module.lower

    def backward_first(schedule, **options):
        lowered = lower(schedule, **options)
        if schedule.forward_only:  # the evaluation schedule has no backward to move
            return lowered
        first = lowered.actions[0]
        b = next(i for i, a in enumerate(first) if (a.kind, a.chunk, a.microbatch) == (Kind.B, 0, 0))
        return dataclasses.replace(lowered, actions={**lowered.actions, 0: [first[b]] + first[:b] + first[b + 1:]})

    monkeypatch.setattr(compile_module, "lower", backward_first)
    with pytest.raises(ScheduleError, match=r"(?s)B0\.0.*F0\.0"):
        _compile_on_random_ids(model, pp=2, virtual_stages=2, microbatches=4)
    assert len(checked) == 3 and str(checked[2].actions[0][0]) == "B0.0"


def test_fewer_layers_than_chunks():
    model, _ = make("nanogpt", layers=2)
    with pytest.raises(PipelineError, match=r"2 layers .* pp \* virtual_stages = 4 chunks.*<= 2"):
        _compile_on_random_ids(model, pp=2, virtual_stages=2, microbatches=2)


def test_interleaved_needs_m_multiple_of_p():
    model, _ = make("nanogpt", layers=8)
    with pytest.raises(ValueError, match=r"microbatches to be a multiple of pp.*microbatches=6, pp=4.*Use microbatches=4 or microbatches=8"):
        _compile_on_random_ids(model, pp=4, virtual_stages=2, microbatches=6)


def test_fewer_microbatches_than_stages():
    """1F1B and GPipe run m < p (the pipeline never fills); the interleaved and zero-bubble
    schedules, whose step patterns assume a full pipeline, refuse it up front."""
    model, _ = make("nanogpt", layers=8)
    program = _compile_on_random_ids(model, pp=4, microbatches=2)
    assert program.schedule.name == "1f1b" and program.schedule.m == 2
    assert [program.schedule.in_flight_bound(s) for s in range(4)] == [2, 2, 2, 1]
    with pytest.raises(ValueError, match=r"microbatches=2 < pp=4. Use microbatches >= 4 .* or '1f1b' or 'gpipe'"):
        _compile_on_random_ids(model, pp=4, virtual_stages=2, microbatches=2, schedule="interleaved")


def test_world_size_must_match_the_mesh():
    model, _ = make("nanogpt", layers=4)
    with pytest.raises(ValueError, match=r"tp=2 x pp=2 x dp=3 needs 12 ranks, the world has 8\. Fix: dp=2"):
        _compile_on_random_ids(model, tp=2, pp=2, dp=3, microbatches=2, world_size=8)


def test_a_model_without_repeated_layers_cannot_be_pipelined_and_says_what_to_do():
    class Flat(nn.Module):
        def __init__(self):
            super().__init__()
            self.e, self.l = nn.Embedding(50, 16), nn.Linear(16, 50)

        def forward(self, x):
            return self.l(self.e(x))

    x = torch.randint(0, 50, (2, 8))
    with pytest.raises(PipelineError, match=r"cuts between repeated layers, and none were found: "
                                            r"looked for a module call repeated.*Fix: use pp=1"):
        autopar.parallelize(Flat(), pp=2, microbatches=2, example_inputs=(x,), example_targets=x)
