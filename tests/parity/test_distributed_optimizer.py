"""The distributed optimizer (ZeRO stage 1) against the plain optimizer, on 4 gloo ranks.

For each layout — dp=4; tp=2 x dp=2; pp=2 x dp=2 (the GPT's tied embedding
and LM head on two stages) — the same model is trained 3 steps twice in one
set of ranks: AdamW over ``engine.parameters()`` and
``engine.distributed_optimizer(torch.optim.AdamW, ...)``, both with gradient
clipping at a norm the gradients exceed and a LambdaLR schedule. Buckets are
made small (4 KiB) so parameters straddle the replicas' ranges and several
buckets are reduce-scattered per chunk. Checked: the weights after 3 steps,
the reduced (clipped) gradients of step 0 and each step's clipping norm equal
the plain run's; each rank's optimizer state is 1/d of the plain optimizer's
(the replicas' together exactly the plain state); LBFGS, Adafactor and an
unknown optimizer class are refused with the class named and the fix, and the
engine still trains after a refusal; so are a distributed optimizer made while
the parameters hold gradients of a step reduced without it, and a second one.
fp32 parameters are their own masters (the optimizer adds only gradient shards).

In the same ranks: overlapping the parameter all-gathers (pp=2, interleaved,
2 chunks per stage, x dp=2, 3 steps with and without) changes no bit, and the
waits fall at each chunk's first forward; and a model in bf16 at tp=2 x dp=2
with the distributed optimizer's fp32 masters equals AdamW over fp32 master
copies of a plain engine's parameters.
"""

import pytest
import torch
from families import BATCH, batches, make
from helpers import parallelize_on, spawn_ranks

from autopar.runtime.optim.flat_buffers import FlatBucket

pytestmark = pytest.mark.multiprocess
LR, M, CLIP, STEPS = 1e-3, 2, 0.5, 3
LAYOUTS = {"dp4": dict(dp=4), "tp2dp2": dict(tp=2, dp=2), "pp2dp2": dict(pp=2, dp=2)}
SMALL_BUCKETS = 4096
OVERLAP_LAYOUT = dict(pp=2, dp=2, virtual_stages=2, schedule="interleaved")


def _state_bytes(optimizer) -> int:
    """Bytes of element-wise optimizer state (the scalar step counters aside)."""
    return sum(t.numel() * t.element_size() for s in optimizer.state.values() for t in s.values()
               if isinstance(t, torch.Tensor) and t.dim() > 0)


def _layout_program(layout: dict):
    model, vocab = make("nanogpt")
    data = batches(vocab, steps=STEPS, rows=BATCH * M * layout["dp"])
    return parallelize_on(model, data, BATCH, microbatches=M, **layout), data


def _train_layout(layout: dict, distributed: bool) -> dict:
    program, data = _layout_program(layout)
    engine = program.materialize()
    engine.grads.bucket_bytes = SMALL_BUCKETS
    if distributed:
        opt = engine.distributed_optimizer(torch.optim.AdamW, lr=LR, weight_decay=0.1)
    else:
        opt = torch.optim.AdamW(engine.parameters(), lr=LR, weight_decay=0.1)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 1.0 / (step + 1))
    norms, first_grads = [], None
    for inputs, targets in data:
        engine.train_step(*inputs, *targets)
        norms.append(engine.clip_grad_norm_(CLIP))
        if first_grads is None:
            first_grads = engine.full_grads()
        opt.step()
        sched.step()
        opt.zero_grad()
    out = {"weights": engine.full_state_dict(), "norms": norms, "grads": first_grads, "state": _state_bytes(opt),
           "lr": opt.param_groups[0]["lr"]}
    if distributed:
        out["padding"] = sum(b.padded - b.numel for b in opt.buckets)
        out["buckets"] = len(opt.buckets)
        out["masters_shared"] = all(b.masters_shared for b in opt.buckets)
        out["extra_bytes"] = (opt.buffer_bytes(), sum(b.grad.numel() * b.grad.element_size() for b in opt.buckets))
        out["straddling"] = sum(p.length < engine.grads.params[p.name].numel() for b in opt.buckets for p in b.pieces)
    return out


