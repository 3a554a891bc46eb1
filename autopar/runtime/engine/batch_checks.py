"""A step's batch checked before any work: each tensor's dtype, and ids against what they index.

**Dtypes.** Each batch tensor must have the dtype its placeholder was traced
with (``meta["val"].dtype``): float targets for a loss over class indices, or
a float mask where a bool one was traced, would otherwise fail deep inside the
last stage or compute something else. One exception: a tensor the graph uses
only as indices (``BatchRoles.index_only``: embedding ids, loss targets) may
come in another integer width (int32 token ids from a tokenizer) and is cast
to the traced one; its values are checked first, so the cast loses nothing.

**Ids.** Under tensor parallelism the vocabulary-parallel embedding and losses
mask the ids outside each rank's rows, so an id beyond the vocabulary would
return a loss where one device raises an index error. Each ``IdUse`` of the
program (``compiler/batch_roles.py``) is checked with one min/max pass over
the tensor; only a tensor that fails it is searched for the first offending
value, whose position the error names with the vocabulary size and the fix.
Targets equal to the loss's ``ignore_index`` are allowed.

**Every rank decides alike.** Given the global batch, every rank checks all
of it; given its replica's own batch, each rank checks that, and the replicas
exchange what they found (``agree``, one all-gather over dp of a few numbers,
with the counted targets of the loss; over dp x cp with context parallelism) so
that every rank raises the same error.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from autopar.core.errors import AutoparError

if TYPE_CHECKING:
    from autopar.compiler.batch_roles import BatchRoles, IdUse

__all__ = ["BatchError", "BatchCountError", "IdProblem", "REFUSED", "cast_dtypes", "find_id_problem", "agree",
           "id_error"]

_CASTS = {torch.int64: "long", torch.int32: "int", torch.int16: "short", torch.int8: "char", torch.uint8: "byte",
          torch.bool: "bool", torch.float32: "float", torch.float64: "double", torch.float16: "half",
          torch.bfloat16: "bfloat16"}

_MAX_DIMS = 8
"""Coordinates of an offending id exchanged between the replicas (a tensor of more dims: its first ones)."""


REFUSED = -2
"""``IdProblem.use`` of a replica whose own ranks refused its batch (a shape or dtype that does not fit):
exchanged like an id problem so that the other replicas raise too instead of waiting for it."""


class BatchError(AutoparError, ValueError):
    """A batch the program cannot take: raised on every rank, before any work of the step."""


class BatchCountError(AutoparError, TypeError):
    """A batch of more or fewer tensors than the model's inputs and targets."""


@dataclass(frozen=True)
class IdProblem:
    """The first out-of-range value of one ``IdUse``."""

    use: int
    """Index of the use in ``BatchRoles.ids``."""
    value: int
    at: tuple[int, ...]
    """Its index in the batch tensor as passed."""
    replica: int | None = None
    """The data-parallel replica whose own batch holds it; None: the global batch (or the only replica)."""


def _integer(dtype: torch.dtype) -> bool:
    return not dtype.is_floating_point and not dtype.is_complex and dtype is not torch.bool


def _fix(name: str, dtype: torch.dtype) -> str:
    method = _CASTS.get(dtype)
    return f"{name}.{method}()" if method else f"{name}.to({dtype})"


def cast_dtypes(names: list[str], batch, wants: list[torch.dtype], roles: "BatchRoles") -> list[torch.Tensor]:
    """``batch`` with each tensor of its traced dtype: as it is, or an index-only integer tensor cast;
    a ``BatchError`` naming the tensor, both dtypes and the fix otherwise."""
    out = []
    for name, x, want in zip(names, batch, wants):
        if x.dtype == want:
            out.append(x)
        elif name in roles.index_only and _integer(x.dtype) and _integer(want):
            out.append(x.to(want))
        else:
            uses = [u for u in roles.ids if u.name == name]
            role = f"; it indexes the {uses[0].size} {uses[0].what} ({uses[0].where})" if uses else ""
            accepts = " (any integer dtype is cast to it)" if name in roles.index_only else ""
            raise BatchError(f"batch tensor '{name}' has dtype {x.dtype}, but the program was traced with "
                             f"{want}{accepts}{role}. Fix: pass {_fix(name, want)}, or trace with an example "
                             f"of the dtype you will pass")
    return out


