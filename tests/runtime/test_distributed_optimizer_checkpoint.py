"""The distributed optimizer's state through checkpoints: exact resume, resharding, either optimizer.

Two spawns of 4 gloo ranks, run once for the module (the ``sharded_runs`` fixture), on
a GPT-2 with fused QKV (three segments per tp shard) and a vocabulary of 51
(padded to 52 at tp=2), buckets of 4 KiB so the replicas' ranges start and end
mid-row and mid-segment:

1. *save*: 3 steps, saved at step 3: the distributed AdamW at dp=2 x pp=2
   (tied embedding and head on the two stages) and at dp=4, the plain AdamW at
   tp=2 x dp=2, and the model in bf16 with the distributed optimizer (fp32
   masters) at dp=2 x pp=2. The dp=2 x pp=2 runs go on to 6 steps after their
   save: the uninterrupted runs.
2. *load* (new processes): each checkpoint into a freshly built program, and
   the remaining 3 steps: dp=2 x pp=2 at its own layout (fp32 and bf16); its
   dp=2 checkpoint at dp=4; the dp=4 one at tp=2 x pp=2 (one replica); the
   distributed one by the plain AdamW at tp=2 x dp=2; the plain one by the
   distributed optimizer at dp=2 x pp=2. Right after each load the engine saves
   again (step 3, another root).

The checks: at the same layout, losses and weights bitwise equal the
uninterrupted run's (fp32, and bf16 through the saved fp32 masters); at other
layouts, the weights right after the load bitwise equal the saved ones, every
optimizer tensor saved again after the load (moments, step counts) bitwise
equals the loaded checkpoint's, whatever d, tp, pp and optimizer wrote it, and
later losses equal the uninterrupted run's within fp32 rounding. The format:
the same keys as the plain optimizer's, each replica's ranges as chunks that
never overlap and cover each moment exactly once.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from helpers import assert_bitwise_equal, dcp_tensors, on_rank0, parallelize_on, seeded, spawn_ranks, token_batches

from autopar.reference.models import build
from autopar.runtime.checkpoint.description import resolve
from autopar.runtime.checkpoint.sharded_optimizer_state import flat_boxes

pytestmark = pytest.mark.multiprocess

SEQ, ROWS, STEPS, SAVE_AT, VOCAB, LR = 16, 8, 6, 3, 51, 3e-3
SMALL_BUCKETS = 4096
DP2 = dict(pp=2, dp=2, microbatches=2)
SAVES = {"dp2": (DP2, True), "dp4": (dict(dp=4), True), "plain": (dict(tp=2, dp=2), False)}
"""Checkpoint name -> (layout, distributed optimizer) of the 3 steps saved."""
LOADS = {"same": ("dp2", DP2, True), "dp2-to-dp4": ("dp2", dict(dp=4), True),
         "dp4-to-tp2pp2": ("dp4", dict(tp=2, pp=2, microbatches=2), True),
         "into-plain": ("dp2", dict(tp=2, dp=2), False), "from-plain": ("plain", DP2, True)}
"""Case -> (checkpoint, layout loaded at, distributed optimizer)."""


def _fused_gpt_program(layout: dict, dtype=torch.float32):
    """The GPT-2's program for ``layout`` (compiled once per test and process) and the data."""
    model = seeded(build, "gpt2-fused", vocab_size=VOCAB, seq_len=SEQ, n_layer=2, n_head=4, d_model=32).to(dtype)
    data = token_batches(VOCAB, steps=STEPS, rows=ROWS, seed=7, seq=SEQ)
    rows = ROWS // (layout.get("dp", 1) * layout.get("microbatches", 1))
    return parallelize_on(model, data, rows, **layout), data


def _compile_optimizer_programs() -> None:
    """Every program both spawns build, compiled here: the ranks inherit them instead of each
    compiling its own. The one layout without dp fills the 4 ranks (tp=2 x pp=2), so the program
    compiled without a process group is the one a rank would compile."""
    layouts = [(layout, torch.float32) for layout, _ in SAVES.values()]
    layouts += [(layout, torch.float32) for _, layout, _ in LOADS.values()] + [(DP2, torch.bfloat16)]
    for layout, dtype in {repr(each): each for each in layouts}.values():  # each program once
        _fused_gpt_program(layout, dtype)