def _refusals_program():
    model, vocab = make("nanogpt")
    data = batches(vocab, steps=1, rows=BATCH * 4)
    return parallelize_on(model, data, BATCH, dp=4), data


def _refusals() -> dict:
    program, data = _refusals_program()
    engine = program.materialize()

    class Scaled(torch.optim.SGD):
        pass

    messages = {}
    for cls in (torch.optim.LBFGS, torch.optim.Adafactor, Scaled):
        with pytest.raises(TypeError) as err:
            engine.distributed_optimizer(cls, lr=0.1)
        messages[cls.__name__] = str(err.value)
    loss = engine.train_step(*data[0][0], *data[0][1])  # the refusals left the engine as it was
    messages["sharded_after"] = engine.grads.sharded is not None
    messages["loss"] = loss
    with pytest.raises(RuntimeError) as err:  # gradients of that step are held: they would be reduced twice
        engine.distributed_optimizer(torch.optim.AdamW, lr=0.1)
    messages["held"] = str(err.value)
    engine.zero_grad()
    opt = engine.distributed_optimizer(torch.optim.AdamW, lr=0.1)
    with pytest.raises(RuntimeError) as err:
        engine.distributed_optimizer(torch.optim.SGD, lr=0.1)
    messages["second"] = str(err.value)
    with pytest.raises(RuntimeError) as err:  # its flat buffers are laid out once
        opt.add_param_group({"params": list(engine.parameters())[:1]})
    messages["add_group"] = str(err.value)
    return messages


def _overlap_program():
    model, vocab = make("nanogpt", layers=4)
    data = batches(vocab, steps=STEPS, rows=BATCH * M * 2)
    return parallelize_on(model, data, BATCH, microbatches=M, **OVERLAP_LAYOUT), data


def _overlap(overlap: bool) -> dict:
    """3 steps at pp=2 (interleaved, 2 chunks per stage) x dp=2; the parameter all-gathers of step 1
    overlapped with step 2's forwards or not. The waits step 2 met, and where each chunk's first F is."""
    program, data = _overlap_program()
    engine = program.materialize()
    engine.grads.bucket_bytes = SMALL_BUCKETS
    opt = engine.distributed_optimizer(torch.optim.AdamW, lr=LR, weight_decay=0.1, overlap_param_gather=overlap)
    losses, waits = [], None
    for step, (inputs, targets) in enumerate(data):
        losses.append(engine.train_step(*inputs, *targets))
        if step == 1:
            waits = list(opt.gathers.waits)
        opt.step()
        opt.zero_grad()
    pending_after_step = len(opt.gathers.pending)
    engine.eval_step(*data[0][0], *data[0][1])  # reads every parameter: waits for every bucket first
    eval_waits = list(opt.gathers.waits)
    actions = engine.schedule.actions[engine.stage]
    first_f = [str(next(a for a in actions if a.kind.value == "F" and a.chunk == c)) for c in sorted(engine.chunks)]
    first_f.sort(key=[str(a) for a in actions].index)
    weights = engine.full_state_dict()
    # a load while a step's all-gathers are in flight: the gathers land first, the loaded values stay
    zeros = {key: torch.zeros_like(value) for key, value in engine.state_dict().items()}
    engine.train_step(*data[0][0], *data[0][1])
    opt.step()
    in_flight = len(opt.gathers.pending)
    engine.load_state_dict(zeros)
    engine.eval_step(*data[0][0], *data[0][1])
    loaded_kept = all(bool((p == 0).all()) for p in engine.parameters())
    return {"losses": losses, "weights": weights, "waits": waits, "first_f": first_f,
            "buckets": len(opt.buckets), "pending_after_step": pending_after_step, "eval_waits": eval_waits,
            "load_in_flight": in_flight, "loaded_kept": loaded_kept}


