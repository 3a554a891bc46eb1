"""Pipeline parity on real gloo ranks: GPipe, 1F1B and interleaved 1F1B, with and without tp.

One spawn per world size runs every layout on the same ranks. The models have
8 layers so pp=4 with 2 virtual stages has a layer per chunk. Each stage's peak
count of microbatch activations held is the schedule's exact bound (derived in
``_in_flight``). Tolerances as in
test_tp_parity: the first step's gradients element-wise (rtol 1e-5, atol
1e-6), later steps per tensor (rel_norm 1e-4) because AdamW's first update
lr*sign(g) amplifies rounding in near-zero gradients.
"""

import pytest
from families import BATCH, FAMILIES, SEQ, batches, make, train_steps
from helpers import assert_ranks_match, parallelize_on, spawn_ranks

pytestmark = pytest.mark.multiprocess
LR, M, LAYERS = 1e-3, 4, 8

# (family, tp, pp, v, schedule, scatter_gather[, microbatches: M when absent])
WORLD_2 = [(fam, 1, 2, v, s, True) for fam in ("nanogpt", "llama")
           for v, s in ((1, "gpipe"), (1, "1f1b"), (2, "interleaved"))] + \
          [("nanogpt", 1, 2, 1, "1f1b", True, 1)]  # fewer microbatches than stages
WORLD_4 = [(fam, 1, 4, v, s, True) for fam in ("nanogpt", "llama")
           for v, s in ((1, "gpipe"), (1, "1f1b"), (2, "interleaved"))] + \
          [(fam, 2, 2, 1, "1f1b", sg) for fam in ("nanogpt", "llama") for sg in (True, False)] + \
          [("llama", 1, 4, 1, "1f1b", True, 2), ("nanogpt", 1, 4, 1, "gpipe", True, 3)]  # m < p


def _m(layout) -> int:
    """The layout's microbatches per step."""
    return layout[6] if len(layout) > 6 else M


def _pipeline_program(layout):
    """The layout's program and its batches (the first microbatch as the example)."""
    fam, tp, pp, v, sched, sg = layout[:6]
    model, vocab = make(fam, layers=LAYERS)
    data = batches(vocab, rows=BATCH * _m(layout))
    program = parallelize_on(model, data, BATCH, tp=tp, pp=pp, virtual_stages=v, microbatches=_m(layout),
                             schedule=sched, scatter_gather=sg,
                             sequence_parallel=False)  # boundaries replicated: what scatter/gather halves
    return program, data


def _train_pipeline_layout(layout):
    program, data = _pipeline_program(layout)  # compiled in the test process before the spawn: inherited
    engine = program.materialize()
    losses, grads = train_steps(engine, data, LR)
    stats = {"bytes_sent": dict(engine.stats["bytes_sent"]), "peak_in_flight": engine.stats["peak_in_flight"],
             "stage": engine.stage, "bound": program.schedule.in_flight_bound(engine.stage)}
    return losses, grads, stats, [c.layers for c in program.split.chunks]


def _train_pipeline_layouts(layouts):
    return {layout: _train_pipeline_layout(layout) for layout in layouts}


def _spawn_layouts(world, layouts):
    """Every layout trained on ``world`` ranks in one spawn, each compiled here first (once, not per rank)."""
    for layout in layouts:
        _pipeline_program(layout)
    return spawn_ranks(_train_pipeline_layouts, world, layouts)


def _check(results, layouts, reference):
    for layout in layouts:
        fam = layout[0]
        rows = BATCH * _m(layout)
        ref = reference((fam, LAYERS, rows), lambda: make(fam, layers=LAYERS)[0],
                        lambda: batches(FAMILIES[fam][1], rows=rows), lr=LR)
        assert_ranks_match(ref, [res[layout][:2] for res in results], label=str(layout))


