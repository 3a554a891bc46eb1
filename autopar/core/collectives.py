"""The collective registry: every tensor-parallel collective of ``autopar.core.comm``, registered once.

Each function of the ``autopar.core.comm`` package that communicates is decorated,
where it is defined, with ``@collective(...)``, which records:

- ``label``      how the plan names it (``"f (copy_to_tp)"``),
- ``direction``  when it communicates, as the summary prints it
                 (``"bwd all-reduce"``, ``"fwd all-reduces: max, then sum exp"``),
- ``kinds``      the collectives it runs (all-reduce, all-gather, reduce-scatter),
- ``nbytes``     a function giving the bytes one call moves per microbatch, from
                 its node in the rank graph (one rank's shapes, ``local_val``),
- ``forward_nbytes``  the forward part of it, for a collective that
                 communicates in both passes (a recomputed forward moves it again);
- ``flops``      for a collective fused with GEMMs (async tensor parallelism),
                 the forward FLOPs of its GEMMs, from its node.

Lookups go by the function (``collective_of(node.target)``) or its name
(``collective_named("copy_to_tp")``). The registry is complete whenever it is
read: the first lookup imports ``autopar.core.comm``, whose modules register
their collectives as they load, so no reader has to import it first.

``wire_factor(kind, n)`` is the fraction of a buffer each rank sends over the
wire in a ring collective of n ranks: 2(n-1)/n for an all-reduce (a
reduce-scatter then an all-gather), (n-1)/n for an all-gather or a
reduce-scatter.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.fx as fx

from autopar.core.errors import AutoparError
from autopar.core.graph import local_val

__all__ = ["CollectiveError", "ALL_REDUCE", "ALL_GATHER", "REDUCE_SCATTER", "Collective", "collective", "collective_of",
           "collective_named", "registered", "wire_factor", "output_bytes", "input_bytes", "twice", "fp32_per_row",
           "fp32_per_reduced"]

ALL_REDUCE = "all-reduce"
ALL_GATHER = "all-gather"
REDUCE_SCATTER = "reduce-scatter"
KINDS = (ALL_REDUCE, ALL_GATHER, REDUCE_SCATTER)

DEFINED_IN = "autopar.core.comm"
"""The package whose modules define (and so register) every collective."""


class CollectiveError(AutoparError, ValueError):
    """A collective declared or called wrongly: an unknown kind, a name registered twice, a tensor
    that does not split evenly across the group."""


@dataclass(frozen=True)
class Collective:
    fn: Callable
    label: str
    direction: str
    kinds: tuple[str, ...]
    nbytes: Callable[[fx.Node], int]
    """Bytes one call moves per microbatch (each all-reduced buffer counted once), from its node."""
    forward_nbytes: Callable[[fx.Node], int] | None = None
    """The part of ``nbytes`` moved in the forward, for a collective that communicates in both
    passes; None: all of it (``direction`` 'fwd ...') or none ('bwd ...')."""
    flops: Callable[[fx.Node], float] | None = None
    """Forward FLOPs of the GEMMs a collective fused with them computes, from its node; None: none."""

    @property
    def name(self) -> str:
        return self.fn.__name__

    def forward_bytes(self, node: fx.Node) -> int:
        """Bytes one call moves in its forward: what a recomputed (checkpointed) forward moves again."""
        if self.forward_nbytes is not None:
            return self.forward_nbytes(node)
        return self.nbytes(node) if self.direction.startswith("fwd") else 0


_BY_FN: dict[Callable, Collective] = {}
_BY_NAME: dict[str, Collective] = {}
_loaded = False


def _load_every_collective() -> None:
    """Import the modules defining the collectives (once), so that a lookup sees every one."""
    global _loaded
    if not _loaded:
        importlib.import_module(DEFINED_IN)
        _loaded = True


def collective(label: str, direction: str, kinds: str | tuple[str, ...], nbytes: Callable[[fx.Node], int],
               forward_nbytes: Callable[[fx.Node], int] | None = None,
               flops: Callable[[fx.Node], float] | None = None) -> Callable[[Callable], Callable]:
    """Decorator: register a function of ``autopar.core.comm`` as a collective (returns it unchanged).
    ``forward_nbytes``: required when it communicates in both passes ('fwd ...; bwd ...'); ``flops``:
    the forward FLOPs of the GEMMs it runs, for one fused with them."""
    kinds = (kinds,) if isinstance(kinds, str) else tuple(kinds)
    unknown = [k for k in kinds if k not in KINDS]
    if unknown:
        raise CollectiveError(f"unknown collective kinds {unknown}; use {KINDS}")
    if forward_nbytes is None and "fwd" in direction and "bwd" in direction:
        raise CollectiveError(f"collective {label!r} communicates in both passes ({direction}): give forward_nbytes, "
                         f"the bytes of its forward part (a recomputed forward moves them again)")

    def register(fn: Callable) -> Callable:
        if fn.__name__ in _BY_NAME:
            raise CollectiveError(f"collective {fn.__name__} is registered twice")
        entry = Collective(fn, label, direction, kinds, nbytes, forward_nbytes, flops)
        _BY_FN[fn] = entry
        _BY_NAME[fn.__name__] = entry
        return fn

    return register


def collective_of(target) -> Collective | None:
    """The registered collective a graph node calls (its ``target``), or None."""
    _load_every_collective()
    try:
        return _BY_FN.get(target)
    except TypeError:  # an unhashable target is no collective
        return None


def collective_named(name: str) -> Collective:
    """The registered collective called ``name`` (KeyError if none is)."""
    _load_every_collective()
    return _BY_NAME[name]


def registered() -> tuple[Collective, ...]:
    """Every registered collective, in the order their modules define them."""
    _load_every_collective()
    return tuple(_BY_FN.values())


def wire_factor(kind: str, n: int) -> float:
    """Fraction of a buffer each of ``n`` ranks sends in a ring ``kind`` collective."""
    if n <= 1:
        return 0.0
    if kind == ALL_REDUCE:
        return 2 * (n - 1) / n
    if kind in (ALL_GATHER, REDUCE_SCATTER):
        return (n - 1) / n
    raise CollectiveError(f"unknown collective kind {kind!r}; use {KINDS}")


# ------------------------------------------------------------------ bytes per call


def output_bytes(node: fx.Node) -> int:
    """The bytes of the node's output (on one rank): what f, g, a gather or a scatter moves."""
    val = local_val(node)
    return val.numel() * val.element_size() if isinstance(val, torch.Tensor) else 0


def input_bytes(node: fx.Node) -> int:
    """The bytes of the node's first argument (on one rank): what a reduce-scatter reduces."""
    return output_bytes(node.args[0])


def twice(nbytes: Callable[[fx.Node], int]) -> Callable[[fx.Node], int]:
    """``nbytes`` moved once in the forward and once in the backward (a reduce-scatter whose
    backward all-gathers the same buffer, and the converse)."""
    return lambda node: 2 * nbytes(node)


def fp32_per_row(buffers: int) -> Callable[[fx.Node], int]:
    """``buffers`` fp32 values per row of the first argument (an (N, C) loss input: (N,) buffers)."""
    return lambda node: buffers * local_val(node.args[0]).shape[0] * 4


def fp32_per_reduced(buffers: int) -> Callable[[fx.Node], int]:
    """``buffers`` fp32 tensors of the first argument's shape reduced over dim ``node.args[2]``."""

    def nbytes(node: fx.Node) -> int:
        x = local_val(node.args[0])
        return buffers * (x.numel() // x.shape[node.args[2]]) * 4

    return nbytes
