"""Evaluation steps: the forward-only schedule, the evaluation graphs, and ``engine.eval_step``.

Without a process group: the forward-only form of each named schedule (its
actions counted per stage, validated by the schedules' one validator, timed by
the one simulator), the evaluation graphs of a model with every kind of
training-mode op, and ``eval_step`` on one rank against the model in
``eval()`` mode. On 4 gloo ranks (``eval_ranks.py``, one spawn): a GPT with
dropout 0.5 at tp=2 x pp=2 and at pp=2 x virtual_stages=2 x dp=2 evaluates to
the single-device ``eval()`` loss, touches no ``.grad``, and leaves the random
stream alone (a training step after evaluations draws the masks it draws
without them).
"""

from collections import Counter

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from eval_ranks import LAYOUTS, batch, model, results

import autopar
from autopar.runtime.engine import ActionError
from autopar.schedules import (
    Action,
    Kind,
    Schedule,
    ScheduleError,
    dry_run,
    forward_only,
    generate,
    lower,
    parse_grid,
    simulate,
    validate,
)

# (schedule, p, v, m): 1F1B, interleaved 1F1B with m a multiple of p, GPipe with v > 1 and m < p
LAYOUT_CASES = [("1f1b", 4, 1, 8), ("1f1b", 1, 1, 3), ("interleaved", 2, 2, 4), ("interleaved", 4, 3, 8),
                ("gpipe", 4, 2, 2), ("gpipe", 2, 3, 5)]

# fp32 on both sides; the parallel run only reorders sums (vocabulary-parallel cross-entropy, the
# mean over microbatches and replicas): within 1e-5 relative of a loss of about 6
LOSS_TOLERANCE = dict(rtol=1e-5, atol=1e-6)


def _counts(schedule: Schedule, stage: int) -> Counter:
    return Counter(a.kind for a in schedule.actions[stage])


# ---------------------------------------------------------------- the forward-only schedule
@pytest.mark.parametrize("name,p,v,m", LAYOUT_CASES)
def test_forward_only_actions_per_stage(name, p, v, m):
    """Per stage: v*m forwards; an SF for each chunk whose successor lives on another stage (all but
    the last chunk when p > 1), an RF for each chunk with a predecessor on another stage; no backward."""
    schedule = lower(forward_only(generate(name, p, v, m)))
    validate(schedule)
    assert schedule.forward_only and schedule.name == name
    for r in range(p):
        chunks = [r + k * p for k in range(v)]
        sends = sum(1 for c in chunks if c + 1 < p * v and p > 1)
        receives = sum(1 for c in chunks if c > 0 and p > 1)
        want = Counter({Kind.F: v * m, Kind.SEND_F: sends * m, Kind.RECV_F: receives * m})
        assert _counts(schedule, r) == +want, (r, _counts(schedule, r))
    # each stage keeps its forwards in the training schedule's order
    training = generate(name, p, v, m)
    for r in range(p):
        assert [a for a in schedule.actions[r] if a.is_compute] == [a for a in training.actions[r] if a.kind is Kind.F]


@pytest.mark.parametrize("name,p,v,m", LAYOUT_CASES)
def test_forward_only_makespan(name, p, v, m):
    """Unit forwards: (v - 1) max(m, p) + m + p - 1 slots. For v = 1 that is m + p - 1 (stage r starts
    r slots late, then runs its m forwards back to back); for v > 1 with m >= p each stage runs
    its v*m forwards without a gap after the p - 1 slots of filling (v*m + p - 1); with m < p
    (GPipe) each of the v - 1 returns to stage 0 waits for the first microbatch's trip round
    the p stages (p slots instead of m)."""
    expected = (v - 1) * max(m, p) + m + p - 1
    compute = forward_only(generate(name, p, v, m))
    lowered = lower(compute)
    assert dry_run(compute, 1, 1).makespan == expected
    assert dry_run(lowered, 1, 1).makespan == expected
    if p > 1:  # autopar's runtime: posted sends, the consumer waits for its receive
        run = simulate(lowered, 1, 1, sends="posted")
        assert run.step_time == expected
        assert run.busy == dict.fromkeys(range(p), v * m)
        assert run.peak_in_flight == dict.fromkeys(range(p), 0)
    if v == 1:
        assert expected == m + p - 1


def test_forward_only_grid_prints_and_parses_back():
    schedule = lower(forward_only(generate("interleaved", 2, 2, 4)))
    grid = str(schedule)
    assert grid.splitlines()[0] == "interleaved p=2 v=2 m=4 forward-only"
    assert grid.splitlines()[2].split()[2:6] == ["F0.0", "SF0.0>1", "F0.1", "SF0.1>1"]
    assert parse_grid(grid) == schedule
    assert not parse_grid(str(lower(generate("interleaved", 2, 2, 4)))).forward_only


