"""Rounds of a benchmark pooled: each round's per-rank results added to the runs so far."""

from __future__ import annotations


def pool_round(runs: dict, key, per_rank: list[dict], summed: tuple[str, ...] = ("times",),
               peaks: tuple[str, ...] = ()) -> None:
    """Add one round's ``per_rank`` results of ``key`` to ``runs``: the lists named in ``summed``
    joined (so medians are taken over every round), the values named in ``peaks`` kept at their max."""
    if key not in runs:
        runs[key] = per_rank
        return
    for acc, r in zip(runs[key], per_rank):
        for name in summed:
            acc[name] += r[name]
        for name in peaks:
            acc[name] = max(acc[name], r[name])