def _bf16_program():
    model, vocab = make("nanogpt")
    rows = BATCH * M  # both replicas get the same rows: their bf16 gradients sum exactly (see the test)
    data = [((x[:rows].repeat(2, 1),), (y[:rows].repeat(2, 1),))
            for (x,), (y,) in batches(vocab, steps=STEPS, rows=rows)]
    return parallelize_on(model.to(torch.bfloat16), data, BATCH, microbatches=M, tp=2, dp=2), data


def _bf16(distributed: bool) -> dict:
    """3 steps of the model in bf16 at tp=2 x dp=2, the two replicas on the same rows: the distributed
    optimizer (fp32 masters inside), or AdamW over fp32 master copies of the parameters (the gradients
    copied in, the updates rounded out)."""
    program, data = _bf16_program()
    engine = program.materialize()
    engine.grads.bucket_bytes = SMALL_BUCKETS
    if distributed:
        opt = engine.distributed_optimizer(torch.optim.AdamW, lr=LR, weight_decay=0.1)
        step = opt.step
    else:
        params = list(engine.parameters())
        masters = [p.detach().float() for p in params]
        opt = torch.optim.AdamW(masters, lr=LR, weight_decay=0.1)

        def step():
            for p, master in zip(params, masters):
                master.grad = p.grad.float()
            opt.step()
            with torch.no_grad():
                for p, master in zip(params, masters):
                    p.copy_(master)
    losses, initial = [], engine.full_state_dict()
    for inputs, targets in data:
        losses.append(engine.train_step(*inputs, *targets))
        step()
        opt.zero_grad()
        engine.zero_grad()
    weights = engine.full_state_dict()
    return {"losses": losses, "weights": weights, "initial": initial, "dtypes": {str(w.dtype) for w in weights.values()}}


def _train_sharded_and_not():
    runs = {(name, dist_): _train_layout(layout, dist_) for name, layout in LAYOUTS.items() for dist_ in (False, True)}
    overlap = {flag: _overlap(flag) for flag in (True, False)}
    bf16 = {flag: _bf16(flag) for flag in (True, False)}
    return runs, _refusals(), overlap, bf16


@pytest.fixture(scope="module")
def optimizer_runs():
    # compile every program here, once: the ranks inherit them
    for layout in LAYOUTS.values():
        _layout_program(layout)
    for program in (_refusals_program, _overlap_program, _bf16_program):
        program()
    return spawn_ranks(_train_sharded_and_not, 4)


