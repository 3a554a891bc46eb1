"""One spawn of 4 gloo ranks shared by ``test_eval_step.py`` and ``test_replica_batches.py``.

Spawning ranks and compiling in each costs seconds, so both files read the
results of one run (``results()``, computed once per test process). The model
is a 4-layer GPT with dropout 0.5 (a mask drawn differently changes the loss by
far more than any rounding); two layouts:

- ``tp2pp2``: tp=2 x pp=2 (1F1B, m=2);
- ``pp2v2``: pp=2 x virtual_stages=2 (interleaved, m=2) x dp=2.

Each rank returns plain values; the tests compare them with the single-device
model, or with each other.
"""

from __future__ import annotations

import functools

import torch
from helpers import parallelize_on, seeded, spawn_ranks, token_batches

from autopar.reference.models import build

VOCAB, SEQ, LAYERS, M, MB = 320, 16, 4, 2, 2
DROPOUT = 0.5
LAYOUTS = {
    "tp2pp2": dict(tp=2, pp=2, dp=1, microbatches=M),
    "pp2v2": dict(pp=2, virtual_stages=2, schedule="interleaved", dp=2, microbatches=M),
}


def model():
    """The GPT every rank and the single-device reference build (same seed, same weights)."""
    return seeded(build, "gpt", vocab_size=VOCAB, seq_len=SEQ, n_layer=LAYERS, n_head=4, d_model=64, dropout=DROPOUT)


def batch(dp: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The global batch of a layout with ``dp`` replicas: dp * M * MB sequences and their targets."""
    (x,), (y,) = token_batches(VOCAB, steps=1, rows=dp * M * MB, seed=7, seq=SEQ)[0]
    return x, y


def _local_grads(engine) -> dict[str, torch.Tensor | None]:
    return {n: None if p.grad is None else p.grad.detach().clone() for n, p in engine.named_local_parameters()}


def _eval_then_train(program, x, y) -> dict:
    """Engine A: eval, train, eval twice, train. Engine B (same program, a fresh random stream): train twice.

    What eval leaves alone: ``.grad`` (None before any training step, unchanged after one) and the
    random stream (A's second training step draws B's second step's masks)."""
    a = program.materialize()
    out = {"eval_fresh": a.eval_step(x, y),
           "grads_after_eval_fresh": [n for n, g in _local_grads(a).items() if g is not None]}
    out["stage"], out["stats"], out["event_kinds"] = a.stage, dict(a.stats), sorted({e.kind for e in a.events})
    out["bytes_sent"] = sum(a.stats["bytes_sent"].values())
    out["train_a"] = [a.train_step(x, y)]
    before = _local_grads(a)
    out["eval_after_train"] = [a.eval_step(x, y), a.eval_step(x, y)]
    out["grads_kept"] = all(torch.equal(g, before[n]) for n, g in _local_grads(a).items())
    out["train_a"].append(a.train_step(x, y))
    out["grads_a"] = _local_grads(a)
    b = program.materialize()
    out["train_b"] = [b.train_step(x, y), b.train_step(x, y)]
    out["grads_b"] = _local_grads(b)
    return out


def _replica_batches(program, x, y) -> dict:
    """The global batch and this replica's own rows give the same step: fresh engines, so the same masks."""
    from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

    whole = program.materialize()
    rows = x.shape[0] // whole.dp_size
    mine = slice(whole.dp_rank * rows, (whole.dp_rank + 1) * rows)
    out = {"dp": (whole.dp_rank, whole.dp_size), "loss_global": whole.train_step(x, y),
           "grads_global": whole.full_grads(), "eval_global": whole.eval_step(x, y)}
    own = program.materialize()
    out["loss_replica"] = own.train_step(x[mine], y[mine])
    out["grads_replica"] = own.full_grads()
    out["eval_replica"] = own.eval_step(x[mine], y[mine])
    dataset = TensorDataset(x, y)
    sampler = DistributedSampler(dataset, num_replicas=own.dp_size, rank=own.dp_rank, shuffle=False)
    out["sampler_rows"] = list(sampler)
    xb, yb = next(iter(DataLoader(dataset, batch_size=rows, sampler=sampler)))
    out["eval_loader"] = own.eval_step(xb, yb)
    out["errors"] = _batch_errors(own, x, y, rows)
    return out


def _batch_errors(engine, x, y, rows: int) -> dict[str, str]:
    """The messages of a wrong batch size and of a batch mixing the two forms (raised before any
    communication, on every rank alike)."""
    errors = {}
    for label, args in (("size", (x[:3], y[:3])), ("mixed", (x, y[:rows]))):
        try:
            engine.train_step(*args)
        except ValueError as e:
            errors[label] = str(e)
    return errors


def _eval_program(name: str):
    """The GPT compiled for the layout (once per test and process), and the layout's batch."""
    x, y = batch(LAYOUTS[name]["dp"])
    return parallelize_on(model(), [((x,), (y,))], MB, **LAYOUTS[name]), x, y


def _worker() -> dict:
    out = {}
    for name, layout in LAYOUTS.items():
        program, x, y = _eval_program(name)
        out[name] = _eval_then_train(program, x, y)
        if layout["dp"] > 1:
            out["replica"] = _replica_batches(program, x, y)
    return out


@functools.cache
def results() -> list[dict]:
    """Every rank's results, in rank order; spawned once per test process."""
    for name in LAYOUTS:  # compile once here: the ranks inherit the programs
        _eval_program(name)
    return spawn_ranks(_worker, 4, timeout_s=600)
