"""What a sharding rule returns: a ``Decision`` for one node.

A decision says where the node's output lives and what the rewrite
(``passes/tensor_parallel.py``) puts around it:

- ``copy_in``     operands that get Megatron's f (identity forward, all-reduce
                  backward): a replicated value that requires grad and feeds a
                  split computation whole (the input of a column-parallel
                  linear; a norm weight broadcast over split heads).
- ``scatter_in``  replicated operands narrowed to this rank's slice (a mask with
                  one row per head meeting head-split scores).
- ``gather_in``   split operands all-gathered because the op has no rule: the op
                  then runs replicated (a *fallback*, listed in the summary).
- ``local_args``  arguments that take their value on one rank (a view's sizes,
                  the piece sizes of a split, the bounds of a slice).
- ``rewrite``     the op replaced by another call (a vocabulary-parallel kernel
                  of ``autopar.core.comm``; a row-parallel linear without its bias).
- ``reduce_out``  the output is a partial sum: g (``reduce_from_tp``) after it,
                  then the operand ``add_after_reduce`` (a bias) added once.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch.fx as fx

from autopar.core.tensor_placement import Partial, Replicate, Shard
from passes.rules.context import Path

__all__ = ["Decision", "Rewrite", "Operand", "TP", "NeedSegments", "R", "fallback", "replicated", "is_split"]

R = Replicate()


@dataclass(frozen=True)
class Operand:
    """An argument of a rewrite: the node's operand at ``path`` (after f, scatter and gather)."""

    path: Path


@dataclass(frozen=True)
class _TPGroupArg:
    def __repr__(self) -> str:
        return "TP"


TP = _TPGroupArg()
"""An argument of a rewrite: the rank graph's tensor-parallel group (its ``tp`` placeholder)."""


@dataclass(frozen=True)
class Rewrite:
    """Replace the op by ``fn(*args)``; ``args`` hold ``Operand``s, ``TP`` and constants."""

    fn: Callable
    args: tuple
    in_place: bool = False
    """Retarget the node itself (it keeps its name); else a new node named after ``fn`` replaces it."""


@dataclass(frozen=True)
class Decision:
    out: Any
    """Placement of the output (a tuple of placements for multi-output ops)."""
    kind: str = "replicated"
    """replicated | sharded | column | row | fallback, or a vocabulary-parallel kernel: vocab_embedding |
    vocab_cross_entropy | vocab_softmax | vocab_nll | vocab_gather (the summary and the tests read it)."""
    copy_in: tuple = ()
    """Operand paths that get f (copy_to_tp)."""
    scatter_in: tuple = ()
    """(path, Shard) of replicated operands narrowed to the local slice."""
    gather_in: tuple = ()
    """(path, Shard) of split operands gathered for a fallback."""
    param_demand: dict = field(default_factory=dict)
    """Parameter placeholder name -> placement this op needs for it."""
    local_args: tuple = ()
    """(path, value) of arguments rewritten to their value on one rank."""
    rewrite: Rewrite | None = None
    """The op replaced by another call."""
    reduce_out: bool = False
    """Output is a partial sum: insert g (reduce_from_tp) after it."""
    mean_over_ranks: bool = False
    """With ``reduce_out``: the output is a local mean of 1/t of the values, divided by t before g."""
    add_after_reduce: Path | None = None
    """With ``reduce_out``: an operand (a bias) the rewrite drops from the op and adds once after g."""
    closes_region: bool = False
    """The op turns split operands into a replicated result with its own all-reduces (a
    vocabulary-parallel loss or logsumexp). A g after it (``reduce_out``) closes a region too."""
    error: str | None = None
    """A divisibility problem: the user's tp does not fit the model here."""
    reason: str = ""
    """Why a fallback happened."""

    @property
    def ends_region(self) -> bool:
        """Turns split values back into a replicated one by itself (g after it, or its own kernel)."""
        return self.reduce_out or self.closes_region


class NeedSegments(Exception):
    """A split of a column-parallel output into pieces: the linear must split each piece."""

    def __init__(self, origin: str, sizes: list[int], error: str | None = None):
        super().__init__(origin, sizes)
        self.origin, self.sizes = origin, list(sizes)
        self.error = error
        """What to report if the split into pieces does not work out either (the view that asked
        would otherwise need a number of groups that t does not divide)."""


def fallback(shards, reason: str, error: str | None = None) -> Decision:
    """Run the op replicated: its split operands ``shards`` ((path, Shard) pairs) are all-gathered."""
    return Decision(R, kind="fallback", gather_in=tuple(shards), reason=reason, error=error)


def replicated(node: fx.Node) -> Decision:
    """Every output replicated (one placement per output of a multi-output op)."""
    val = node.meta.get("val")
    if isinstance(val, (tuple, list)):
        return Decision(tuple(R for _ in val))
    return Decision(R)


def is_split(p) -> bool:
    """A placement other than replicated (``Partial`` included)."""
    return isinstance(p, (Shard, Partial))