# Reduce-scatter and all-reduce may sum the replicas' gradients in different orders, and the norm
# is summed per shard instead of per parameter: fp32 rounding (~1e-7 relative) per step. AdamW's
# update is lr * m / (sqrt(v) + eps): a rounding difference in a gradient element far above eps
# changes the step by ~1e-7 relative, so weights (of order 1e-1) agree within 1e-6 after 3 steps.
WEIGHTS = dict(rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_weights_after_three_steps_equal_the_plain_optimizers(optimizer_runs, layout):
    for rank, (runs, *_) in enumerate(optimizer_runs):
        plain, sharded = runs[(layout, False)], runs[(layout, True)]
        assert plain["weights"].keys() == sharded["weights"].keys()
        for key, want in plain["weights"].items():
            torch.testing.assert_close(sharded["weights"][key], want, **WEIGHTS,
                                       msg=lambda m, key=key: f"{layout} rank {rank} {key}: {m}")
        assert sharded["buckets"] > 2 and sharded["straddling"] > 0  # several buckets; parameters cut by ranges
        assert sharded["lr"] == plain["lr"] == LR / (STEPS + 1)  # the scheduler drove the inner optimizer: 1/(step+1) after 3 steps


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_clipping_norm_and_reduced_gradients_equal(optimizer_runs, layout):
    for rank, (runs, *_) in enumerate(optimizer_runs):
        plain, sharded = runs[(layout, False)], runs[(layout, True)]
        # the norm in float64 from fp32 gradients summed in another order: equal to ~1e-7 relative
        torch.testing.assert_close(torch.tensor(sharded["norms"]), torch.tensor(plain["norms"]), rtol=1e-6, atol=0)
        assert min(plain["norms"]) > CLIP  # the clipping scaled every step
        for name, want in plain["grads"].items():  # fp32 sums reordered: FP32 parity tolerance
            torch.testing.assert_close(sharded["grads"][name], want, rtol=1e-5, atol=1e-6,
                                       msg=lambda m, name=name: f"{layout} rank {rank} grad {name}: {m}")


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_optimizer_state_is_one_dth_per_replica(optimizer_runs, layout):
    d = LAYOUTS[layout]["dp"]
    states = [runs[(layout, True)]["state"] for runs, *_ in optimizer_runs]
    for rank, (runs, *_) in enumerate(optimizer_runs):
        plain, sharded = runs[(layout, False)]["state"], runs[(layout, True)]["state"]
        padding_bytes = runs[(layout, True)]["padding"] * 8  # AdamW: two fp32 moments per entry
        assert abs(sharded - plain / d) <= padding_bytes, (layout, rank, sharded, plain, d, padding_bytes)
        # fp32 parameters are their own masters (views of the flat buckets): beside its state the
        # optimizer keeps only the gradient shards
        assert runs[(layout, True)]["masters_shared"], (layout, rank)
        buffers, grad_shards = runs[(layout, True)]["extra_bytes"]
        assert buffers == grad_shards, (layout, rank, buffers, grad_shards)
    # no padding is stepped: the d replicas together hold exactly one plain copy of the state
    plain_total = sum(runs[(layout, False)]["state"] for runs, *_ in optimizer_runs)
    assert sum(states) * d == plain_total, (layout, states, plain_total)


def test_refused_optimizers_name_the_class_and_the_fix(optimizer_runs):
    for rank, (_, messages, *_) in enumerate(optimizer_runs):
        assert "torch.optim.lbfgs.LBFGS is not known to update each parameter entry" in messages["LBFGS"]
        assert "Adafactor" in messages["Adafactor"] and "elementwise=True" in messages["Adafactor"]
        assert "Scaled is not known" in messages["Scaled"] and "elementwise=True" in messages["Scaled"]
        assert messages["sharded_after"] is False and messages["loss"] > 0
        assert "already hold gradients" in messages["held"] and "engine.zero_grad()" in messages["held"]
        assert "already has a distributed optimizer" in messages["second"]
        assert "add_param_group cannot join more" in messages["add_group"] and "params=[" in messages["add_group"]


def test_flat_bucket_pieces_cover_each_entry_once_with_fp32_masters():
    params = {"a": torch.randn(5, 3, dtype=torch.bfloat16), "b": torch.randn(7, dtype=torch.bfloat16)}
    d = 4
    buckets = [FlatBucket(params, ["a", "b"], d, r) for r in range(d)]
    assert [b.padded for b in buckets] == [24] * d and buckets[0].shard_numel == 6  # 22 entries padded to 24
    covered = {"a": [0] * 15, "b": [0] * 7}
    for bucket in buckets:
        assert bucket.master.dtype == torch.float32
        for piece in bucket.pieces:
            for i in range(piece.start, piece.start + piece.length):
                covered[piece.name][i] += 1
            torch.testing.assert_close(bucket.master[piece.at : piece.at + piece.length],
                                       params[piece.name].reshape(-1)[piece.start : piece.start + piece.length].float(),
                                       rtol=0, atol=0)  # an exact copy: bf16 -> fp32 is lossless
    assert all(c == 1 for counts in covered.values() for c in counts)
    assert [(p.name, p.start, p.length) for p in buckets[2].pieces] == [("a", 12, 3), ("b", 0, 3)]


def test_overlapped_parameter_gathers_change_nothing(optimizer_runs):
    """With and without overlapping the all-gathers: the same losses and weights, bit for bit."""
    for rank, (*_, overlap, _) in enumerate(optimizer_runs):
        assert overlap[True]["losses"] == overlap[False]["losses"], rank
        for key, want in overlap[False]["weights"].items():
            assert torch.equal(overlap[True]["weights"][key], want), (rank, key)


def test_a_load_during_the_gathers_keeps_the_loaded_values(optimizer_runs):
    """engine.load_state_dict while a step's all-gathers are in flight waits for them first: the
    loaded values are what the next forward reads (a gather landing later would undo the load)."""
    for rank, (*_, overlap, _) in enumerate(optimizer_runs):
        assert overlap[True]["load_in_flight"] > 0 and overlap[False]["load_in_flight"] == 0, rank
        assert overlap[True]["loaded_kept"] and overlap[False]["loaded_kept"], rank


def test_gathers_are_waited_for_at_each_chunks_first_forward(optimizer_runs):
    """Overlapped: step() returns with every bucket's gather in flight; the next step waits at the first
    F of each of the stage's 2 chunks (microbatch 0), each bucket exactly once, and nowhere else.
    An evaluation step waits for all of them before its first forward. Not overlapped: step() itself
    waits for all of them."""
    for rank, (*_, overlap, _) in enumerate(optimizer_runs):
        on, off = overlap[True], overlap[False]
        assert on["pending_after_step"] == on["buckets"] > 2, rank
        assert [where for where, _ in on["waits"]] == on["first_f"], (rank, on["waits"], on["first_f"])
        assert len(on["first_f"]) == 2 and all(f.endswith(".0") for f in on["first_f"]), on["first_f"]
        waited = sorted(i for _, indices in on["waits"] for i in indices)
        assert waited == list(range(on["buckets"])), (rank, on["waits"])
        assert off["pending_after_step"] == 0
        assert off["waits"] == [("step", tuple(range(off["buckets"])))], (rank, off["waits"])
        assert on["eval_waits"] == [("eval_step", tuple(range(on["buckets"])))], (rank, on["eval_waits"])
        assert off["eval_waits"] == off["waits"], rank


def test_bf16_parameters_with_fp32_masters_match_the_plain_optimizer(optimizer_runs):
    """The model in bf16 at tp=2 x dp=2, 3 steps: the distributed optimizer (fp32 masters) against AdamW
    over fp32 master copies of the plain engine's parameters.

    Tolerance: none, bit for bit. Each replica's bf16 gradients are the same
    computation in both runs; the replicas get the same rows, so their
    gradients are equal and their sum (2g) and mean are exact in bf16 (the plain
    engine's all-reduce) and in fp32 (the reduce-scatter) alike. The masters
    then see the same fp32 gradients and take the same AdamW steps, and both
    round them to bf16 the same way (round to nearest), whether before the
    all-gather or when copied into the parameter. With different rows per
    replica the bf16 all-reduce would round each sum to 8 bits (~4e-3
    relative) where the fp32 reduce-scatter does not, and the two runs would
    drift apart by bf16 noise instead: this isolates the master-weight path.
    """
    for rank, (*_, bf16) in enumerate(optimizer_runs):
        sharded, plain = bf16[True], bf16[False]
        assert sharded["dtypes"] == plain["dtypes"] == {"torch.bfloat16"}
        assert sharded["losses"] == plain["losses"], rank
        for key, want in plain["weights"].items():
            assert torch.equal(sharded["weights"][key], want), (rank, key, (sharded["weights"][key] - want).abs().max())
        moved = sum(int((w != i).sum()) for w, i in zip(plain["weights"].values(), plain["initial"].values()))
        assert moved > sum(w.numel() for w in plain["weights"].values()) // 2  # the steps moved most weights