def test_forward_only_validation():
    """The one validator: a forward-only schedule with a backward, with a forward missing, or with a
    forward before the receive it needs is refused, the failing action named and marked."""
    good = lower(forward_only(generate("1f1b", 2, 1, 2)))
    with_b = Schedule("1f1b", 2, 1, 2, {0: good.actions[0] + [Action(Kind.B, 0, 0)], 1: good.actions[1]},
                      forward_only=True)
    with pytest.raises(ScheduleError, match=r"B0\.0 on stage 0: a forward-only schedule runs no backward") as err:
        validate(with_b)
    assert err.value.marks == ((0, len(good.actions[0])),)
    missing = Schedule("1f1b", 2, 1, 2, {0: good.actions[0], 1: [a for a in good.actions[1] if str(a) != "F1.1"]},
                       forward_only=True)
    with pytest.raises(ScheduleError, match=r"missing F1\.1 \(on stage 1\)"):
        validate(missing)
    early = Schedule("1f1b", 2, 1, 2, {0: good.actions[0], 1: good.actions[1][1:2] + good.actions[1][:1]
                                       + good.actions[1][2:]}, forward_only=True)
    with pytest.raises(ScheduleError, match=r"F1\.0 on stage 1 runs before RF1\.0"):
        validate(early)
    # without the mark, the same forwards are a training schedule that lacks its backwards
    with pytest.raises(ScheduleError, match=r"missing B"):
        validate(Schedule("1f1b", 2, 1, 2, good.actions))
    with pytest.raises(ValueError, match="is lowered: give its compute-only form"):
        forward_only(lower(generate("1f1b", 2, 1, 2)))


# ---------------------------------------------------------------- the evaluation graphs, one rank
class _TrainModeOps(nn.Module):
    """Every kind of op whose behaviour depends on training mode, as a model writes them."""

    def __init__(self):
        super().__init__()
        self.inp, self.out = nn.Linear(8, 16), nn.Linear(16, 4)
        self.batch_stats = nn.BatchNorm1d(16, track_running_stats=False)  # batch statistics in eval too
        self.running_stats = nn.BatchNorm1d(16)  # running statistics in eval
        self.rrelu, self.drop, self.alpha_drop = nn.RReLU(), nn.Dropout(0.3), nn.AlphaDropout(0.2)

    def forward(self, x):
        h = self.drop(self.rrelu(self.batch_stats(self.inp(x))))
        h = self.running_stats(self.alpha_drop(h))
        q = h.view(h.shape[0], 2, 2, 4)
        a = F.scaled_dot_product_attention(q, q, q, dropout_p=0.4 if self.training else 0.0)
        return self.out(a.reshape(h.shape[0], 16))