def _fused_gpt_engine(layout: dict, distributed: bool, dtype=torch.float32):
    program, data = _fused_gpt_program(layout, dtype)
    engine = program.materialize()
    engine.grads.bucket_bytes = SMALL_BUCKETS
    if distributed:
        optimizer = engine.distributed_optimizer(torch.optim.AdamW, lr=LR, weight_decay=0.1)
    else:
        optimizer = torch.optim.AdamW(engine.parameters(), lr=LR, weight_decay=0.1)
    return engine, optimizer, torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0 / (1 + s)), data


def _train_clipped(engine, optimizer, scheduler, batches) -> list[float]:
    losses = []
    for (x,), (y,) in batches:
        losses.append(engine.train_step(x, y))
        engine.clip_grad_norm_(1.0)
        optimizer.step()
        optimizer.zero_grad()
        scheduler.step()
    return losses


def _train_and_save_state(root: str, layout: dict, distributed: bool, dtype=torch.float32, go_on: bool = False) -> dict:
    """SAVE_AT steps, saved; with ``go_on`` the same engine goes on to STEPS steps (a save changes nothing
    a step reads), the uninterrupted run the resumed ones are compared with."""
    engine, optimizer, scheduler, data = _fused_gpt_engine(layout, distributed, dtype)
    losses = _train_clipped(engine, optimizer, scheduler, data[:SAVE_AT])
    out = {"saved": on_rank0(engine.full_state_dict())}
    engine.save(root, optimizer, step=SAVE_AT, scheduler=scheduler).wait()
    if go_on:
        out["losses"] = losses + _train_clipped(engine, optimizer, scheduler, data[SAVE_AT:])
        out["weights"] = on_rank0(engine.full_state_dict())
    return out


def _save_every_layout(root: str) -> dict:
    out = {name: _train_and_save_state(f"{root}/{name}", layout, distributed, go_on=name == "dp2")
           for name, (layout, distributed) in SAVES.items()}
    out["bf16"] = _train_and_save_state(f"{root}/bf16", DP2, True, torch.bfloat16, go_on=True)
    return out


def _load_run(root: str, case: str, source: str, layout: dict, distributed: bool, dtype=torch.float32) -> dict:
    engine, optimizer, scheduler, data = _fused_gpt_engine(layout, distributed, dtype)
    step, _ = engine.load(f"{root}/{source}", optimizer, scheduler)
    loaded = on_rank0(engine.full_state_dict())
    engine.save(f"{root}/resaved/{case}", optimizer, step=step, scheduler=scheduler).wait()
    losses = _train_clipped(engine, optimizer, scheduler, data[step:])
    return {"loaded": loaded, "losses": losses, "weights": on_rank0(engine.full_state_dict())}


def _resume_every_case(root: str) -> dict:
    out = {case: _load_run(root, case, *spec) for case, spec in LOADS.items()}
    out["bf16"] = _load_run(root, "bf16", "bf16", DP2, True, torch.bfloat16)
    return out


@pytest.fixture(scope="module")
def sharded_runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("distopt")
    _compile_optimizer_programs()
    saved = spawn_ranks(_save_every_layout, 4, str(root), timeout_s=600)[0]
    loaded = spawn_ranks(_resume_every_case, 4, str(root), timeout_s=600)
    return {"root": root, "saved": saved, "loaded": loaded}


# ------------------------------------------------------------------- the tests
@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_resume_at_the_same_layout_is_exact(sharded_runs, precision):
    """3 steps, save, new processes, load, 3 steps == 6 steps: losses and weights bitwise."""
    source, case = ("dp2", "same") if precision == "fp32" else ("bf16", "bf16")
    saved = sharded_runs["saved"][source]
    for rank, result in enumerate(r[case] for r in sharded_runs["loaded"]):
        assert result["losses"] == saved["losses"][SAVE_AT:], (precision, rank)
    assert_bitwise_equal(sharded_runs["loaded"][0][case]["loaded"], saved["saved"], f"{precision} loaded")
    assert_bitwise_equal(sharded_runs["loaded"][0][case]["weights"], saved["weights"], f"{precision} after resume")


