"""Context parallelism in the runtime: the mesh, the batch cut into each cp rank's tokens, the loss
weights, the gradients averaged over dp x cp, evaluation outputs and checkpoints.

No graph rewrite is needed to test the runtime: a per-token model (an embedding,
two residual MLP blocks, a head; no positions, no attention) computes each
token's logits from that token alone, so the graph compiled for S/cp tokens *is*
one cp rank's graph. Each program here is compiled with the example at S/cp
tokens and given the split by hand (``program.context``: cp=2, the load-balanced
layout, S tokens, the inputs' and targets' dim 1), its config set to cp=2, as
the compiler's pass will do. The batch passed holds whole sequences.

Two spawns, the programs compiled here first (the ranks inherit them):

1. *4 ranks*: cp=2 x dp=2 with the distributed AdamW (4 KiB buckets:
   parameters straddle the owners' ranges) and clipping, saved after 3 steps;
   cp=2 x tp=2; cp=2 x pp=2 (two microbatches, 1F1B).
2. *2 ranks*: cp=2 with a plain AdamW, saved after 3 steps; targets with the
   ignore_index in cp rank 1's tokens only; ``eval_step`` (loss, and the logits
   gathered over cp with ``outputs=True``); the cp=2 checkpoint loaded at dp=2.

In this process: the cp=2 checkpoints loaded at cp=1; the mesh arithmetic of
tp=2 x cp=2 x dp=2 x pp=2 as numbers; the batch cut and the loss refusals on a
mesh without a process group.

The checks: every step's loss and every gradient equal the single-device run
on the whole sequences (``assert_ranks_match``: fp32, the first step within
rtol 1e-5 / atol 1e-6, later ones per tensor within 1e-4 relative, because
the parallel run only sums the same terms in another order and AdamW's first
update amplifies rounding in near-zero gradients); the clipping norm equals
one device's (rtol 1e-5); the gathered logits one device's (same tolerance);
a checkpoint loaded at another cp or dp gives the saved weights and optimizer
state bit for bit.
"""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch
import torch.distributed.checkpoint as dcp
import torch.nn as nn
import torch.nn.functional as F
from helpers import assert_bitwise_equal, assert_ranks_match, on_rank0, reference_run, spawn_ranks

import autopar
from autopar.core.comm.cp_layout import ContextSplit, cp_shard
from autopar.reference.models import build
from autopar.core.config import ParallelConfig
from autopar.core.errors import ConfigError
from autopar.core.mesh import Mesh, MeshShape
from autopar.runtime.checkpoint.description import resolve
from autopar.runtime.engine.errors import EngineUsageError
from autopar.runtime.engine.micro_batches import MicroBatches

VOCAB, HIDDEN, SEQ, CP, ROWS, STEPS, LR, CLIP = 32, 16, 8, 2, 4, 3, 1e-2, 0.5
"""Whole sequences of SEQ tokens, SEQ/CP on each cp rank; ROWS sequences a step."""
IGNORE = -100
SMALL_BUCKETS = 4096

LAYOUTS = {"cp2": dict(), "cp2dp2": dict(dp=2), "cp2tp2": dict(tp=2), "cp2pp2": dict(pp=2, microbatches=2)}
"""Layout -> what parallelize gets besides cp (given as cp=2 afterwards): the world is 2 x tp x pp x dp."""
WHOLE = {"dp2": dict(dp=2), "one": dict()}
"""Programs over whole sequences (no cp) that load the cp=2 checkpoints."""


class TokenBlock(nn.Module):
    """x + W2 gelu(W1 x): each token on its own."""

    def __init__(self):
        super().__init__()
        self.up = nn.Linear(HIDDEN, 4 * HIDDEN)
        self.down = nn.Linear(4 * HIDDEN, HIDDEN)

    def forward(self, x):
        return x + self.down(F.gelu(self.up(x)))