class _TrainingNoise(nn.Module):
    """Noise added under ``if self.training``: a branch taken at trace time, invisible in the graph."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 4)

    def forward(self, x):
        h = self.lin(x)
        return h * torch.rand_like(h) if self.training else h


def _one_rank(module, rows: int = 8, microbatches: int = 2):
    torch.manual_seed(0)
    net = module()
    x, y = torch.randn(rows, 8), torch.randn(rows, 4)
    b = rows // microbatches
    program = autopar.parallelize(net, microbatches=microbatches, example_inputs=(x[:b],), example_targets=y[:b],
                                  loss_fn=F.mse_loss)
    return net, program, x, y


def test_eval_graph_matches_the_model_in_eval_mode():
    net, program, x, y = _one_rank(_TrainModeOps)
    (chunk,) = program.split.chunks
    changed = {line.split(" ")[0]: line.split(": ", 1)[1] for line in chunk.eval_notes}
    assert changed == {"rrelu": "training=False", "dropout": "removed (the identity when not training)",
                       "alpha_dropout": "removed (the identity when not training)",
                       "batch_norm_1": "training=False",  # the one with running statistics
                       "scaled_dot_product_attention": "dropout_p=0.4 -> 0"}
    ops = Counter(str(n.target) for n in chunk.eval_gm.graph.nodes if n.op == "call_function")
    assert ops["aten.dropout.default"] == ops["aten.alpha_dropout.default"] == 0
    assert Counter(str(n.target) for n in chunk.gm.graph.nodes)["aten.dropout.default"] == 1  # training graph kept
    code = program.code(0, eval=True)
    assert "# eval: dropout (aten.dropout): removed" in code and "aten.dropout" not in code.split("def forward")[1]
    assert "aten.dropout.default" in program.code(0)

    engine = program.materialize()
    got = engine.eval_step(x, y)
    net.eval()
    with torch.no_grad():  # the engine's microbatches of 4 rows: batch statistics are per microbatch
        want = torch.stack([F.mse_loss(net(x[i:i + 4]), y[i:i + 4]) for i in (0, 4)]).mean()
    torch.testing.assert_close(torch.tensor(got), want, rtol=1e-6, atol=0)  # the same ops on one device
    assert all(p.grad is None for p in engine.parameters())
    assert engine.stats["peak_in_flight"] == engine.stats["peak_activation_bytes"] == 0
    assert [e.name for e in engine.events] == ["F0.0", "F0.1"]
    engine.eval()
    assert engine(x, y) == got  # engine(x, y) in eval mode is eval_step
    engine.train()  # training mode (it updates the running statistics: last)
    assert abs(engine(x, y) - float(want)) > 1e-3  # dropout and batch statistics change the loss


def test_random_op_left_is_listed_and_leaves_the_stream_alone():
    _, program, x, y = _one_rank(_TrainingNoise)
    (chunk,) = program.split.chunks
    assert [line.split(":")[0] for line in chunk.eval_notes] == ["rand_like (aten.rand_like)"]
    assert "draws in evaluation too" in program.code(0, eval=True)
    with_eval, plain = program.materialize(), program.materialize()
    first = [with_eval.eval_step(x, y), with_eval.eval_step(x, y)]
    assert first[0] == first[1]  # the stream is put back after each: evaluations repeat
    assert with_eval.train_step(x, y) == plain.train_step(x, y)
    assert with_eval.train_step(x, y) == plain.train_step(x, y)


def test_a_failing_evaluation_is_marked_on_the_forward_only_grid():
    _, program, x, y = _one_rank(_TrainingNoise)
    engine = program.materialize()

    def broken(*args):
        raise RuntimeError("no evaluation today")

    engine.eval_runnables[0] = broken
    with pytest.raises(ActionError, match=r"(?s)failed running F0\.0 \(stage 0, step 0.*RuntimeError: no evaluation "
                                          r"today\n1f1b p=1 v=1 m=2 forward-only\n.*\[F0\.0\] F0\.1$"):
        engine.eval_step(x, y)
    engine.train_step(x, y)  # the training graphs are others


# ---------------------------------------------------------------- 4 gloo ranks
@pytest.fixture(scope="module")
def spawned_evals():
    return results()


@pytest.fixture(scope="module")
def eval_reference():
    """The single-device model in eval() mode: the mean loss over each layout's global batch."""
    net = model().eval()
    out = {}
    with torch.no_grad():
        for name, layout in LAYOUTS.items():
            x, y = batch(layout["dp"])
            out[name] = float(autopar.lm_cross_entropy(net(x), y))
    return out


@pytest.mark.multiprocess
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_eval_loss_matches_one_device_in_eval_mode(spawned_evals, eval_reference, layout):
    want = eval_reference[layout]
    for rank, r in enumerate(spawned_evals):
        got = r[layout]
        for loss in [got["eval_fresh"], *got["eval_after_train"]]:
            torch.testing.assert_close(loss, want, **LOSS_TOLERANCE, msg=lambda m, rank=rank: f"rank {rank}: {m}")
        # dropout 0.5 in training mode: the training loss is off the eval loss by far more than
        # the tolerance (the untrained model's logits are small, so 0.02 or so, not more)
        assert abs(got["train_a"][0] - want) > 100 * LOSS_TOLERANCE["rtol"] * want, (rank, got["train_a"][0], want)


@pytest.mark.multiprocess
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_eval_touches_no_gradient_and_no_training_state(spawned_evals, layout):
    for rank, r in enumerate(spawned_evals):
        got = r[layout]
        assert got["grads_after_eval_fresh"] == [], rank
        assert got["grads_kept"], rank
        assert got["stats"]["peak_in_flight"] == got["stats"]["peak_activation_bytes"] == 0
        assert "B" not in got["event_kinds"] and "F" in got["event_kinds"], got["event_kinds"]
        # a stage sends when one of its chunks has a successor on the other stage: stage 0 always,
        # stage 1 (the last) only with two chunks per stage
        sends = got["stage"] == 0 or LAYOUTS[layout].get("virtual_stages", 1) > 1
        assert (got["bytes_sent"] > 0) == sends, (rank, got["stage"], got["bytes_sent"])


@pytest.mark.multiprocess
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_train_step_after_eval_steps_is_unchanged(spawned_evals, layout):
    """Bit for bit: the same masks drawn, the same gradients accumulated (same program, same ops)."""
    for rank, r in enumerate(spawned_evals):
        got = r[layout]
        assert got["train_a"] == got["train_b"], rank
        assert got["train_a"][0] != got["train_a"][1], rank  # the second step draws other masks
        assert got["grads_a"].keys() == got["grads_b"].keys()
        for name, g in got["grads_a"].items():
            assert torch.equal(g, got["grads_b"][name]), (rank, name)