@pytest.mark.parametrize("case", sorted(LOADS))
def test_reshard_keeps_weights_and_optimizer_state(sharded_runs, case):
    """The weights after the load and the optimizer state saved again right after it equal the loaded
    checkpoint's bit for bit, at another d, tp, pp, or optimizer."""
    source = LOADS[case][0]
    assert_bitwise_equal(sharded_runs["loaded"][0][case]["loaded"], sharded_runs["saved"][source]["saved"],
                    f"{case} loaded")
    root = sharded_runs["root"]
    before = dcp_tensors(resolve(root / source), ("optim.", "model."))
    after = dcp_tensors(resolve(root / "resaved" / case), ("optim.", "model."))
    assert sum(k.endswith(".exp_avg_sq") for k in before) == sum(k.startswith("model.") for k in before)
    assert_bitwise_equal(after, before, f"{case} state")


@pytest.mark.parametrize("case", sorted(LOADS))
def test_resharded_run_continues_within_fp32_rounding(sharded_runs, case):
    """Later losses against the uninterrupted dp=2 x pp=2 run.

    Tolerance: the layouts (and the plain optimizer's all-reduce against the
    reduce-scatter) sum in different orders, so fp32 losses differ by rounding,
    ~1e-7 relative per step; rtol 1e-5 (the repository's fp32 parity tolerance)
    leaves room for AdamW amplifying it where a gradient is near zero, far
    below what one misplaced range of a moment changes.
    """
    reference = sharded_runs["saved"]["dp2"]["losses"][SAVE_AT:]
    for rank, result in enumerate(r[case] for r in sharded_runs["loaded"]):
        torch.testing.assert_close(result["losses"], reference, rtol=1e-5, atol=0,
                                   msg=lambda m, rank=rank: f"{case} rank {rank}: {m}")


def test_ranges_are_written_once_without_overlap(sharded_runs):
    """dp=4's checkpoint: a moment of each parameter as chunks of its full shape that never overlap and
    together cover it exactly once; the bf16 one keeps fp32 masters, the fp32 ones none."""
    for name in ("dp4", "dp2"):
        metadata = dcp.FileSystemReader(resolve(sharded_runs["root"] / name)).read_metadata().state_dict_metadata
        for key, md in metadata.items():
            if key.endswith(".exp_avg"):
                covered = torch.zeros(md.size, dtype=torch.int32)
                for chunk in md.chunks:
                    covered[tuple(slice(o, o + s) for o, s in zip(chunk.offsets, chunk.sizes))] += 1
                assert bool((covered == 1).all()), (name, key, covered.unique())
        assert not any(k.startswith("master.") for k in metadata), name
        assert max(len(md.chunks) for k, md in metadata.items() if k.endswith(".exp_avg")) > 1  # ranges cut rows
    bf16 = dcp.FileSystemReader(resolve(sharded_runs["root"] / "bf16")).read_metadata().state_dict_metadata
    masters = [k for k in bf16 if k.startswith("master.")]
    assert len(masters) == sum(k.startswith("model.") for k in bf16)
    assert {bf16[k].properties.dtype for k in masters} == {torch.float32}
    assert {bf16[k].properties.dtype for k in bf16 if k.startswith("model.")} == {torch.bfloat16}


def test_flat_boxes_cover_a_range_in_contiguous_boxes():
    """A flat range of a (3, 4, 5) tensor as boxes: in order, each contiguous, together the range."""
    shape = (3, 4, 5)
    for start, stop in ((0, 60), (7, 53), (12, 13), (20, 40), (3, 9), (0, 1)):
        boxes = flat_boxes(shape, start, stop)
        entries = []
        index = torch.arange(60).view(shape)
        for offsets, sizes in boxes:
            block = index[tuple(slice(o, o + s) for o, s in zip(offsets, sizes))].reshape(-1)
            assert torch.equal(block, torch.arange(int(block[0]), int(block[0]) + block.numel()))  # contiguous
            entries += block.tolist()
        assert entries == list(range(start, stop)), (start, stop, boxes)
    assert len(flat_boxes(shape, 7, 53)) == 5  # row 0 rest (2 boxes), rows 1, row 2 start (2 boxes)
