"""How a module's own code initialises it: the rule meta-device initialisation follows.

A model built on the meta device has no values. Its modules' code can make
them again, as it did when the model was built for real:

1. ``module.reset_parameters()`` (or ``_reset_parameters()``): what every
   ``torch.nn`` layer's constructor calls;
2. for a model that follows HuggingFace's convention (a ``_init_weights(module)``
   method, as every ``PreTrainedModel`` has), that method applied to the module
   and then to each of its ancestors, nearest first, as ``post_init`` does
   (``apply`` visits children before parents: GPT-2's attention block rescales
   its child projection's weight after the projection's own init). Each
   module is initialised by the ``_init_weights`` of the nearest model above it
   (a model nested in another initialises its own modules);
3. for a buffer neither of those writes (tables computed in ``__init__``), a
   module that owns no parameters is built again by its class, on the target
   device, from the constructor arguments it kept as attributes of the same
   names (``RotaryEmbedding(config)`` keeps ``self.config``); the buffer is
   taken from the new instance.

``init_steps`` lists steps 1-2 for a module, ``rebuild`` does step 3, and
``check_initialisable`` refuses, before any work, a module that owns a value
to make and has none of them, naming it and the fixes.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Iterable

import torch
import torch.nn as nn

from autopar.core.errors import AutoparError

__all__ = ["InitError", "init_steps", "rebuild", "check_initialisable", "owner_path", "FIX"]

FIX = ("pass the values instead: materialize(state_dict={name: tensor, ...}) (buffers alone may be "
       "passed this way; init_weights(..., buffers=...) on one device) or materialize(checkpoint=...)")


class InitError(AutoparError, ValueError):
    """A value of a meta-device model that its modules' code cannot make; the message names it and the fix."""


def owner_path(name: str) -> str:
    """The path of the module that holds the parameter or buffer ``name`` ('' for the model)."""
    return name.rsplit(".", 1)[0] if "." in name else ""


def _ancestry(model: nn.Module, path: str) -> list[tuple[str, nn.Module]]:
    """(path, module) of the module at ``path`` and each of its ancestors, nearest first."""
    parts = path.split(".") if path else []
    return [(".".join(parts[:i]), model.get_submodule(".".join(parts[:i]))) for i in range(len(parts), -1, -1)]


def init_steps(model: nn.Module, path: str) -> list[tuple[str, Callable[[], None]]]:
    """(label, call) of what initialises the module at ``path``, in order (rules 1 and 2)."""
    module = model.get_submodule(path)
    steps = []
    for method in ("reset_parameters", "_reset_parameters"):
        if callable(getattr(module, method, None)):
            steps.append((f"{type(module).__name__}.{method}()", getattr(module, method)))
            break
    ancestry = _ancestry(model, path)
    for i, (_, node) in enumerate(ancestry):
        # the nearest model at or above this module that has an _init_weights initialises it
        owner = next((m for _, m in ancestry[i:] if callable(getattr(m, "_init_weights", None))), None)
        if owner is not None:
            steps.append((f"{type(owner).__name__}._init_weights({type(node).__name__})",
                          lambda owner=owner, node=node: owner._init_weights(node)))
    return steps


def _constructor_arguments(module: nn.Module) -> dict | None:
    """Keyword arguments that rebuild ``module``: each constructor parameter it kept as an
    attribute of the same name; None when a parameter without a default was not kept."""
    try:
        params = list(inspect.signature(type(module).__init__).parameters.values())[1:]
    except (TypeError, ValueError):
        return None
    kwargs = {}
    for p in params:
        if p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD):
            continue
        if p.name in vars(module) and p.kind != p.POSITIONAL_ONLY:
            kwargs[p.name] = vars(module)[p.name]
        elif p.default is p.empty:
            return None
    return kwargs


def rebuildable(module: nn.Module) -> bool:
    """Rule 3 applies: no parameters, and every constructor argument without a default kept."""
    return next(module.parameters(), None) is None and _constructor_arguments(module) is not None


def rebuild(module: nn.Module, device: torch.device) -> nn.Module | None:
    """A new instance of the module's class built on ``device`` from the arguments it kept (rule 3)."""
    if not rebuildable(module):
        return None
    with torch.device(device):
        return type(module)(**_constructor_arguments(module))


def check_initialisable(model: nn.Module, params: Iterable[str], buffers: Iterable[str]) -> None:
    """Every module owning one of ``params`` or ``buffers`` (full names) can make them; else an
    ``InitError`` naming each module, what it holds and the fixes."""
    owned: dict[str, tuple[list[str], list[str]]] = {}
    for kind, names in ((0, params), (1, buffers)):
        for name in names:
            owned.setdefault(owner_path(name), ([], []))[kind].append(name)
    problems = []
    for path, (ps, bs) in owned.items():
        module = model.get_submodule(path)
        if init_steps(model, path) or (not ps and rebuildable(module)):
            continue
        what = ", ".join(f"parameter '{n}'" for n in ps) + (", " if ps and bs else "") + \
            ", ".join(f"buffer '{n}'" for n in bs)
        problems.append(f"  module '{path or '(the model)'}' ({type(module).__name__}): {what}")
    if problems:
        raise InitError(
            f"the model is on the meta device and {len(problems)} module(s) have no code that makes their "
            f"values (no reset_parameters(), no model _init_weights(module); a buffer computed in __init__ is "
            f"lost on the meta device):\n" + "\n".join(problems) +
            f"\nfix: give the module a reset_parameters() that sets them, or {FIX}")
