"""The user's callables against the calls tracing makes, and the names of the batch tensors.

Tracing calls ``model(*example_inputs)`` and then
``loss_fn(output_fn(output), *example_targets)``. Checked here, before
``torch.export`` runs, a mismatch says what signature is expected, what the
function's own signature is (``inspect``), where it is defined, and the fix,
instead of a ``TypeError`` from inside generated code.

The batch tensors take the names of the parameters they bind to: the model's
forward arguments (``input_ids``, ``attention_mask``) and the loss's targets
(``target`` for ``F.cross_entropy``), so the graph's placeholders, the
generated code and the runtime's messages speak the model's words.
"""

from __future__ import annotations

import builtins

import inspect
import keyword
from collections.abc import Callable

import torch.nn as nn

__all__ = ["call_errors", "batch_names"]

_POSITIONAL = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)


def call_errors(model: nn.Module, loss_fn: Callable, n_inputs: int, n_targets: int,
                default_loss: bool = False) -> list[str]:
    """What is wrong with calling ``model.forward`` with ``n_inputs`` tensors and ``loss_fn`` with the
    output and ``n_targets`` tensors, each with the fix ([] when both bind, or cannot be inspected)."""
    errors = []
    forward = _signature(model.forward)
    if forward is not None:
        try:
            forward.bind(*range(n_inputs))
        except TypeError as e:
            errors.append(_forward_message(model, forward, n_inputs, e))
    loss = _signature(loss_fn)
    if loss is not None:
        try:
            loss.bind(*range(1 + n_targets))
        except TypeError as e:
            errors.append(_loss_message(loss_fn, loss, n_targets, e, default_loss))
    return errors


def batch_names(model: nn.Module, loss_fn: Callable, n_inputs: int, n_targets: int) -> tuple[list[str], list[str]]:
    """Names for the example inputs (the forward's parameters they bind to) and the targets (the
    loss's parameters after the output), distinct valid identifiers; ``input_i`` / ``target``,
    ``targets_i`` where a signature says nothing."""
    inputs = [_unshadowed(n) for n in _bound_names(model.forward, 0, n_inputs, "input")]
    targets = [_unshadowed(n) for n in _bound_names(loss_fn, 1, n_targets, "target")]
    taken = set(inputs)
    unique = []
    for name in targets:
        while name in taken:
            name = f"{name}_target"
        taken.add(name)
        unique.append(name)
    return inputs, unique


def _unshadowed(name: str) -> str:
    """``name``, or ``name_`` for the name of a Python builtin (``input``, ``iter``, ``id``): a graph made
    anew from the traced one (a pipeline chunk) renames such a placeholder (``input_1``), and the batch
    tensor would no longer find it."""
    return f"{name}_" if hasattr(builtins, name) else name


def _bound_names(fn: Callable, skip: int, n: int, default: str) -> list[str]:
    """The names of the positional parameters of ``fn`` that arguments ``skip .. skip+n`` bind to."""
    fallback = [default] if n == 1 else [f"{default}s_{i}" for i in range(n)]
    sig = _signature(fn)
    if sig is None:
        return fallback
    params = list(sig.parameters.values())
    positional = [p.name for p in params if p.kind in _POSITIONAL]
    star = next((p.name for p in params if p.kind == inspect.Parameter.VAR_POSITIONAL), None)
    names = []
    for i in range(n):
        j = skip + i
        name = positional[j] if j < len(positional) else f"{star}_{j - len(positional)}" if star else fallback[i]
        names.append(name if name.isidentifier() and not keyword.iskeyword(name) else fallback[i])
    return names if len(set(names)) == n else fallback


def _forward_message(model: nn.Module, sig: inspect.Signature, n_inputs: int, err: TypeError) -> str:
    name = type(model).__name__
    return (f"{name}.forward{_plain(sig)} cannot be called with the {n_inputs} example input(s) autopar passes "
            f"positionally ({name}(*example_inputs)): {err}{_defined_at(type(model).forward)}. Fix: pass "
            f"example_inputs as a tuple with one tensor per positional parameter of forward, in order; a "
            f"forward that needs keyword-only or non-tensor arguments can be wrapped in a small nn.Module "
            f"whose forward takes only tensors")


def _loss_message(loss_fn: Callable, sig: inspect.Signature, n_targets: int, err: TypeError,
                  default_loss: bool) -> str:
    """The expected call, the function's own signature and the fix for the count it takes."""
    params = list(sig.parameters.values())
    positional = [p for p in params if p.kind in _POSITIONAL]
    required = sum(1 for p in positional if p.default is inspect.Parameter.empty) - 1
    most = None if any(p.kind == inspect.Parameter.VAR_POSITIONAL for p in params) else len(positional) - 1
    name = getattr(loss_fn, "__qualname__", type(loss_fn).__name__)
    call = ", ".join(["output"] + [f"target{i}" if n_targets > 1 else "target" for i in range(n_targets)])
    given = (f"then the {_count(n_targets, 'tensor')} of example_targets" if n_targets
             else "and no target, as example_targets was not given")
    own = f"{name}{_plain(sig)}" + (" (the default loss: cross-entropy over the last dim)" if default_loss else "")
    head = (f"loss_fn must have the signature loss_fn(output, *targets) -> scalar tensor; autopar calls it as "
            f"loss_fn({call}): the model's output (after output_fn), {given}. The loss_fn passed is "
            f"{own}{_defined_at(loss_fn)}: {err}. Fix: ")
    if most is not None and most < 0:
        return head + f"give {name} the model's output as its first positional parameter"
    if n_targets < required:
        wanted = ", ".join(p.name for p in positional[1:1 + required])
        return head + (f"pass example_targets with {_count(required, 'tensor')} ({wanted}: one microbatch, "
                       f"in that order), or a loss_fn that takes {_count(n_targets, 'target')}")
    return head + (f"pass a loss_fn that takes the output and {_count(n_targets, 'target')} "
                   f"(loss_fn({call})), or " + (f"example_targets with {_count(most, 'tensor')}" if most
                                                 else "no example_targets"))


def _count(n: int, noun: str) -> str:
    return f"{n} {noun}" + ("" if n == 1 else "s")


def _plain(sig: inspect.Signature) -> str:
    """A signature without annotations: ``(logits, targets)``."""
    params = [p.replace(annotation=inspect.Parameter.empty) for p in sig.parameters.values()]
    return str(sig.replace(parameters=params, return_annotation=inspect.Signature.empty))


def _signature(fn: Callable) -> inspect.Signature | None:
    """``fn``'s signature, or None for a callable that cannot be inspected (a builtin)."""
    try:
        return inspect.signature(fn)
    except (TypeError, ValueError):
        return None


def _defined_at(fn: Callable) -> str:
    """`` (defined at file.py:12)`` or ''."""
    try:
        file = inspect.getsourcefile(fn)
        line = inspect.getsourcelines(fn)[1]
    except (TypeError, OSError):
        return ""
    return f" (defined at {file.rsplit('/', 1)[-1]}:{line})" if file else ""
