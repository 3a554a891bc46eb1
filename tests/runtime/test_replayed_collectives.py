"""What a recomputed layer runs again, counted on the engine: the facts ``transformer.replay_ops`` prices.

Two gloo ranks at t = 2, the tiny GPT of 2 layers, 2 microbatches: each collective call of one training
step counted (the calls into ``torch.distributed`` that ``core/comm`` makes), with and without
``recompute='layer'``, with and without sequence parallelism. PyTorch's non-reentrant checkpoint stops
its replay at the last op that saves a tensor for the backward, so the MLP's reduction is not run again;
under sequence parallelism the replay's all-gathers take the place of the backward's re-gathers of the
kept slices. Net: one reduction per layer and microbatch.
"""

from __future__ import annotations

import collections

import pytest
import torch
from helpers import calls_into_dist, spawn_ranks, tiny_gpt_program

pytestmark = pytest.mark.multiprocess

COUNTED = ("all_reduce", "batch_isend_irecv", "all_gather", "all_gather_single", "reduce_scatter_single")
"""The calls ``core/comm`` makes for tensor parallelism on gloo (an all-reduce of 2 ranks: one pairwise
exchange, ``batch_isend_irecv``)."""
LAYERS, MICROBATCHES = 2, 2
_PROGRAMS: dict = {}


def _counted_step(key) -> dict[str, int]:
    engine = _PROGRAMS[key].materialize()
    x = torch.randint(0, 64, (2 * MICROBATCHES, 8), generator=torch.Generator().manual_seed(0))  # microbatches of 2
    engine.train_step(x, x)  # the first step's one-time exchanges left out
    counts: collections.Counter = collections.Counter()
    with calls_into_dist(COUNTED, lambda name, args, kwargs: counts.update([name])):
        engine.train_step(x, x)
    return dict(counts)


def _all_steps() -> dict:
    return {key: _counted_step(key) for key in _PROGRAMS}


def test_a_recomputed_layer_replays_one_reduction():
    for sp in (False, True):
        for rc in ("none", "layer"):
            _PROGRAMS[sp, rc] = tiny_gpt_program(tp=2, world_size=2, sequence_parallel=sp, recompute=rc,
                                                 microbatches=MICROBATCHES)
    try:
        counts = spawn_ranks(_all_steps, 2)[0]
    finally:
        _PROGRAMS.clear()
    passes = LAYERS * MICROBATCHES
    extra = {sp: collections.Counter(counts[sp, "layer"]) - collections.Counter(counts[sp, "none"])
             for sp in (False, True)}
    assert extra[False] == {"batch_isend_irecv": passes}  # the attention's all-reduce, once a layer pass
    assert extra[True] == {"reduce_scatter_single": passes}  # the attention's reduce-scatter; no all-gather net
    assert collections.Counter(counts[True, "none"]) - collections.Counter(counts[True, "layer"]) == {}
