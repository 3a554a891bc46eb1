"""The distributed optimizer's state in a checkpoint: the plain optimizer's keys, written by range.

A ``DistributedOptimizer`` keeps, per parameter, only the entries of its
flat range this replica owns (``FlatBucket.pieces``): a 1-D run of the local
shard's entries, in row-major order, which may start and end mid-row. Saved
under the same keys as the plain optimizer's state (``optimizer_state``), in
the parameter's full shape, so the checkpoint does not depend on d, tp or pp
and either optimizer loads it:

- ``optim.<name>.<state key>``: each owned range cut into boxes of the local
  shard (a partial first row, whole rows, a partial last row; ``flat_boxes``),
  each box placed in the full tensor through the shard's regions
  (``param_regions``: a stacked expert weight's moved to its first expert):
  a few chunks per replica, which DCP writes and, on a
  load at any layout, reads where they overlap the loader's own ranges;
- ``optim.<name>.param_group``: the options of the group updating the parameter;
- ``master.<name>``: the fp32 master copy, only for a parameter of lower
  precision (bf16), whose master holds bits the parameter lacks. A load at
  lower precision reads it; otherwise the masters are re-read from the
  parameters just loaded (in fp32 they are equal).

A value held alike by several ranks is written by one: a replicated
parameter's range by tp rank 0, a tied parameter's by the first stage holding
it (the others hold the same range, possibly cut at other offsets, which DCP
would find overlapping). ``holdings`` is the engine's ``engine.holdings`` and
``optimizer`` a ``DistributedOptimizer`` (unannotated: the engine imports this code).
"""

from __future__ import annotations

import math

import torch

from autopar.core.tensor_placement import Shard
from autopar.runtime.checkpoint.dcp import Pieces
from autopar.runtime.checkpoint.description import CheckpointError
from autopar.runtime.checkpoint.optimizer_state import (
    GROUP_KEY,
    hyperparameters,
    missing_state_error,
    restore_objects,
    saved_state_keys,
    set_hyperparameters,
    state_keys_errors,
)
from autopar.runtime.checkpoint.optimizer_state import initialise_state as _initialise_plain
from autopar.runtime.checkpoint.model_state import param_regions

__all__ = ["flat_boxes", "range_pieces", "optimizer_entries", "initialise_state", "optimizer_targets",
           "optimizer_errors", "apply_loaded", "MASTER"]

MASTER = "master"
"""``master.<name>``: a lower-precision parameter's fp32 master copy."""

Box = tuple[tuple[int, ...], tuple[int, ...]]
"""(offsets, sizes) of a box of a tensor."""


