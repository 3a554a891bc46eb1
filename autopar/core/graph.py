"""Graph vocabulary shared by every floor: the traced model and where a node came from.

``TracedModel`` is what tracing produces and every pass reads: the fx graph
and how its placeholders map to the user's parameters, buffers and inputs.
``module_path`` / ``source_line`` locate a node in the user's model for
error messages and the plan summary.
"""

from __future__ import annotations

import os
import re
import sys
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.fx as fx

__all__ = ["TracedModel", "module_path", "user_path", "source_line", "local_val", "WRAPPER_PREFIX", "strip_wrapper",
           "LOGITS_META", "ancestors", "descendants"]

WRAPPER_PREFIX = "model."
"""Tracing wraps the model with its loss; module paths start with this prefix in the graph."""

LOGITS_META = "autopar_logits"
"""``node.meta`` key (value True) of the value ``output_fn`` returned: the logits. Set at tracing; the
passes copy a node's meta with it, so the last chunk's evaluation graph finds the logits by it."""


@dataclass
class TracedModel:
    """The traced graph and how its placeholders relate to the user's model."""

    gm: fx.GraphModule
    """ATen training-IR graph; placeholders: parameters, buffers, constants, inputs, targets."""
    param_of: dict[str, str]
    """Placeholder name -> parameter name in the user's model (canonical, first name)."""
    buffer_of: dict[str, str]
    """Placeholder name -> buffer name in the user's model."""
    constant_of: dict[str, str]
    """Placeholder name -> lifted constant name (in ``constants``)."""
    input_names: list[str]
    """Placeholders fed by the model inputs, in order."""
    target_names: list[str]
    """Placeholders fed by the loss targets, in order."""
    constants: dict[str, torch.Tensor]
    """Lifted tensor constants (values)."""
    aliases: dict[str, list[str]] = field(default_factory=dict)
    """Canonical parameter name -> every name it has in the model (tied weights)."""
    model_name: str = "model"
    logits: str | None = None
    """The traced node of the value ``output_fn`` returned (marked ``meta[LOGITS_META]``); None when it
    returned no tensor."""
    stacked: dict[str, tuple[str, ...]] = field(default_factory=dict)
    """A parameter the compiler made by stacking a list of identical expert modules
    (``passes/expert_lists.py``) -> the model's parameters it stacks, one per expert, in order."""
    stamping: Any = None
    """How the trace was made from a short one (``compiler/layer_stamping.Stamping``), None when every
    block was traced."""

    def placeholders(self) -> list[fx.Node]:
        return [n for n in self.gm.graph.nodes if n.op == "placeholder"]




def strip_wrapper(name: str) -> str:
    """A name in the traced wrapper as the user's model names it."""
    return name[len(WRAPPER_PREFIX) :] if name.startswith(WRAPPER_PREFIX) else name


def module_path(node: fx.Node) -> str:
    """The innermost module a node was traced in (``h.0.attn.c_attn``), '' for the top."""
    stack = node.meta.get("nn_module_stack") or {}
    if not stack:
        return ""
    return user_path(list(stack.values())[-1][0])


def user_path(path: str) -> str:
    """A module path of the traced wrapper as the user's model names it ('' for the model)."""
    path = re.sub(r"^L\['self'\]\.?", "", path)
    return strip_wrapper(path) if path != "model" else ""


def source_line(node: fx.Node) -> str:
    """The model's source line for a node (``modeling_llama.py:244 q = self.q_proj(x)...``), or ''.

    The innermost frame of the node's stack trace in a file that defines one of
    the modules the node was traced in: the model's own code, where the user
    wrote the call, not torch's ``nn.Linear.forward`` nor a library helper the
    model calls. A node outside the model's modules (the loss function) gets
    the innermost frame outside torch and autopar's tracing wrapper.
    """
    frames = re.findall(r'File "([^"]+)", line (\d+), in \S+\n\s*(.*)', node.meta.get("stack_trace") or "")
    model_files = _model_files(node)
    chosen = next((f for f in reversed(frames) if os.path.realpath(f[0]) in model_files), None)
    if chosen is None:
        chosen = next((f for f in reversed(frames) if not _is_library_file(f[0])), None)
    if chosen is None:
        return ""
    file, line, code = chosen
    return f"{file.rsplit('/', 1)[-1]}:{line} {code.strip()}"


_TORCH_DIR = os.path.dirname(os.path.realpath(torch.__file__)) + os.sep
_TRACE_WRAPPER = "autopar.compiler.trace"
"""The module of the wrapper that traces the model with its loss: its frames are autopar's, not the user's."""


def _model_files(node: fx.Node) -> set[str]:
    """The source files of the classes of the modules ``node`` was traced in, torch's own and the
    tracing wrapper's left out."""
    files = set()
    for _, cls in (node.meta.get("nn_module_stack") or {}).values():
        qualname = cls if isinstance(cls, str) else f"{cls.__module__}.{cls.__qualname__}"
        module = _defining_module(qualname)
        file = getattr(module, "__file__", None)
        if file and module.__name__ != _TRACE_WRAPPER and not _is_library_file(file):
            files.add(os.path.realpath(file))
    return files


def _defining_module(qualname: str):
    """The loaded module a class's qualified name (``pkg.mod.Outer.Inner``) lives in, or None."""
    parts = qualname.split(".")
    for end in range(len(parts) - 1, 0, -1):
        module = sys.modules.get(".".join(parts[:end]))
        if module is not None:
            return module
    return None


_TRACING_FILES = tuple(os.path.join("autopar", "compiler", name)
                       for name in ("trace.py", "custom_functions.py", "static_shapes.py", "trace_error.py"))
"""autopar's tracing code (``compiler/trace_error.py``'s ``TRACING_FILES``; core cannot import it)."""


def _is_library_file(file: str) -> bool:
    """A file of torch itself or of autopar's tracing code: never the line a user wants to see."""
    path = os.path.realpath(file)
    return path.startswith(_TORCH_DIR) or path.endswith(_TRACING_FILES)


def ancestors(roots) -> set[fx.Node]:
    """Every node that ``roots`` (nodes, or other values, which are skipped) read, directly or not,
    the roots included."""
    return _closure(roots, lambda n: n.all_input_nodes)


def descendants(roots) -> set[fx.Node]:
    """Every node that reads ``roots`` (nodes, or other values, which are skipped), directly or not,
    the roots included."""
    return _closure(roots, lambda n: n.users)


def _closure(roots, step) -> set[fx.Node]:
    seen: set[fx.Node] = set()
    todo = [r for r in roots if isinstance(r, fx.Node)]
    while todo:
        n = todo.pop()
        if n not in seen:
            seen.add(n)
            todo.extend(step(n))
    return seen


def local_val(node: fx.Node):
    """One rank's value of a node of a rank graph (``meta["local_val"]``), or the traced value."""
    return node.meta.get("local_val", node.meta.get("val"))
