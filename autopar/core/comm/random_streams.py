"""Random streams of tensor-parallel shards: one forked, per-rank stream for a random op.

Dropout on a sharded value must draw different masks on each tp rank while
everything replicated draws the same; ``tp_rng_call`` runs the op under a
generator forked from the shared one and seeded with the tp rank.
``seed_forked`` seeds only the generators such a fork restores.
"""

from __future__ import annotations

import torch

from autopar.core.comm.group import TPGroup

__all__ = ["seed_forked", "tp_rng_call"]


def seed_forked(seed: int, devices: list[int]) -> None:
    """Seed the CPU generator and those of ``devices`` only: inside ``fork_rng(devices)`` those
    are the ones restored afterwards (``torch.manual_seed`` would reseed every GPU's)."""
    torch.random.default_generator.manual_seed(seed)
    for d in devices:
        torch.cuda.default_generators[d].manual_seed(seed)


def tp_rng_call(op, tp: TPGroup, *args, **kwargs):
    """Run a random op on a tensor-parallel shard with this rank's own random stream.

    Dropout on a sharded value (attention probabilities split by heads) must
    draw different masks on each tp rank, while everything replicated must
    draw the same. One seed is drawn from the shared default generator (so it
    advances identically on every rank, and a checkpoint's recomputation,
    which restores that generator, draws it again); the op then runs under a
    forked generator seeded with it and the tp rank.
    """
    if tp.size == 1:
        return op(*args, **kwargs)
    return _on_rank_stream(op, tp, *args, **kwargs)


@torch.compiler.disable(reason="a random op on a tensor-parallel shard draws from this rank's own forked "
                               "generator (torch.random.fork_rng), which torch.compile does not trace")
def _on_rank_stream(op, tp: TPGroup, *args, **kwargs):
    """``op`` under a generator forked from the shared one, seeded with a draw of it and the tp rank.
    Run eagerly under ``torch.compile``: the chunk's graph breaks around it (the break is reported)."""
    if torch._guards.detect_fake_mode(args) is not None:  # fake tensors: shapes only
        return op(*args, **kwargs)
    seed = int(torch.randint(0, 2**62, (), dtype=torch.int64))
    devices = [torch.cuda.current_device()] if torch.cuda.is_available() and torch.cuda.is_initialized() else []
    with torch.random.fork_rng(devices=devices):
        seed_forked(seed + 7919 * tp.rank, devices)
        return op(*args, **kwargs)