def flat_boxes(shape: tuple[int, ...], start: int, stop: int) -> list[Box]:
    """The flat entries ``[start, stop)`` of a row-major tensor of ``shape`` as boxes, in order, each
    contiguous in memory: the rest of the first row (recursively), whole rows, the start of the last."""
    if start >= stop:
        return []
    if len(shape) <= 1:
        return [((start,), (stop - start,))] if shape else [((), ())]
    inner = math.prod(shape[1:])
    boxes: list[Box] = []
    head_end = min(stop, -(-start // inner) * inner)
    if start < head_end:
        row = start // inner
        boxes += [((row, *o), (1, *s)) for o, s in flat_boxes(shape[1:], start - row * inner, head_end - row * inner)]
    body_end = max(head_end, stop // inner * inner)
    if head_end < body_end:
        boxes.append(((head_end // inner, *[0] * (len(shape) - 1)), ((body_end - head_end) // inner, *shape[1:])))
    if body_end < stop:
        row = body_end // inner
        boxes += [((row, *o), (1, *s)) for o, s in flat_boxes(shape[1:], 0, stop - row * inner)]
    return boxes


def range_pieces(program, name: str, tp_rank: int, local_shape: tuple[int, ...], start: int,
                 flat: torch.Tensor, ep_rank: int = 0) -> Pieces:
    """``flat`` (the local shard's flat entries ``[start, start + flat.numel())`` of parameter ``name``)
    as pieces of the parameter's full shape: views of ``flat``, which a save reads and a load fills."""
    full = program.full_shape(name)
    regions = param_regions(program, name, tp_rank, ep_rank)
    strides = [math.prod(local_shape[i + 1:]) for i in range(len(local_shape))]
    pieces = []
    for offsets, sizes in flat_boxes(tuple(local_shape), start, start + flat.numel()):
        at = sum(o * s for o, s in zip(offsets, strides)) - start
        box = flat[at : at + math.prod(sizes)].view(sizes)
        for region in regions:
            piece = _in_region(box, offsets, *region)
            if piece is not None:
                pieces.append(piece)
    return Pieces(torch.Size(full), pieces)


def _in_region(box: torch.Tensor, offsets: tuple[int, ...], region_offsets, dim: int, first: int, rows: int):
    """The part of ``box`` (at local ``offsets``) inside one region of the shard, at its global offsets:
    along the region's cut ``dim`` from its rows, along the other dims shifted by the region's offsets
    (zero, but for a stacked expert weight's first expert on dim 0)."""
    if not offsets:  # a scalar
        return torch.Size(offsets), box
    at = [o + r for o, r in zip(offsets, region_offsets)]
    if rows < 0:  # the whole shard, shifted only
        return torch.Size(at), box
    lo, hi = max(offsets[dim], first), min(offsets[dim] + box.shape[dim], first + rows)
    if lo >= hi:
        return None
    at[dim] = region_offsets[dim] + lo - first
    return torch.Size(at), box.narrow(dim, lo - offsets[dim], hi - lo)


def _writes(holdings, name: str) -> bool:
    """Whether this rank writes parameter ``name``'s ranges: every tp rank a split parameter's (and a
    whole expert weight's, whose tp ranks hold different experts), tp rank 0 a replicated one's; the
    first stage holding it (a tied weight)."""
    program = holdings.program
    whole_expert = name in program.expert_params and holdings.mesh.shape.rows_split > 1
    if not isinstance(program.param_spec(name), Shard) and holdings.mesh.tp_rank != 0 and not whole_expert:
        return False
    return program.param_stages[name][0] == holdings.stage


def _pieces_of(holdings, optimizer, name: str, flat: torch.Tensor) -> Pieces:
    """A tensor laid out like parameter ``name``'s owned range, as pieces of its full shape."""
    _, piece, _ = optimizer.owned[name]
    return range_pieces(holdings.program, name, holdings.mesh.tp_rank, tuple(optimizer.params[name].shape),
                        piece.start, flat, holdings.mesh.ep_rank)


def _state_value(holdings, optimizer, name: str, key: str, value, view: torch.Tensor):
    """One state value as saved (or as a load's destination): pieces when laid out like the range, a
    0-d tensor whole, a non-tensor as an object."""
    if not isinstance(value, torch.Tensor):
        return value
    if value.dim() == 0:
        return value
    if value.shape == view.shape:
        return _pieces_of(holdings, optimizer, name, value.detach())
    raise CheckpointError(f"optimizer state '{key}' of parameter {name} has shape {tuple(value.shape)}, neither "
                          f"its owned range's {tuple(view.shape)} nor a scalar: only element-wise optimizer state "
                          f"can be saved in the parameters' full shapes")


def optimizer_entries(holdings, optimizer) -> dict:
    """``optim.*`` (and ``master.*``) entries of the ranges this rank writes; every group's options."""
    out = {f"optim.{name}.{GROUP_KEY}": hyperparameters(optimizer.param_groups[index])
           for name, index in optimizer.group_of.items()}
    for name, (_, _, view) in optimizer.owned.items():
        if not _writes(holdings, name):
            continue
        for key, value in optimizer.state.get(view, {}).items():
            out[f"optim.{name}.{key}"] = _state_value(holdings, optimizer, name, key, value, view)
        if optimizer.keeps_wider_masters(name):
            out[f"{MASTER}.{name}"] = _pieces_of(holdings, optimizer, name, view.detach())
    return out


def initialise_state(optimizer) -> list[torch.Tensor]:
    """The inner optimizer's state made for every owned range without one (see ``optimizer_state``)."""
    return _initialise_plain(optimizer.inner)


def optimizer_targets(holdings, optimizer, saved_keys) -> dict:
    """Where a load puts each value: views of this replica's state tensors and master ranges (DCP
    writes into them), None for stored objects. A parameter without saved state gets its options only."""
    out: dict = {f"optim.{name}.{GROUP_KEY}": None for name in optimizer.group_of}
    for name, (_, _, view) in optimizer.owned.items():
        if not saved_state_keys(saved_keys, name):
            continue
        for key, value in optimizer.state[view].items():
            target = _state_value(holdings, optimizer, name, key, value, view)
            out[f"optim.{name}.{key}"] = target if isinstance(target, (torch.Tensor, Pieces)) else None
        if optimizer.keeps_wider_masters(name) and f"{MASTER}.{name}" in saved_keys:
            out[f"{MASTER}.{name}"] = _pieces_of(holdings, optimizer, name, view.detach())
    return out


def optimizer_errors(holdings, optimizer, saved_keys) -> list[str]:
    """Why the checkpoint's optimizer state does not fit this optimizer (empty when it does)."""
    errors = []
    for name in optimizer.group_of:
        if f"optim.{name}.{GROUP_KEY}" not in saved_keys:
            return [missing_state_error(name)]
        if name in optimizer.owned:
            mine = set(optimizer.state[optimizer.owned[name][2]])
            errors += state_keys_errors(name, saved_state_keys(saved_keys, name), mine)
    return errors


def apply_loaded(holdings, optimizer, loaded: dict) -> None:
    """After DCP filled ``loaded``: stored objects into the state, no state for a range the checkpoint
    holds none for, each group's options, and the master copies (read, or re-read from the parameters)."""
    for name, (_, _, view) in optimizer.owned.items():
        restore_objects(optimizer.state, view, name, loaded)
    first_name = {}
    for name, index in optimizer.group_of.items():
        first_name.setdefault(index, name)
    for index, name in first_name.items():
        set_hyperparameters(optimizer.param_groups[index], loaded[f"optim.{name}.{GROUP_KEY}"])
    optimizer.masters_loaded({name for name in optimizer.owned if f"{MASTER}.{name}" in loaded})
