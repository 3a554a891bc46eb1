"""Graph vocabulary shared by every floor: the traced model and where a node came from.

``TracedModel`` is what tracing produces and every pass reads: the fx graph
and how its placeholders map to the user's parameters, buffers and inputs.
``module_path`` / ``source_line`` locate a node in the user's model for
error messages and the plan summary.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

import torch
import torch.fx as fx

__all__ = ["TracedModel", "module_path", "user_path", "source_line", "local_val", "WRAPPER_PREFIX", "strip_wrapper"]

WRAPPER_PREFIX = "model."
"""Tracing wraps the model with its loss; module paths start with this prefix in the graph."""


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
    """The user's source line for a node (``models.py:93 q = self.q(x)...``), or ''."""
    trace_text = node.meta.get("stack_trace") or ""
    frames = re.findall(r'File "([^"]+)", line (\d+), in \w+\n\s*(.*)', trace_text)
    frames = [f for f in frames if "autopar/compiler/trace.py" not in f[0]]
    if not frames:
        return ""
    file, line, code = frames[-1]
    return f"{file.rsplit('/', 1)[-1]}:{line} {code.strip()}"



def local_val(node: fx.Node):
    """One rank's value of a node of a rank graph (``meta["local_val"]``), or the traced value."""
    return node.meta.get("local_val", node.meta.get("val"))
