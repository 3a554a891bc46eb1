"""The model's own ``state_dict()`` keys, and where a compiled program holds each one's value.

A program knows its parameters by canonical name (a tied weight's first name)
and its buffers by graph placeholder; the model's ``state_dict()`` names every
parameter under each of its names (tied weights twice) and holds persistent
buffers only (a rotary ``inv_freq`` registered with ``persistent=False`` is not
in it). ``state_sources`` maps one to the other, in the model's key order, so
``full_state_dict`` and the HuggingFace export produce exactly the model's keys.

A parameter the traced graph never reads has no placeholder and no shard; no
gradient reaches it, so training never changes it: its value is the model's own.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

import torch

from autopar.core.errors import AutoparError

if TYPE_CHECKING:
    from autopar.compiler.program import Program

__all__ = ["StateSource", "state_sources", "ModelStateError"]


class ModelStateError(AutoparError, ValueError):
    """A model state the program cannot place: extra state that is no tensor, a meta tensor no graph reads."""

Kind = Literal["param", "buffer", "model"]


@dataclass(frozen=True)
class StateSource:
    """Where the value of one ``state_dict`` key lives."""

    key: str
    """The key in the model's ``state_dict()``."""
    kind: Kind
    """'param': a parameter the ranks hold in shards; 'buffer': a persistent buffer every rank
    holds whole; 'model': a tensor the graph never reads, unchanged in the model itself."""
    name: str
    """'param': the canonical parameter name (``program.param_names``); 'buffer': the graph
    placeholder feeding it; 'model': the key itself."""
    shape: tuple[int, ...]
    """The model's shape of the value (a padded vocabulary unpadded)."""
    dtype: torch.dtype
    index: int | None = None
    """'param' of an expert stacked by the compiler (``TracedModel.stacked``): the key is entry
    ``index`` of the parameter's first dim; None: the key is the whole parameter."""


def state_sources(program: "Program") -> list[StateSource]:
    """Every key of ``program.model.state_dict()``, in its order, with where its value lives.

    Raises ValueError, naming the key, for an entry that is not a tensor (a module's extra state).
    """
    traced = program.traced
    canonical = {alias: name for name, names in traced.aliases.items() for alias in names}
    placeholder_of_buffer = {name: ph for ph, name in traced.buffer_of.items()}
    held = set(program.param_names)
    stacked_in = {m: (name, e) for name, members in traced.stacked.items() for e, m in enumerate(members)}
    out = []
    for key, value in program.model.state_dict(keep_vars=True).items():
        if not isinstance(value, torch.Tensor):
            raise ModelStateError(f"state_dict key '{key}' holds a {type(value).__name__} (a module's extra state), "
                             "not a tensor: autopar holds only parameters and buffers; drop it from the "
                             "state_dict with a state-dict hook, or keep such state outside the model")
        shape, dtype = tuple(value.shape), value.dtype
        if key in stacked_in:
            out.append(StateSource(key, "param", stacked_in[key][0], shape, dtype, index=stacked_in[key][1]))
        elif canonical.get(key, key) in held:
            out.append(StateSource(key, "param", canonical.get(key, key), shape, dtype))
        elif key in placeholder_of_buffer:
            out.append(StateSource(key, "buffer", placeholder_of_buffer[key], shape, dtype))
        else:
            out.append(StateSource(key, "model", key, shape, dtype))
    return out


def untraced_value(program: "Program", source: StateSource, device: torch.device) -> torch.Tensor:
    """The value of a 'model' source: the model's own tensor (the graph never reads it), on ``device``."""
    value = program.model.state_dict(keep_vars=True)[source.key].detach()
    if value.is_meta:
        raise ModelStateError(f"'{source.key}' is on the meta device and the traced graph never reads it, so no "
                         "rank holds a value for it: give the model real weights before parallelize")
    return value.to(device, copy=True)
