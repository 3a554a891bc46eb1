"""A step's batch is checked before any work, and padded targets give the one-device loss.

- Ids: a token id or target beyond what it indexes (the embedding's rows, the
  loss's classes; read from the graph, ``program.batch_roles``) or negative is
  refused with the tensor's name, the value, its row and position, the size and
  the fix, before any action runs (no gradient touched), on every rank: at tp=2
  the vocabulary-parallel embedding and loss would otherwise mask it. Targets
  equal to the loss's ignore_index pass.
- Dtypes: float targets are refused naming both dtypes and ``.long()``; int32
  ids (used only as indices) are cast and give the int64 step's loss.
- Loss: with ``ignore_index`` padding that differs per microbatch and per
  replica (one microbatch with 3 counted targets, one with none), the step's
  loss and every gradient equal one device's on the global batch, at pp=2 x
  dp=2 (1F1B on the global batch; ZB-H1's split backward on each replica's own
  batch with the distributed optimizer and clipping) and at tp=2 with the
  vocabulary-parallel cross-entropy; ``loss_reduction='microbatch'`` gives the
  mean of the microbatch means.

Tolerances: fp32 on both sides, and the parallel run only sums the same terms in
another order (microbatch sums weighted by n_i / N instead of one sum over the
batch, split matmuls, all-reduces): ``FP32_TOLERANCE`` (rtol 1e-5, atol 1e-6),
as every parity test.
"""

from __future__ import annotations

import copy
import math

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from families import SEQ, make
from helpers import parallelize_on, reference_run, spawn_ranks

from autopar.reference.parity import FP32_TOLERANCE, assert_parity
from autopar.runtime.engine.batch_checks import BatchError

ROWS = 2
"""Rows of a microbatch."""
COUNTS = (30, 3, 17, 0)
"""Counted targets of the four microbatches of the padded batch (SEQ = 16 tokens per row)."""
EVEN_LESS = (30, 3, 17, 9)
"""The same without an empty microbatch."""