def _in_flight(schedule, p, v, stage, m=M):
    """Microbatch activations ``stage`` holds at its peak: its warm-up forwards, then the forward that
    opens its steady state, before its first backward frees one; at most its v*M forwards.

    Warm-up forwards of stage r (Megatron's schedules): GPipe runs all v*M forwards first;
    1F1B p - r - 1 (one per later stage the first microbatch still has to pass through and come
    back); interleaved 1F1B 2(p - r - 1) + (v - 1)p (the same on the doubled pipeline of v chunks
    per stage, plus one round of every stage's other v - 1 chunks). With m < p a stage can hold
    no more than the m microbatches there are.
    """
    warmup = {"gpipe": v * m, "1f1b": p - stage - 1, "interleaved": 2 * (p - stage - 1) + (v - 1) * p}[schedule]
    return min(warmup + 1, v * m)


def _assert_in_flight(results, layout):
    _, _, pp, v, sched, _ = layout[:6]
    seen = set()
    for rank, res in enumerate(results):
        stats = res[layout][2]
        want = _in_flight(sched, pp, v, stats["stage"], _m(layout))
        # the engine holds exactly the bound the schedule was validated against, on every stage
        assert stats["peak_in_flight"] == want == stats["bound"], (layout, rank, stats["stage"], stats, want)
        seen.add(stats["stage"])
    assert seen == set(range(pp)), (layout, seen)


@pytest.fixture(scope="module")
def world_4():
    return _spawn_layouts(4, WORLD_4)


def test_pp2_gpipe_1f1b_interleaved_parity_and_in_flight(reference):
    results = _spawn_layouts(2, WORLD_2)
    _check(results, WORLD_2, reference)
    for layout in WORLD_2:
        _, _, _, layers = results[0][layout]
        assert sorted(sum(layers, [])) == list(range(LAYERS))  # every layer exactly once
        # p=2, m=4: GPipe 4 on both stages; 1F1B 2 and 1; interleaved (v=2) 5 and 3; 1F1B at m=1: 1 and 1
        _assert_in_flight(results, layout)


def test_pp4_parity_and_in_flight(world_4, reference):
    layouts = [lay for lay in WORLD_4 if lay[2] == 4]
    assert {lay[4] for lay in layouts} == {"gpipe", "1f1b", "interleaved"}
    assert {_m(lay) for lay in layouts} == {M, 2, 3}
    _check(world_4, layouts, reference)
    for layout in layouts:
        layers = world_4[0][layout][3]
        assert sum(layers, []) == list(range(LAYERS)) and all(layers)  # every layer once, in order
        if layout[3] == 2:
            assert layers == [[i] for i in range(LAYERS)]  # 8 layers in p*v = 8 chunks: one each
        # p=4, m=4: GPipe 4 everywhere; 1F1B 4, 3, 2, 1; interleaved (v=2) 8, 8, 7, 5;
        # m < p: 1F1B at m=2 holds 2, 2, 2, 1, GPipe at m=3 holds 3 everywhere
        _assert_in_flight(world_4, layout)


def test_tp2_pp2_parity_and_scatter_gather_halves_boundary_bytes(world_4, reference):
    layouts = [lay for lay in WORLD_4 if lay[1] == 2]
    _check(world_4, layouts, reference)
    for fam in ("nanogpt", "llama"):
        on, off = (fam, 2, 2, 1, "1f1b", True), (fam, 2, 2, 1, "1f1b", False)
        for res in world_4:
            sent_on, sent_off = res[on][2]["bytes_sent"], res[off][2]["bytes_sent"]
            assert sent_on.keys() == sent_off.keys() and sent_on
            for boundary in sent_on:
                # each tp rank sends 1/t of the boundary activation (and of its gradient)
                assert sent_on[boundary] * 2 == sent_off[boundary], (boundary, sent_on, sent_off)
            # without scatter/gather each rank sends the whole (B, T, h) fp32 activation per microbatch
            whole = BATCH * SEQ * 64 * 4 * M
            assert list(sent_off.values()) == [whole]
