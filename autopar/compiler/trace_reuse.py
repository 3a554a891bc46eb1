"""Traces kept: compiling an equal model on the same examples for another layout traces it once.

``parallelize`` for several layouts of one model (a sweep over layouts, the
planner's candidates, one program per pipeline depth) would run torch.export
each time, most of a compile. The trace depends only on the model, the
examples, the loss and the output function, so it is kept under a key made of
exactly those: each module's class, mode, parameters and buffers (which share
a tensor, and each one's shape, dtype, device and grad flag; a trace never
reads their values) and public attributes, the examples (values too, which
its checks read), and the two functions. A change to any of them traces
again; two equal models built apart (the same config) share a trace. Each
compile gets its own copy (the passes rewrite the graph in place); the
``KEEP`` most recently used traces are kept. What a forward reads from outside
its modules (a global flag) is not in the key: after changing such state,
call ``forget()`` to trace again.
"""

from __future__ import annotations

import copy
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

import torch
import torch.nn as nn

from autopar.compiler.module_state import module_state, signature
from autopar.compiler.trace import trace
from autopar.core.graph import TracedModel

__all__ = ["traced", "forget", "KEEP"]

KEEP = 16
"""How many traces are kept (the most recently used)."""
_KEPT: OrderedDict[tuple, TracedModel] = OrderedDict()


def traced(model: nn.Module, example_inputs: Any, example_targets: Any, loss_fn: Callable,
           output_fn: Callable | None = None) -> TracedModel:
    """``trace(...)``, or a copy of the trace kept from an earlier call with an equal model,
    examples and functions."""
    key = _key(model, example_inputs, example_targets, loss_fn, output_fn)
    if key is not None and key in _KEPT:
        _KEPT.move_to_end(key)
        return copy.deepcopy(_KEPT[key])
    result = trace(model, example_inputs, example_targets, loss_fn, output_fn)
    if key is not None:
        _KEPT[key] = copy.deepcopy(result)
        while len(_KEPT) > KEEP:
            _KEPT.popitem(last=False)
    return result


def forget() -> None:
    """Drop every kept trace: the next compile of any model traces it again."""
    _KEPT.clear()


def _key(model: nn.Module, example_inputs: Any, example_targets: Any, loss_fn: Callable,
         output_fn: Callable | None) -> tuple | None:
    """What the trace depends on, or None when part of it cannot be keyed (nothing is kept then)."""
    try:
        key = (module_state(model), signature(example_inputs), signature(example_targets), loss_fn, output_fn)
        hash(key)
    except TypeError:  # an unhashable loss or attribute: trace every time
        return None
    return key
