"""``overlap=`` on 2 gloo ranks: the same losses and gradients as without it, and as one device.

One spawn runs every case on the same two ranks, each layout trained twice,
with the overlap and without:

- async tensor parallelism (``overlap={'tp'}``) at tp=2 with sequence
  parallelism: the reference GPT (q, k and v fused with one all-gather), the
  same with recompute='layer' (the fused ops replayed inside checkpoints) and
  in bf16 (the backward's GEMMs under the forward's autocast), and
  HuggingFace GPT-2 (its Conv1D GEMMs as ``addmm``/``mm``, two sequences per
  microbatch split sequence by sequence); then an evaluation step;
- early receives (``overlap={'p2p'}``) at pp=2, 1F1B and interleaved (v=2), and
  1F1B with compiled chunks (``compile='aot_eager'``).

At t=2 every ring sum is one addition, so the fused ops give the unfused path's
bits: each run with the overlap equals its run without bit for bit (losses,
gradients, the evaluation loss); early receives change only when a message is
posted, so they too. Against one device (the fp32 runs): ``families.assert_steps_match``
(the first step element-wise within rtol 1e-5 / atol 1e-6, later steps per tensor).
"""

import pytest
from families import assert_steps_match, batches, make, train_steps
from helpers import assert_bitwise_equal, parallelize_on, reference_run, spawn_ranks

pytestmark = pytest.mark.multiprocess

LR, STEPS, ROWS = 1e-3, 2, 4
SP = dict(tp=2, sequence_parallel=True)
CASES = {  # label -> (family, layers, layout, overlap)
    "nanogpt tp2 sp": ("nanogpt", 2, SP, {"tp"}),
    "nanogpt tp2 sp recompute": ("nanogpt", 2, dict(SP, recompute="layer"), {"tp"}),
    "nanogpt tp2 sp bf16": ("nanogpt", 2, dict(SP, precision="bf16"), {"tp"}),
    "hf-gpt2 tp2 sp": ("hf-gpt2", 2, SP, {"tp"}),
    "nanogpt pp2 1f1b": ("nanogpt", 4, dict(pp=2, microbatches=4), {"p2p"}),
    "llama pp2 interleaved": ("llama", 4, dict(pp=2, virtual_stages=2, microbatches=4), {"p2p"}),
    "nanogpt pp2 1f1b compiled": ("nanogpt", 4, dict(pp=2, microbatches=2, compile="aot_eager"), {"p2p"}),
}


def _program(label: str, overlap):
    family, layers, layout, _ = CASES[label]
    model, vocab = make(family, layers=layers)
    data = batches(vocab, steps=STEPS, rows=ROWS)
    return parallelize_on(model, data, ROWS // layout.get("microbatches", 1), overlap=overlap, **layout), data


def _train(label: str, overlap):
    program, data = _program(label, overlap)
    engine = program.materialize()
    losses, grads = train_steps(engine, data, LR)
    (x,), (y,) = data[0]
    return losses, grads, engine.eval_step(x, y)


def _run_all():
    return {label: {on: _train(label, case[3] if on else False) for on in (True, False)}
            for label, case in CASES.items()}


@pytest.fixture(scope="module")
def runs():
    for label, case in CASES.items():  # compiled here once, inherited by the ranks
        program, _ = _program(label, case[3])
        if "tp" in case[3]:  # every layer's collectives fused: the runs compare the fused ops
            assert program.async_tp.count("gather_from_sp") >= 2 * program.layers.count, label
            assert program.async_tp.count("reduce_scatter_to_sp") == 2 * program.layers.count, label
        else:  # some receive posted earlier than without the overlap
            assert program.schedule.actions != _program(label, False)[0].schedule.actions, label
        _program(label, False)
    return spawn_ranks(_run_all, 2)


def test_overlap_changes_no_bit(runs):
    for rank, out in enumerate(runs):
        for label, by in out.items():
            (losses, grads, evaluation), (losses0, grads0, evaluation0) = by[True], by[False]
            assert losses == losses0 and evaluation == evaluation0, (label, rank, losses, losses0)
            for step, (g, g0) in enumerate(zip(grads, grads0)):
                assert_bitwise_equal(g, g0, f"{label} rank {rank} step {step}")


def test_overlap_matches_one_device(runs):
    for label, (family, layers, layout, _) in CASES.items():
        if layout.get("precision") == "bf16":
            continue  # bf16 against the fp32 device run: the bitwise test compares it with its run without
        model, vocab = make(family, layers=layers)
        ref_losses, ref_grads = reference_run(model, batches(vocab, steps=STEPS, rows=ROWS), lr=LR)
        for rank, out in enumerate(runs):
            losses, grads, _ = out[label][True]
            assert_steps_match(ref_losses, ref_grads, losses, grads, label=f"{label} rank {rank}")
