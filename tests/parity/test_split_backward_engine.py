"""The engine's B/W path: ``compute.backward`` with ``split_backward`` on, then ``compute.weight_backward``.

No schedule places W actions yet, so a tiny local loop plays one: F and B of
every microbatch as the schedule lists them, the Ws after (or each right after
its B). The gradients equal ``train_step``'s (fp32, the sums into ``.grad``
in another order: rtol 1e-5, atol 1e-6). At tp=2 B runs every collective of
the backward and W none.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from families import FAMILIES, SEQ, make
from helpers import compiled, spawn_ranks

from autopar.schedules import Action, Kind

M, ROWS = 2, 2
TOL = {"rtol": 1e-5, "atol": 1e-6}


def _split_backward_batch():
    x = torch.randint(0, FAMILIES["nanogpt"][1], (ROWS * M, SEQ), generator=torch.Generator().manual_seed(3))
    return x, x.roll(1, dims=1)


def _split_backward_program(tp: int = 1, **config):
    model, _ = make("nanogpt")
    x, _ = _split_backward_batch()
    world = {"world_size": tp} if tp > 1 else {}  # the ranks' world; one process: none
    return compiled(model, tp=tp, microbatches=M, example_inputs=(x[:ROWS],), example_targets=x[:ROWS], **world,
                    **config)


def _split_backward_engine(tp: int = 1, **config):
    return _split_backward_program(tp, **config).materialize(), _split_backward_batch()


def _split_step(engine, batch, interleave: bool, during_w=None) -> None:
    """One training step's compute actions with the backward split: W after every B (``interleave``)
    or all Ws at the end; ``during_w`` wraps each W (a context manager factory)."""
    engine.split_backward = True
    st = engine._new_step(batch, engine.schedule, training=True)
    engine.grads.begin_step(engine.stats)
    ws = []
    for a in engine.schedule.actions[engine.stage]:
        if a.is_compute:
            engine._handlers()[a.kind](a, st)
        if a.kind is Kind.B:
            ws.append(Action(Kind.B, a.chunk, a.microbatch))  # a W action, in B's clothes
            if interleave:
                with during_w() if during_w else _Null():
                    engine.compute.weight_backward(ws.pop(), st)
    for w in ws:
        with during_w() if during_w else _Null():
            engine.compute.weight_backward(w, st)
    engine.grads.end_step()
    assert not st.wctx and not st.splits


class _Null:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def test_engine_split_backward_matches_train_step():
    engine, batch = _split_backward_engine()
    engine.train_step(*batch)
    want = {n: p.grad.clone() for n, p in engine.named_local_parameters()}
    for interleave in (False, True):
        engine.zero_grad(set_to_none=True)
        _split_step(engine, batch, interleave)
        for n, p in engine.named_local_parameters():
            torch.testing.assert_close(p.grad, want[n], **TOL, msg=lambda m, n=n: f"{n}: {m}")
    assert engine.stats["peak_activation_bytes"] > 0


def test_weight_backward_without_b_names_the_action():
    engine, batch = _split_backward_engine()
    engine.split_backward = True
    st = engine._new_step(batch, engine.schedule, training=True)
    with pytest.raises(RuntimeError, match=r"W 0\.1: no split backward pending"):
        engine.compute.weight_backward(Action(Kind.B, 0, 1), st)


class _CountCollectives:
    """Counts the point-to-point batches and all-reduces posted inside the block."""

    def __init__(self, counts: list[int]):
        self.counts = counts

    def __enter__(self):
        self.saved = dist.batch_isend_irecv, dist.all_reduce, dist.all_gather

        def counted(fn):
            def call(*args, **kwargs):
                self.counts.append(1)
                return fn(*args, **kwargs)
            return call
        dist.batch_isend_irecv, dist.all_reduce, dist.all_gather = map(counted, self.saved)
        return self

    def __exit__(self, *exc):
        dist.batch_isend_irecv, dist.all_reduce, dist.all_gather = self.saved
        return False


def _tp2_rank():
    torch.set_num_threads(1)
    # tensor parallelism alone: sequence parallelism sums its partial norm gradients after the last W
    engine, batch = _split_backward_engine(tp=2, sequence_parallel=False)
    engine.train_step(*batch)
    want = engine.full_grads()
    engine.zero_grad(set_to_none=True)
    in_w: list[int] = []
    in_step: list[int] = []
    with _CountCollectives(in_step):  # the counter sees B's collectives: it would see W's
        _split_step(engine, batch, interleave=False, during_w=lambda: _CountCollectives(in_w))
    got = engine.full_grads()
    return len(in_w), len(in_step), {n: (got[n], want[n]) for n in want}, _tp2_sequence_parallel_grads()


def _tp2_sequence_parallel_grads() -> dict:
    """With sequence parallelism (the linears keep their input's local slice in the saved-tensor
    store and gather it again when B or W reads it): (split, train_step) gradients per parameter."""
    # overlap=False: async TP's fused ops compute their weights' gradients in B, so they never meet a split
    # backward (the pass leaves the zero-bubble schedules' collectives whole)
    engine, batch = _split_backward_engine(tp=2, sequence_parallel=True, overlap=False)
    engine.train_step(*batch)
    want = engine.full_grads()
    engine.zero_grad(set_to_none=True)
    _split_step(engine, batch, interleave=True)
    got = engine.full_grads()
    return {n: (got[n], want[n]) for n in want}


@pytest.mark.multiprocess
def test_tp2_weight_backward_runs_no_collective():
    """At tp=2 (f and g in every layer, vocabulary-parallel embedding and loss) W posts no
    collective, and the gradients equal ``train_step``'s."""
    for sequence_parallel in (False, True):  # compile once here: the ranks inherit the programs
        _split_backward_program(tp=2, sequence_parallel=sequence_parallel)
    for in_w, in_step, grads, sp_grads in spawn_ranks(_tp2_rank, 2, timeout_s=600):
        assert in_w == 0 and in_step > 0
        for name, (got, want) in [*grads.items(), *sp_grads.items()]:
            torch.testing.assert_close(got, want, **TOL, msg=lambda m, n=name: f"{n}: {m}")
