"""The pipeline cut balanced per stage under the schedule's placement, and the zero-bubble layouts
refused up front; no process group."""

from __future__ import annotations

import itertools
import random

import pytest
import torch
from families import BATCH, SEQ, make

import autopar
from autopar.schedules import chunk_placement
from passes.stage_balance import balance, balance_stages, stage_totals


def _worst(costs, starts, stages):
    """(largest stage total, largest chunk) of a cut, rounded past float noise."""
    ends = list(starts[1:]) + [len(costs)]
    chunks = [sum(costs[s:e]) for s, e in zip(starts, ends)]
    return round(max(stage_totals(costs, starts, stages)), 6), round(max(chunks), 6)


def test_v_cut_is_the_best_of_every_cut():
    rng = random.Random(0)
    for _ in range(60):
        p = rng.choice([1, 2, 3])
        stages = chunk_placement("zbv", p, 2)
        n = rng.randint(2 * p, 2 * p + 5)
        costs = [rng.choice([1, 1, 2, 3, 5, 8]) + rng.random() / 10 for _ in range(n)]
        got = balance_stages(costs, stages)
        assert got[0] == 0 and all(a < b for a, b in zip(got, got[1:])) and got[-1] < n
        every = (_worst(costs, [0, *cut], stages) for cut in itertools.combinations(range(1, n), 2 * p - 1))
        assert _worst(costs, got, stages) == min(every), (costs, p)


def test_v_cut_evens_the_stages_where_the_chunk_cut_does_not():
    # an embedding-heavy first layer: the min-max chunk cut leaves the last chunk (on stage 0 in
    # the V) a long run of layers, stage 0 = 3 + 3
    costs = [3.0, 1, 1, 1, 1, 1]
    stages = chunk_placement("zbv", 2, 2)  # (0, 1, 1, 0)
    chunk_cut = balance(costs, 4)
    assert chunk_cut == [0, 1, 2, 3] and stage_totals(costs, chunk_cut, stages) == [6.0, 2.0]
    v_cut = balance_stages(costs, stages)
    assert v_cut == [0, 1, 2, 5] and stage_totals(costs, v_cut, stages) == [4.0, 4.0]  # 8 / 2 per stage
    # interleaved placements keep the min-max chunk cut
    assert balance_stages(costs, chunk_placement("interleaved", 2, 2)) == chunk_cut


def test_compiled_zbv_program_places_and_balances_its_chunks():
    model, vocab = make("nanogpt", layers=6)
    x = torch.randint(0, vocab, (BATCH, SEQ))
    program = autopar.parallelize(model, pp=2, virtual_stages=2, microbatches=4, schedule="zbv",
                                  example_inputs=(x,), example_targets=x, world_size=2)
    assert [program.stage_of_chunk(c) for c in range(4)] == [0, 1, 1, 0]
    assert [c.index for c in program.chunks_of_stage(0)] == [0, 3]
    costs = program.split.costs
    totals = [costs[0] + costs[3], costs[1] + costs[2]]
    # 6 layers, embedding with the first, head + loss with the last: the two stages within a layer's cost
    assert abs(totals[0] - totals[1]) <= max(costs) / 2, totals
    assert program.tied_params == {}  # embedding and head both on stage 0
    assert "chunk 1 -> 2" not in " ".join(k[0] for k in program.p2p_and_dp_bytes())  # the turn: no message


@pytest.mark.parametrize("config, message", [
    ({"schedule": "zbv", "pp": 2, "microbatches": 4}, "zbv runs 2 chunks per stage .*virtual_stages=1"),
    ({"schedule": "zbv", "pp": 2, "virtual_stages": 2, "microbatches": 1}, "microbatches=1 < pp=2"),
    ({"schedule": "zb-h1", "pp": 2, "virtual_stages": 2, "microbatches": 4}, "virtual_stages=2 needs .*'zbv' for 2"),
])
def test_zero_bubble_layouts_refused_before_tracing(config, message):
    model, vocab = make("nanogpt", layers=4)
    x = torch.randint(0, vocab, (BATCH, SEQ))
    with pytest.raises(ValueError, match=message):
        autopar.parallelize(model, example_inputs=(x,), example_targets=x, world_size=2, **config)
