"""What a trace of a module depends on, as a hashable key: its modules, tensors' shapes and attributes.

Two modules with equal keys trace to the same graph (up to the values of their
weights, which a trace never reads): ``trace_reuse`` keys kept traces by it,
and ``layer_stamping`` finds identical blocks by it.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn as nn

__all__ = ["module_state", "value_token", "signature"]

_SIMPLE = (int, float, bool, str, bytes, type(None))


def module_state(model: nn.Module) -> tuple:
    """Each module's name, class, mode, parameters and buffers (which names share one tensor, and
    each one's shape, dtype, device and grad flag; not the values, which the trace never reads)
    and public attributes."""
    first_name: dict[int, str] = {}

    def tensors(m: nn.Module, prefix: str, own: dict[str, torch.Tensor | None]) -> tuple:
        out = []
        for k, t in own.items():
            if t is None:
                out.append((k, None))
                continue
            shared_with = first_name.setdefault(id(t), f"{prefix}{k}")
            out.append((k, shared_with, tuple(t.shape), t.dtype, t.device, t.requires_grad))
        return tuple(out)

    return tuple((name, type(m), m.training, tensors(m, f"{name}.", m._parameters),
                  tensors(m, f"{name}.", m._buffers),
                  tuple(sorted((k, value_token(v)) for k, v in vars(m).items() if not k.startswith("_"))))
                 for name, m in model.named_modules(remove_duplicate=False))


def value_token(value: Any) -> Any:
    """A module attribute as a key: plain values as they are, tensors (which a trace keeps as
    constants) by content, functions by identity, anything else by its repr (a config object)."""
    if isinstance(value, _SIMPLE):
        return value
    if isinstance(value, torch.Tensor):
        return signature(value)
    if isinstance(value, (tuple, list)):
        return type(value), tuple(value_token(v) for v in value)
    if callable(value):
        return id(value)
    return type(value), repr(value)


def signature(examples: Any) -> Any:
    """The examples as the trace sees them: each tensor's shape, dtype, device, grad flag and values."""
    if isinstance(examples, torch.Tensor):  # and the values, which the trace's checks read (token ids)
        values = None if examples.is_meta else hash(examples.detach().cpu().contiguous().numpy(force=True).tobytes())
        return "tensor", tuple(examples.shape), examples.dtype, examples.device, examples.requires_grad, values
    if isinstance(examples, (tuple, list)):
        return type(examples), tuple(signature(e) for e in examples)
    if isinstance(examples, dict):
        return "dict", tuple((k, signature(v)) for k, v in sorted(examples.items()))
    return value_token(examples)