def padded_batch(vocab: int, counts=COUNTS, seed: int = 1):
    """len(counts) microbatches of ROWS x SEQ tokens, microbatch i keeping counts[i] targets (the
    others -100), spread unevenly over its rows: [((x,), (y,))]."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(0, vocab, (ROWS * len(counts), SEQ), generator=g)
    y = torch.randint(0, vocab, (ROWS * len(counts), SEQ), generator=g)
    for i, n in enumerate(counts):
        keep = torch.zeros(ROWS * SEQ, dtype=torch.bool)
        keep[torch.randperm(ROWS * SEQ, generator=g)[:n]] = True
        y[i * ROWS:(i + 1) * ROWS][~keep.view(ROWS, SEQ)] = -100
    assert [int((y[i * ROWS:(i + 1) * ROWS] != -100).sum()) for i in range(len(counts))] == list(counts)
    return [((x,), (y,))]


def microbatch_means(model, data, m: int) -> float:
    """The mean of the m microbatch means (one device): what loss_reduction='microbatch' computes."""
    (x,), (y,) = data[0]
    rows = x.shape[0] // m
    with torch.no_grad():
        means = [F.cross_entropy(model(x[i * rows:(i + 1) * rows]).flatten(0, -2), y[i * rows:(i + 1) * rows].flatten())
                 for i in range(m)]
    return float(torch.stack(means).mean())


# ------------------------------------------------------------------ one process
@pytest.fixture(scope="module")
def gpt():
    model, vocab = make("nanogpt")
    data = padded_batch(vocab, counts=EVEN_LESS)
    engine = parallelize_on(model, data, ROWS, microbatches=4).materialize()
    return model, vocab, data, engine


def _refused_before_work(engine, x, y) -> str:
    engine.zero_grad()
    with pytest.raises(BatchError) as err:
        engine.train_step(x, y)
    assert all(p.grad is None for p in engine.parameters()), "the step did work before the check"
    return str(err.value)


def test_out_of_range_ids_are_refused_before_any_work(gpt):
    _, vocab, data, engine = gpt
    (x,), (y,) = data[0]
    bad = x.clone()
    bad[5, 7] = vocab + 4680
    msg = _refused_before_work(engine, bad, y)
    assert f"'idx' holds {vocab + 4680} at row 5, position 7" in msg
    assert f"outside the {vocab} rows of the embedding table wte.weight" in msg and f"[0, {vocab})" in msg
    assert "tokenizer that matches the model" in msg

    bad = x.clone()
    bad[0, 0] = -1
    assert "'idx' holds -1 at row 0, position 0" in _refused_before_work(engine, bad, y)

    bad = y.clone()
    bad[6, 11] = vocab
    msg = _refused_before_work(engine, x, bad)
    assert f"'targets' holds {vocab} at row 6, position 11" in msg
    assert f"the {vocab} classes of cross_entropy_loss" in msg and "or equal the ignore_index -100" in msg


def test_ignore_index_targets_pass_and_match_one_device(gpt):
    """Targets of -100 are allowed; microbatches counting 30, 3, 17 and 9 targets give the loss and
    gradients of the one-device mean over all 59 (the mean of the microbatch means is off)."""
    model, _, data, engine = gpt
    engine.zero_grad()
    loss = engine.train_step(*data[0][0], *data[0][1])
    ref_losses, ref_grads = reference_run(model, data)
    assert_parity(ref_losses, ref_grads[0], [loss], engine.full_grads(), label="tokens", **FP32_TOLERANCE)
    assert abs(microbatch_means(model, data, 4) - ref_losses[0]) > 1e-3  # the old weighting differs


def test_dtypes_are_checked_and_index_widths_cast(gpt):
    _, _, data, engine = gpt
    (x,), (y,) = data[0]
    msg = _refused_before_work(engine, x, y.float())
    assert "'targets' has dtype torch.float32, but the program was traced with torch.int64" in msg
    assert "targets.long()" in msg
    msg = _refused_before_work(engine, x.double(), y)
    assert "'idx' has dtype torch.float64" in msg and "idx.long()" in msg
    engine.zero_grad()  # int32 ids and targets (indices only): cast, the same step
    assert engine.train_step(x.int(), y.int()) == engine.train_step(x, y)


def test_non_index_tensor_of_another_dtype_is_refused():
    """A float input is not an index: float64 for a float32 placeholder is refused, not cast."""
    torch.manual_seed(0)
    net = torch.nn.Linear(4, 3)
    x, y = torch.randn(4, 4), torch.randn(4, 3)
    engine = parallelize_on(net, [((x,), (y,))], 2, microbatches=2, loss_fn=F.mse_loss).materialize()
    assert engine.program.batch_roles.ids == () and engine.program.batch_roles.loss is None
    with pytest.raises(BatchError, match=r"'input_' has dtype torch.float64, but the program was traced with "
                                         r"torch.float32\. Fix: pass input_.float\(\)"):
        engine.train_step(x.double(), y)


def test_graph_records_ids_and_the_token_loss():
    """From the graph, not from names: a loss that shifts and pads its labels counts the targets it
    reads (the shift's pad included); a sum-reduced loss is not a token mean."""
    model, vocab = make("nanogpt")

    def shifted(logits, labels):
        labels = F.pad(labels, (0, 1), value=-100)[..., 1:]
        return F.cross_entropy(logits.flatten(0, -2), labels.flatten())

    x = torch.randint(0, vocab, (ROWS, SEQ))
    program = parallelize_on(model, [((x,), (x,))], ROWS, loss_fn=shifted)
    roles = program.batch_roles
    assert {(u.name, u.size, u.ignore_index, u.kind) for u in roles.ids} == {
        ("idx", vocab, None, "embedding"), ("labels", vocab, -100, "target")}
    assert roles.index_only == {"idx", "labels"}
    assert roles.loss.reads == ("labels",) and roles.loss.ignore_index == -100
    labels = torch.full((ROWS, SEQ), 3)
    labels[1, 4:] = -100
    assert int((roles.loss.targets(labels) != -100).sum()) == (SEQ - 1) + 3  # row 0 loses its first, row 1 keeps 3

    summed = parallelize_on(model, [((x,), (x,))], ROWS,
                            loss_fn=lambda z, t: F.cross_entropy(z.flatten(0, -2), t.flatten(), reduction="sum"))
    assert summed.batch_roles.loss is None and "not mean-reduced" in summed.batch_roles.why_not_tokens
    # the summary says which weighting the step uses, and why not the token-exact one
    assert "the mean over the global batch's counted targets (ignore_index -100)" in program.summary()
    assert "loss: the mean of the microbatches' losses (" in summed.summary()
    assert "not mean-reduced" in summed.summary()


def test_an_empty_global_batch_is_nan_with_zero_gradients_as_on_one_device(gpt):
    model, _, data, engine = gpt
    (x,), (y,) = data[0]
    engine.zero_grad()
    assert math.isnan(engine.train_step(x, torch.full_like(y, -100)))
    assert all(float(g.abs().max()) == 0 for g in engine.full_grads().values())


def test_microbatch_option_is_the_mean_of_microbatch_means():
    model, vocab = make("nanogpt")
    data = padded_batch(vocab, counts=EVEN_LESS)
    engine = parallelize_on(model, data, ROWS, microbatches=4, loss_reduction="microbatch").materialize()
    # one device sums the microbatches in another order: FP32_TOLERANCE
    torch.testing.assert_close(engine.eval_step(*data[0][0], *data[0][1]), microbatch_means(model, data, 4),
                               **FP32_TOLERANCE)
    with pytest.raises(ValueError, match="loss_reduction must be one of"):
        parallelize_on(model, data, ROWS, loss_reduction="mean")


# ------------------------------------------------------------------ gloo ranks
def _grads_and_loss(engine, x, y):
    engine.zero_grad()
    loss = engine.train_step(x, y)
    return loss, engine.full_grads()


def _tp2_program(family: str):
    """The family at tp=2 (once per test and process), its vocabulary and the padded batch."""
    model, vocab = make(family)
    data = padded_batch(vocab)
    return parallelize_on(model, data, ROWS, tp=2, microbatches=4), vocab, data


def _tp2_worker(family: str):
    program, vocab, data = _tp2_program(family)
    (x,), (y,) = data[0]
    engine = program.materialize()
    out = {"vocab_parallel": engine.program.collectives()["vocab_parallel_cross_entropy"] > 0,
           "tokens": _grads_and_loss(engine, x, y), "eval": engine.eval_step(x, y)}
    bad = x.clone()
    bad[3, 2] = vocab + 4680  # under tp=2 the vocabulary-parallel embedding would mask it
    try:
        engine.train_step(bad, y)
        out["error"] = None
    except BatchError as e:
        out["error"] = str(e)
    out["after"] = _grads_and_loss(engine, x, y)[0]  # nothing of the refused step stayed behind
    return out


@pytest.mark.multiprocess
def test_tp2_vocab_parallel_loss_and_id_checks():
    family = "hf-llama"
    model, vocab = make(family)
    data = padded_batch(vocab)
    ref_losses, ref_grads = reference_run(model, data)
    _tp2_program(family)  # compile once here: the ranks inherit the program
    for rank, r in enumerate(spawn_ranks(_tp2_worker, 2, family)):
        assert r["vocab_parallel"], "the loss must run vocabulary-parallel for this test to mean anything"
        loss, grads = r["tokens"]
        assert_parity(ref_losses, ref_grads[0], [loss], grads, label=f"tp=2 rank {rank}", **FP32_TOLERANCE)
        torch.testing.assert_close(r["eval"], ref_losses[0], **FP32_TOLERANCE)
        assert r["error"] is not None, f"rank {rank} took an id beyond the vocabulary"
        assert f"'input_ids' holds {vocab + 4680} at row 3, position 2" in r["error"]
        assert f"outside the {vocab} rows of the embedding table model.embed_tokens.weight" in r["error"]
        assert r["after"] == loss


PP2_DP2 = dict(pp=2, microbatches=2, world_size=4)
"""pp=2 on 4 ranks: dp=2 from the world size, given so that a program compiled outside the ranks has it too."""


def _pp2_dp2_programs() -> dict:
    """The three programs of the pp=2 x dp=2 ranks (once per test and process): 1F1B, ZB-H1, and
    1F1B averaging the microbatch means."""
    model, vocab = make("nanogpt")
    data = padded_batch(vocab)
    return {"1f1b": parallelize_on(model, data, ROWS, **PP2_DP2),
            "zb-h1": parallelize_on(model, data, ROWS, schedule="zb-h1", **PP2_DP2),
            "microbatch": parallelize_on(model, data, ROWS, loss_reduction="microbatch", **PP2_DP2)}


def _pp2_dp2_worker():
    programs = _pp2_dp2_programs()
    vocab = make("nanogpt")[1]
    (x,), (y,) = padded_batch(vocab)[0]
    engine = programs["1f1b"].materialize()
    rank = engine.dp_rank
    mine = slice(rank * 2 * ROWS, (rank + 1) * 2 * ROWS)  # this replica's own rows
    out = {"global": _grads_and_loss(engine, x, y)}

    zb = programs["zb-h1"].materialize()
    opt = zb.distributed_optimizer(torch.optim.SGD, lr=0.0)
    zb.zero_grad()
    loss = zb.train_step(x[mine], y[mine])
    out["zb_replica"] = (loss, zb.clip_grad_norm_(1e9), zb.full_grads())
    opt.step()  # lr 0: the same weights, gathered while the next step exchanges its counts over dp
    zb.zero_grad()
    out["zb_again"] = zb.train_step(x[mine], y[mine])

    old = programs["microbatch"].materialize()
    (x9,), (y9,) = padded_batch(vocab, counts=EVEN_LESS)[0]  # no empty microbatch: its mean would be NaN
    out["microbatch"] = old.train_step(x9, y9)

    bad = x[mine].clone()
    if rank == 1:
        bad[2, 9] = vocab + 4680  # only replica 1's own batch holds it: every rank must refuse
    try:
        engine.train_step(bad, y[mine])
        out["error"] = None
    except BatchError as e:
        out["error"] = str(e)
    # replica 1 passes targets of another dtype: its ranks refuse them, and replica 0's ranks, whose
    # batch is fine, refuse the step too instead of waiting for replica 1 in the exchange
    try:
        engine.train_step(x[mine], y[mine].float() if rank == 1 else y[mine])
        out["dtype_error"] = None
    except (BatchError, ValueError) as e:
        out["dtype_error"] = str(e)
    dist.barrier()
    return out


@pytest.mark.multiprocess
def test_pp2_dp2_padded_targets_match_one_device():
    """Replica 0 counts 30 + 3 targets, replica 1 counts 17 + 0: each step equals one device's mean
    over the 50, through 1F1B, ZB-H1's B/W split with the distributed optimizer (and the clipping
    norm), and both batch forms; the 'microbatch' option is the mean of the four microbatch means."""
    model, vocab = make("nanogpt")
    data = padded_batch(vocab)
    ref_losses, ref_grads = reference_run(model, data)
    one = copy.deepcopy(model)  # the clipping norm of one device: each parameter once (a tied one too)
    (x,), (y,) = data[0]
    F.cross_entropy(one(x).flatten(0, -2), y.flatten()).backward()
    ref_norm = float(torch.nn.utils.clip_grad_norm_(one.parameters(), 1e9))
    _pp2_dp2_programs()  # compile once here: the ranks inherit the programs
    for rank, r in enumerate(spawn_ranks(_pp2_dp2_worker, 4)):
        loss, grads = r["global"]
        assert_parity(ref_losses, ref_grads[0], [loss], grads, label=f"1f1b rank {rank}", **FP32_TOLERANCE)
        loss, norm, grads = r["zb_replica"]
        assert_parity(ref_losses, ref_grads[0], [loss], grads, label=f"zb-h1 rank {rank}", **FP32_TOLERANCE)
        torch.testing.assert_close(norm, ref_norm, **FP32_TOLERANCE)
        assert r["zb_again"] == loss
        torch.testing.assert_close(r["microbatch"], microbatch_means(model, padded_batch(vocab, counts=EVEN_LESS), 4),
                                   **FP32_TOLERANCE)
        assert r["error"] is not None, f"rank {rank} did not refuse replica 1's bad id"
        assert f"'idx' holds {vocab + 4680} at row 2, position 9 of data-parallel replica 1's own batch" in r["error"]
        if rank % 2 == 1:  # rank = dp + 2 pp: ranks 1 and 3 are replica 1
            assert "batch tensor 'targets' has dtype torch.float32" in r["dtype_error"], r["dtype_error"]
        else:
            assert "data-parallel replica 1's batch was refused on its own ranks" in r["dtype_error"], r["dtype_error"]
