"""Plain helpers the parity tests share (``conftest.py`` builds its fixtures on them).

A parity test follows one pattern: a seeded model and a few global batches of
token ids; in every rank of one ``autopar.spawn``, the model compiled for a
layout (the first microbatch as the example), trained, and its losses and full
gradients returned; in the test process, the same model trained on one device
and every rank compared with it, gradient by parameter name.

The model families themselves live in ``families.py``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist
from families import SEQ, assert_steps_match, batches

import autopar
from autopar.reference.parity import single_device_run

__all__ = ["seeded", "token_batches", "parallelize_on", "reference_run", "spawn_ranks", "assert_ranks_match",
           "assert_same_grads"]

Batches = list[tuple[tuple[torch.Tensor, ...], tuple[torch.Tensor, ...]]]


def seeded(factory: Callable, *args, seed: int = 0, **kwargs):
    """``factory(*args, **kwargs)`` right after ``torch.manual_seed(seed)``: the same weights in every process."""
    torch.manual_seed(seed)
    return factory(*args, **kwargs)


def token_batches(vocab: int, steps: int, rows: int, seed: int, seq: int = SEQ) -> Batches:
    """``steps`` global batches of ``rows`` random sequences of ``seq`` token ids (``families.batches``)."""
    return batches(vocab, steps, seed, rows, seq)


def parallelize_on(model, data: Batches, rows: int, **config) -> autopar.ParallelProgram:
    """``autopar.parallelize(model, **config)`` with the first ``rows`` sequences of ``data``'s first batch as
    the example microbatch (``rows`` = global rows / (dp * microbatches))."""
    inputs, targets = data[0]
    return autopar.parallelize(model, example_inputs=tuple(x[:rows] for x in inputs),
                               example_targets=tuple(y[:rows] for y in targets), **config)


def reference_run(model, data: Batches, lr: float | None = None, loss_fn: Callable = autopar.lm_cross_entropy,
                  **kwargs) -> tuple[list[float], list[dict[str, torch.Tensor]]]:
    """The single-device run of ``model`` on ``data``: each step's loss and gradients by parameter name.

    ``lr``: AdamW with that learning rate, as the ranks train; None for
    ``single_device_run``'s default (enough for a one-step comparison).
    """
    optimizer = None if lr is None else (lambda ps: torch.optim.AdamW(ps, lr=lr))
    return single_device_run(model, data, loss_fn, optimizer=optimizer, **kwargs)


def spawn_ranks(worker: Callable, world: int, *args, timeout_s: float = 900) -> list:
    """``worker(*args)`` on ``world`` gloo ranks in one spawn; the ranks' results in rank order."""
    results = autopar.spawn(worker, world, args, timeout_s=timeout_s)
    assert len(results) == world, f"{len(results)} results from {world} ranks"
    return results


def on_rank0(value):
    """``value`` on global rank 0 only, None elsewhere (for what every rank holds alike, such as the
    full weights: one copy comes back from the spawn)."""
    return value if dist.get_rank() == 0 else None


def assert_ranks_match(reference: tuple[list[float], list[dict]], per_rank: Sequence[tuple[list[float], list[dict]]],
                       label: str) -> None:
    """Each rank's (losses, gradients per step) against the single-device ``reference``.

    The first step's gradients element-wise within FP32_TOLERANCE (rtol 1e-5,
    atol 1e-6: fp32, the parallel run only reorders sums), later steps per
    tensor (||g - g_ref|| <= 1e-4 ||g_ref|| + 1e-6: AdamW's first update
    lr*sign(g) amplifies rounding in near-zero gradients); see
    ``families.assert_steps_match``.
    """
    ref_losses, ref_grads = reference
    for rank, (losses, grads) in enumerate(per_rank):
        assert len(grads) == len(losses) <= len(ref_grads), (label, rank, len(losses), len(grads))
        assert_steps_match(ref_losses, ref_grads, losses, grads, label=f"{label} rank {rank}")


def assert_same_grads(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor], label: str, rtol: float,
                      atol: float) -> None:
    """Gradients equal by parameter name: the same names, and each within (rtol, atol), the message naming it."""
    assert got.keys() == want.keys(), (label, sorted(set(got) ^ set(want)))
    for name, ref in want.items():
        torch.testing.assert_close(got[name], ref, rtol=rtol, atol=atol,
                                   msg=lambda m, name=name: f"{label} gradient of {name}: {m}")