def find_id_problem(uses: tuple["IdUse", ...], tensors: dict[str, torch.Tensor]) -> IdProblem | None:
    """The first value of ``tensors`` outside what its use indexes (the loss's ignore_index allowed)."""
    for k, use in enumerate(uses):
        x = tensors[use.name]
        if x.numel() == 0:
            continue
        lo, hi = (int(v) for v in torch.aminmax(x))
        if lo >= 0 and hi < use.size:
            continue
        bad = (x < 0) | (x >= use.size)
        if use.ignore_index is not None:
            bad &= x != use.ignore_index
        where = bad.nonzero()
        if len(where):
            at = tuple(int(i) for i in where[0])
            return IdProblem(k, int(x[at]), at)
    return None


def agree(problem: IdProblem | None, count: int, group, dp_size: int, device: torch.device,
          ranks_per_replica: int = 1) -> tuple[IdProblem | None, int]:
    """The first replica's problem (in replica order) and the sum of every rank's ``count``, on
    every rank of ``group`` (``dp_size`` ranks: the data-parallel replicas, or with context
    parallelism the d x c ranks of 'dp_cp', ``ranks_per_replica`` = c consecutive ones per replica):
    one all-gather of a few int64."""
    row = torch.full((4 + _MAX_DIMS,), -1, dtype=torch.int64, device=device)
    row[0] = count
    if problem is not None:
        at = problem.at[:_MAX_DIMS]
        row[1], row[2], row[3] = problem.use, problem.value, len(at)
        row[4:4 + len(at)] = torch.tensor(at, dtype=torch.int64)
    rows = [torch.empty_like(row) for _ in range(dp_size)]
    dist.all_gather(rows, row, group=group)
    table = torch.stack(rows).cpu().tolist()
    total = sum(r[0] for r in table)
    for index, r in enumerate(table):
        if r[1] >= 0 or r[1] == REFUSED:
            return IdProblem(r[1], r[2], tuple(r[4:4 + r[3]]), index // ranks_per_replica), total
    return None, total


def _place(at: tuple[int, ...]) -> str:
    if len(at) == 1:
        return f"row {at[0]}"
    if len(at) == 2:
        return f"row {at[0]}, position {at[1]}"
    return f"row {at[0]}, index {list(at[1:])}"


def id_error(problem: IdProblem, roles: "BatchRoles", global_batch: bool, dp_size: int) -> BatchError:
    """The message of an out-of-range id: the tensor, the value, where, the size it must stay under, the fix."""
    if problem.use == REFUSED:
        return BatchError(f"data-parallel replica {problem.replica}'s batch was refused on its own ranks (a shape "
                          f"or dtype that does not fit the program: their error says which), so no replica runs "
                          f"this step. Fix: give every replica a batch of the program's shapes and dtypes")
    use = roles.ids[problem.use]
    if problem.replica is not None and dp_size > 1:
        whose = f"of data-parallel replica {problem.replica}'s own batch"
    else:
        whose = "of the global batch" if global_batch and dp_size > 1 else "of the batch"
    allowed = f"[0, {use.size})" + (f" or equal the ignore_index {use.ignore_index}" if use.ignore_index is not None
                                     else "")
    if use.kind == "embedding":
        fix = (f"tokenize with the tokenizer that matches the model (its vocabulary has {use.size} ids), or make "
               f"the table as large as the tokenizer's vocabulary before parallelize (a HuggingFace model: "
               f"model.resize_token_embeddings(len(tokenizer)))")
    elif use.kind == "target":
        fix = (f"targets are class ids in [0, {use.size}) from the tokenizer that matches the model; mark the "
               f"positions the loss must skip (padding) with {use.ignore_index}, the loss's ignore_index")
    else:
        fix = f"indices must lie in [0, {use.size})"
    return BatchError(
        f"batch tensor '{use.name}' holds {problem.value} at {_place(problem.at)} {whose}, outside the {use.size} "
        f"{use.what} ({use.where}): its values must lie in {allowed}. One device would raise an index error; "
        f"under tensor parallelism such an id would silently read nothing. Fix: {fix}")