class TokenMLP(nn.Module):
    """Embedding, two per-token blocks (repeated layers: a pipeline cut), a head to the vocabulary."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, HIDDEN)
        self.blocks = nn.ModuleList([TokenBlock(), TokenBlock()])
        self.head = nn.Linear(HIDDEN, VOCAB)

    def forward(self, x):
        h = self.embed(x)
        for block in self.blocks:
            h = block(h)
        return self.head(h)


def _model() -> TokenMLP:
    torch.manual_seed(0)
    return TokenMLP()


def _data(ignored: bool = False):
    """STEPS global batches of ROWS whole sequences; ``ignored``: targets at positions 2..4 of the first
    rows are the ignore_index: every one among cp rank 1's tokens (positions 2..5), none among rank 0's."""
    g = torch.Generator().manual_seed(1)
    out = []
    for _ in range(STEPS):
        x = torch.randint(0, VOCAB, (ROWS, SEQ), generator=g)
        y = torch.randint(0, VOCAB, (ROWS, SEQ), generator=g)
        if ignored:
            y[0, 2:5] = IGNORE
            y[1, 3] = IGNORE
        out.append(((x,), (y,)))
    return out


_PROGRAMS: dict[str, autopar.ParallelProgram] = {}
"""Layout name -> its program, compiled in the test process before the spawns (the ranks inherit them)."""


def _cp_program(layout: dict) -> autopar.ParallelProgram:
    """The per-token model compiled for one cp rank's SEQ/CP tokens, then given the split over CP ranks."""
    per_replica = ROWS // (layout.get("dp", 1) * layout.get("microbatches", 1))
    x = torch.zeros((per_replica, SEQ // CP), dtype=torch.long)
    world = layout.get("tp", 1) * layout.get("pp", 1) * layout.get("dp", 1)
    program = autopar.parallelize(_model(), example_inputs=(x,), example_targets=x.clone(), world_size=world, **layout)
    traced = program.traced
    split = ContextSplit(cp=CP, balanced=True, seq_len=SEQ,
                         seq_dims={traced.input_names[0]: 1, traced.target_names[0]: 1})
    object.__setattr__(program, "context", split)
    object.__setattr__(program, "config", dataclasses.replace(program.config, cp=CP, world_size=None))
    return program


def _whole_program(layout: dict) -> autopar.ParallelProgram:
    x = torch.zeros((ROWS // layout.get("dp", 1), SEQ), dtype=torch.long)
    return autopar.parallelize(_model(), example_inputs=(x,), example_targets=x.clone(),
                               world_size=layout.get("dp", 1), **layout)


def _program(name: str) -> autopar.ParallelProgram:
    if name not in _PROGRAMS:
        _PROGRAMS[name] = _cp_program(LAYOUTS[name]) if name in LAYOUTS else _whole_program(WHOLE[name])
    return _PROGRAMS[name]


# ----------------------------------------------------------------------------- in the ranks
def _train(engine, optimizer, data, clip: float | None = None):
    losses, grads, norms = [], [], []
    for (x,), (y,) in data:
        losses.append(engine.train_step(x, y))
        if clip is not None:
            norms.append(engine.clip_grad_norm_(clip))
        grads.append(engine.full_grads())
        optimizer.step()
        optimizer.zero_grad()
    return losses, grads, norms


def _plain(name: str, data):
    engine = _program(name).materialize()
    optimizer = torch.optim.AdamW(engine.parameters(), lr=LR)
    return engine, optimizer, _train(engine, optimizer, data)


def _four_ranks(root: str) -> dict:
    engine = _program("cp2dp2").materialize()
    engine.grads.bucket_bytes = SMALL_BUCKETS
    optimizer = engine.distributed_optimizer(torch.optim.AdamW, lr=LR)
    losses, grads, norms = _train(engine, optimizer, _data(), clip=CLIP)
    out = {"cp2dp2": (losses, grads), "norms": norms, "axes": [(b.axis, b.dp) for b in optimizer.buckets],
           "cp2dp2-saved": on_rank0(engine.full_state_dict())}
    engine.save(f"{root}/cp2dp2", optimizer, step=STEPS).wait()
    for name in ("cp2tp2", "cp2pp2"):
        out[name] = _plain(name, _data())[2][:2]
    return out


def _two_ranks(root: str) -> dict:
    engine, optimizer, (losses, grads, _) = _plain("cp2", _data())
    out = {"cp2": (losses, grads), "cp2-saved": on_rank0(engine.full_state_dict()),
           "cp2-exp_avg": on_rank0({n: optimizer.state[p]["exp_avg"].clone()
                                    for n, p in engine.named_local_parameters()})}
    engine.save(f"{root}/cp2", optimizer, step=STEPS).wait()
    (x,), (y,) = _data()[0]
    out["eval"] = engine.eval_step(x, y, outputs=True)
    out["ignored"] = _plain("cp2", _data(ignored=True))[2][:2]
    at_dp2 = _program("dp2").materialize()
    loaded = torch.optim.AdamW(at_dp2.parameters(), lr=LR)
    at_dp2.load(f"{root}/cp2", loaded)
    out["dp2-loaded"] = on_rank0(at_dp2.full_state_dict())
    return out


# ----------------------------------------------------------------------------- the runs
@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("context")
    for name in (*LAYOUTS, *WHOLE):
        _program(name)
    four = spawn_ranks(_four_ranks, 4, str(root), timeout_s=300)
    two = spawn_ranks(_two_ranks, 2, str(root), timeout_s=300)
    return {"root": root, "four": four, "two": two}


def _reference(data=None, clip: float | None = None):
    return reference_run(_model(), data or _data(), lr=LR, clip_grad_norm=clip)


def test_cp2_matches_one_device(runs):
    assert_ranks_match(_reference(), [r["cp2"] for r in runs["two"]], "cp=2")


def test_cp2_tp2_and_pp2_match_one_device(runs):
    reference = _reference()
    for name in ("cp2tp2", "cp2pp2"):
        assert_ranks_match(reference, [r[name] for r in runs["four"]], name)


def test_cp2_dp2_distributed_optimizer_with_clipping_matches_one_device(runs):
    """Gradients reduce-scattered over the 4 ranks of 'dp_cp', each owning a quarter of every bucket;
    the norm counts each entry once, as one device's ``clip_grad_norm_`` does."""
    assert_ranks_match(_reference(clip=CLIP), [r["cp2dp2"] for r in runs["four"]], "cp=2 x dp=2, distributed")
    assert {axes for r in runs["four"] for axes in r["axes"]} == {("dp_cp", 4)}
    model = _model()
    (x,), (y,) = _data()[0]
    autopar.lm_cross_entropy(model(x), y).backward()
    want = float(torch.nn.utils.clip_grad_norm_(model.parameters(), float("inf")))
    for rank, r in enumerate(runs["four"]):
        torch.testing.assert_close(r["norms"][0], want, rtol=1e-5, atol=0, msg=f"rank {rank}'s first norm")


def test_ignored_targets_in_one_cp_rank_weigh_tokens_across_ranks(runs):
    """Rank 0 counts 8 targets of the first rows, rank 1 four fewer: each rank's mean weighted by its share."""
    data = _data(ignored=True)
    assert_ranks_match(_reference(data), [r["ignored"] for r in runs["two"]], "cp=2, ignored targets")


def test_eval_step_loss_and_logits_gathered_over_cp(runs):
    """Evaluated after the 3 steps: one device holding the weights saved then."""
    model = _model().eval()
    model.load_state_dict(runs["two"][0]["cp2-saved"])
    (x,), (y,) = _data()[0]
    with torch.no_grad():
        logits = model(x)
        loss = float(autopar.lm_cross_entropy(logits, y))
    for rank, r in enumerate(runs["two"]):
        got_loss, got_logits = r["eval"]
        torch.testing.assert_close(got_loss, loss, rtol=1e-5, atol=1e-6, msg=f"rank {rank}'s eval loss")
        torch.testing.assert_close(got_logits, logits, rtol=1e-5, atol=1e-6,
                                   msg=lambda m, rank=rank: f"rank {rank}'s logits in global token order: {m}")


def test_checkpoints_at_cp2_load_at_cp1_and_dp2(runs):
    """The weights and AdamW state are replicated over cp: stored once, loaded at any cp, bit for bit."""
    root = runs["root"]
    saved = runs["two"][0]["cp2-saved"]
    assert_bitwise_equal(runs["two"][0]["dp2-loaded"], saved, "cp=2 checkpoint at dp=2")
    engine = _program("one").materialize()
    optimizer = torch.optim.AdamW(engine.parameters(), lr=LR)
    step, _ = engine.load(f"{root}/cp2", optimizer)
    assert step == STEPS
    assert_bitwise_equal(engine.full_state_dict(), saved, "cp=2 checkpoint at cp=1")
    exp_avg = {n: optimizer.state[p]["exp_avg"] for n, p in engine.named_local_parameters()}
    assert_bitwise_equal(exp_avg, runs["two"][0]["cp2-exp_avg"], "AdamW's exp_avg at cp=1")
    keys = dcp.FileSystemReader(resolve(f"{root}/cp2")).read_metadata().state_dict_metadata.keys()
    assert sorted(k for k in keys if k.startswith("rng.")) == ["rng.0.0.cp0.0", "rng.0.0.cp1.0"]
    # the distributed optimizer's quarters (over dp x cp) make whole state: a plain AdamW at cp=1 loads it
    engine = _program("one").materialize()
    optimizer = torch.optim.AdamW(engine.parameters(), lr=LR)
    engine.load(f"{root}/cp2dp2", optimizer)
    assert_bitwise_equal(engine.full_state_dict(), runs["four"][0]["cp2dp2-saved"], "cp=2 x dp=2 checkpoint at cp=1")
    assert all(torch.isfinite(optimizer.state[p]["exp_avg_sq"]).all() for p in engine.parameters())


# ----------------------------------------------------------------------------- no process group
def test_mesh_groups_tp2_cp2_dp2_pp2():
    shape = MeshShape(tp=2, pp=2, dp=2, cp=2)
    assert shape.world == 16
    assert shape.tp_groups()[:4] == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert shape.cp_groups()[:4] == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert shape.dp_groups()[:4] == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert shape.dp_cp_groups() == [[0, 2, 4, 6], [1, 3, 5, 7], [8, 10, 12, 14], [9, 11, 13, 15]]
    assert shape.pp_groups()[:3] == [[0, 8], [1, 9], [2, 10]]
    # rank 13 = tp 1 + 2 * (cp 0 + 2 * (dp 1 + 2 * pp 1))
    assert (shape.coords(13), shape.cp_of(13), shape.dp_cp_of(13)) == ((1, 1, 1), 0, 2)
    assert shape.rank(1, 1, 1, 0) == 13 and shape.rank(1, 1, 1) == 13 and shape.rank(0, 1, 0, 1) == 6
    mesh = Mesh(shape, 6)
    assert (mesh.pp_rank, mesh.dp_rank, mesh.cp_rank, mesh.tp_rank, mesh.dp_cp_rank) == (0, 1, 1, 0, 3)
    assert (mesh.tp_members(), mesh.cp_members(), mesh.peer(1)) == ([6, 7], [4, 6], 14)
    # cp = 1 keeps the old numbering: rank = tp + t * (dp + d * pp)
    assert MeshShape(2, 2, 2).dp_cp_groups() == MeshShape(2, 2, 2).dp_groups() == [[0, 2], [1, 3], [4, 6], [5, 7]]


def test_config_world_is_tp_cp_pp_dp():
    config = ParallelConfig(tp=2, cp=2, pp=2, world_size=16)
    assert (config.data_parallel, config.mesh.cp, config.mesh.world) == (2, 2, 16)
    with pytest.raises(ConfigError, match=r"tp=2 x cp=2 x pp=1 needs a multiple of 4 ranks, the world has 6"):
        ParallelConfig(tp=2, cp=2, world_size=6)
    with pytest.raises(ConfigError, match=r"cp=2 with ep=2: .* Fix: cp=1 \(ep alone\) or ep=1"):
        ParallelConfig(cp=2, ep=2, dp=2)
    with pytest.raises(ConfigError, match=r"cp must be >= 1"):
        ParallelConfig(cp=0)
    x = torch.zeros((2, SEQ), dtype=torch.long)
    attention = build("gpt", vocab_size=VOCAB, seq_len=SEQ, n_layer=1, n_head=2, d_model=HIDDEN)
    program = autopar.parallelize(attention, example_inputs=(x,), example_targets=x, cp=2, world_size=8)
    assert (program.config.cp, program.config.data_parallel, program.config.mesh.world) == (2, 4, 8)
    assert program.context.cp == 2  # the compiler's split, which the runtime follows


def test_batch_cut_into_each_cp_rank_tokens():
    """Both cp ranks of a replica take its rows (dp=2: replica 1's rows 2, 3) and their own tokens."""
    program = _program("cp2dp2")
    (x,), (y,) = _data()[0]
    for rank, replica, cp_rank in ((1, 0, 1), (3, 1, 1), (2, 1, 0)):  # tp=1: rank = cp + 2 * dp
        mesh = Mesh(program.config.mesh, rank)
        assert (mesh.dp_rank, mesh.cp_rank) == (replica, cp_rank)
        micro, whole = MicroBatches(program, mesh, torch.device("cpu")).split((x, y))
        rows = slice(2 * replica, 2 * replica + 2)
        assert whole and len(micro) == 1
        assert torch.equal(micro[0][0], cp_shard(x[rows], 1, cp_rank, CP, True))
        assert torch.equal(micro[0][1], cp_shard(y[rows], 1, cp_rank, CP, True))


def test_cp_refuses_losses_that_do_not_count_tokens():
    program = _program("cp2")
    mesh = Mesh(program.config.mesh, 0)
    by_mean = copy.copy(program)
    object.__setattr__(by_mean, "config", dataclasses.replace(program.config, loss_reduction="microbatch"))
    with pytest.raises(EngineUsageError, match=r"loss_reduction='microbatch' was asked for.*Fix: .*or cp=1"):
        MicroBatches(by_mean, mesh, torch.device("cpu"))
    without = copy.copy(program)
    object.__setattr__(without, "context", None)
    with pytest.raises(EngineUsageError, match=r"the mesh has cp=2 .* parallelize\(\.\.\., cp=2\)"):
        MicroBatches(without, mesh, torch.device("cpu"))
