"""Trace ``(inputs, targets) -> loss`` of a model and its loss into an fx graph.

The traced function is the model followed by the user's loss function, so the
loss (and its vocabulary-parallel rewrite) is part of the graph. We use
``torch.export.export(strict=False)``: it works on unmodified HuggingFace models
where ``torch.fx.symbolic_trace`` does not, and every node comes with

- ``meta["val"]``             a FakeTensor: global shape and dtype,
- ``meta["nn_module_stack"]`` the module path (``h.3.attn.c_attn``),
- ``meta["stack_trace"]``     the user's source line.

Parameters are lifted to placeholders; ``TracedModel.param_of`` maps each one
to the parameter's name in the user's model. The batch tensors are passed by
name, the forward's and the loss's parameter names (``input_ids``,
``target``; ``compiler/signatures.py``, which also checks both signatures
first). Shapes are static: the example microbatch fixes batch size and
sequence length, as in Megatron.

The value ``output_fn`` returns (a tensor) passes through the identity op
``autopar::logits`` during the export, so that its node can be found and
marked (``meta[LOGITS_META]``, for the evaluation graph); the marker is
removed right after. A failed export is re-raised as ``TraceError`` with the
user's line and what to try.

Right after the export, before any pass, two things are settled in modules of
their own: a custom ``torch.autograd.Function`` (whose backward export drops)
stays its forward's ops where its backward is their gradient, and is otherwise
traced again as one op with its own backward (``autopar::function``;
``custom_functions.py``); an op whose output size depends on tensor values
(nonzero, boolean indexing, unique, ``.item()``) is refused with its line
(``static_shapes.py``). ``TraceError`` itself is in ``trace_error.py``,
re-exported here.
"""

from __future__ import annotations

import traceback
from collections.abc import Callable
from typing import Any

import torch
import torch.fx as fx
import torch.nn as nn
import torch.nn.functional as F
from torch.export.graph_signature import InputKind, OutputKind

from autopar.compiler.custom_functions import FunctionCalls, functions_kept_whole
from autopar.compiler.layer_stamping import stamped_trace
from autopar.compiler.signatures import batch_names, call_errors
from autopar.compiler.static_shapes import check_static_shapes
from autopar.compiler.trace_error import TraceError, is_tracing_file
from autopar.core.graph import LOGITS_META, TracedModel, strip_wrapper

__all__ = ["TraceError", "trace", "default_logits", "lm_cross_entropy"]


def default_logits(output: Any) -> torch.Tensor:
    """Pick the logits out of a model's output.

    A tensor is the logits; an object or dict with ``logits`` (HuggingFace
    outputs) gives that; otherwise the first tensor of a tuple/list/dict.
    """
    if isinstance(output, torch.Tensor):
        return output
    logits = getattr(output, "logits", None)
    if isinstance(logits, torch.Tensor):
        return logits
    if isinstance(output, dict):
        if isinstance(output.get("logits"), torch.Tensor):
            return output["logits"]
        output = list(output.values())
    if isinstance(output, (tuple, list)):
        for item in output:
            if isinstance(item, torch.Tensor):
                return item
    raise TraceError(
        f"cannot find the logits in the model's output of type {type(output).__name__}; "
        "pass output_fn=lambda out: <the logits tensor> to parallelize()"
    )


def lm_cross_entropy(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Language-model loss: cross-entropy over the last dim of (..., V) logits."""
    return F.cross_entropy(logits.flatten(0, -2), targets.flatten())


class _LossWrapper(nn.Module):
    """``(**batch) -> loss_fn(output_fn(model(*inputs)), *targets)``, the batch tensors passed by
    name so that the graph's placeholders carry them (``input_ids``, ``target``)."""

    def __init__(self, model: nn.Module, loss_fn: Callable, output_fn: Callable, input_names: list[str],
                 target_names: list[str]):
        super().__init__()
        self.model = model
        self.loss_fn = loss_fn
        self.output_fn = output_fn
        self.input_names, self.target_names = input_names, target_names

    def forward(self, **batch):
        logits = _marked(self.output_fn(self.model(*(batch[n] for n in self.input_names))))
        return self.loss_fn(logits, *(batch[n] for n in self.target_names))


def _marked(value: Any) -> Any:
    """``output_fn``'s value with its logits marked for the evaluation graph (``_unmark_logits``): a tensor
    itself; in a named tuple, tuple or dict (the logits beside an auxiliary loss, for a ``loss_fn`` that
    reads both) the tensor ``default_logits`` picks, the rest as it was. Anything else is left unmarked."""
    if isinstance(value, torch.Tensor):
        return _logits_marker(value)
    named = isinstance(value, tuple) and hasattr(value, "_fields")
    if not (named or type(value) in (tuple, list, dict)):
        return value
    try:
        logits = default_logits(value)
    except TraceError:
        return value
    if named:
        field = next(f for f in value._fields if getattr(value, f) is logits)
        return value._replace(**{field: _logits_marker(logits)})
    if isinstance(value, dict):
        return {k: _logits_marker(v) if v is logits else v for k, v in value.items()}
    return type(value)(_logits_marker(v) if v is logits else v for v in value)


@torch.library.custom_op("autopar::logits", mutates_args=())
def _logits_marker(x: torch.Tensor) -> torch.Tensor:
    """The identity, as an op of its own: the node of ``output_fn``'s value in the exported graph.
    ``_unmark_logits`` removes it right after the export, so no pass ever sees it."""
    return x.clone()


@_logits_marker.register_fake
def _(x: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(x)


_logits_marker.register_autograd(lambda ctx, grad: grad)


def _unmark_logits(gm: fx.GraphModule) -> str | None:
    """Remove the logits marker; its input (the value ``output_fn`` returned) gets ``meta[LOGITS_META]``.
    Returns that node's name (None when ``output_fn`` returned no tensor)."""
    name = None
    for node in list(gm.graph.nodes):
        if node.op == "call_function" and node.target is torch.ops.autopar.logits.default:
            value = node.args[0]
            value.meta[LOGITS_META] = True
            name = value.name
            node.replace_all_uses_with(value)
            gm.graph.erase_node(node)
    gm.recompile()
    return name



def _to_tuple(x: Any) -> tuple:
    if x is None:
        return ()
    return tuple(x) if isinstance(x, (tuple, list)) else (x,)


def trace(
    model: nn.Module,
    example_inputs: Any,
    example_targets: Any,
    loss_fn: Callable,
    output_fn: Callable | None = None,
) -> TracedModel:
    """Trace ``loss_fn(output_fn(model(*example_inputs)), *example_targets)``.

    Works with parameters on the ``meta`` device (the example tensors are then
    moved to meta too), so large models can be compiled without memory. A deep stack of identical
    blocks is traced from four of them and the rest stamped (``layer_stamping.py``).
    """
    def whole(m: nn.Module) -> TracedModel:
        return _trace_whole(m, example_inputs, example_targets, loss_fn, output_fn)

    stamped = stamped_trace(model, whole)
    if stamped is None:
        return whole(model)
    result, result.stamping = stamped
    result.aliases = _aliases(model)
    return result


def _trace_whole(model: nn.Module, example_inputs: Any, example_targets: Any, loss_fn: Callable,
                 output_fn: Callable | None) -> TracedModel:
    """``trace`` with every block of the model traced."""
    inputs, targets = _example_tensors(model, example_inputs, example_targets)
    errors = call_errors(model, loss_fn, len(inputs), len(targets), default_loss=loss_fn is lm_cross_entropy)
    if errors:
        raise TraceError("\n".join(errors))
    input_names, target_names = batch_names(model, loss_fn, len(inputs), len(targets))
    wrapper = _LossWrapper(model, loss_fn, output_fn or default_logits, input_names, target_names)
    batch = dict(zip(input_names + target_names, inputs + targets, strict=True))
    functions = FunctionCalls()
    ep = _export(model, wrapper, batch, functions)
    whole = functions_kept_whole(functions.calls)
    if whole:  # traced again, those Functions as one op each with their own backward
        ep = _export(model, wrapper, batch, FunctionCalls(route=whole))
    check_static_shapes(model, ep.graph_module)
    logits = _unmark_logits(ep.graph_module)
    param_of, buffer_of, constant_of, user = _placeholders(ep)
    _check_outputs(ep)
    aliases = _aliases(model)
    gm = _canonical_params(ep.graph_module, param_of, aliases)
    return TracedModel(
        gm=gm,
        param_of=param_of,
        buffer_of=buffer_of,
        constant_of=constant_of,
        input_names=user[: len(inputs)],
        target_names=user[len(inputs) :],  # the names chosen above, as the graph spells them
        constants={k: v for k, v in ep.constants.items() if isinstance(v, torch.Tensor)},
        aliases=aliases,
        model_name=type(model).__name__,
        logits=logits,
    )


def _example_tensors(model: nn.Module, example_inputs: Any, example_targets: Any) -> tuple[tuple, tuple]:
    """The example microbatch as tensors: checked, kept apart, on meta for a meta model."""
    inputs, targets = _to_tuple(example_inputs), _to_tuple(example_targets)
    for i, x in enumerate(inputs + targets):
        if not isinstance(x, torch.Tensor):
            raise TraceError(
                f"example input/target #{i} is a {type(x).__name__}, not a tensor; "
                "pass tensors (use a lambda in loss_fn/output_fn for other arguments)"
            )
    # the same tensor passed twice would become one graph input: keep them apart
    ids = {id(x) for x in inputs}
    targets = tuple(t.clone() if id(t) in ids else t for t in targets)
    if any(p.is_meta for p in model.parameters()):
        inputs = tuple(x.to("meta") for x in inputs)
        targets = tuple(x.to("meta") for x in targets)
    return inputs, targets


def _export(model: nn.Module, wrapper: nn.Module, batch: dict[str, torch.Tensor],
            functions: FunctionCalls) -> torch.export.ExportedProgram:
    """``torch.export`` (non-strict) in training mode, the batch by name, every ``autograd.Function``
    call recorded in ``functions``; a failure names the user's line."""
    was_training = model.training
    model.train()
    try:
        with functions:
            return torch.export.export(wrapper, (), kwargs=batch, strict=False)
    except TraceError:
        raise
    except Exception as e:  # noqa: BLE001 - re-raised with the user's line
        raise TraceError(_explain_trace_failure(model, e)) from e
    finally:
        model.train(was_training)


def _placeholders(ep: torch.export.ExportedProgram) -> tuple[dict, dict, dict, list]:
    """(parameter, buffer, constant) placeholder -> name maps, and the user inputs in order."""
    param_of, buffer_of, constant_of, user = {}, {}, {}, []
    for spec in ep.graph_signature.input_specs:
        name = spec.arg.name
        if spec.kind == InputKind.PARAMETER:
            param_of[name] = strip_wrapper(spec.target)
        elif spec.kind == InputKind.BUFFER:
            buffer_of[name] = strip_wrapper(spec.target)
        elif spec.kind == InputKind.CONSTANT_TENSOR:
            constant_of[name] = spec.target
        elif spec.kind == InputKind.USER_INPUT:
            user.append(name)
        else:
            raise TraceError(f"unsupported graph input {name} of kind {spec.kind.name}")
    return param_of, buffer_of, constant_of, user


def _check_outputs(ep: torch.export.ExportedProgram) -> None:
    """One scalar loss, and no state mutated by the forward."""
    for spec in ep.graph_signature.output_specs:
        if spec.kind != OutputKind.USER_OUTPUT:
            raise TraceError(
                f"the model mutates state during the forward ({spec.kind.name} of {spec.target}); "
                "autopar needs a functional forward: remove in-place updates of buffers "
                "(e.g. BatchNorm running statistics) or put the model in a form without them"
            )
    out = [n for n in ep.graph_module.graph.nodes if n.op == "output"][0]
    if len(out.args[0]) != 1 or tuple(out.args[0][0].meta["val"].shape) != ():
        shapes = [tuple(a.meta["val"].shape) for a in out.args[0]]
        raise TraceError(
            f"loss_fn must return one scalar loss; it returned {len(shapes)} value(s) of shapes {shapes}"
        )


def _aliases(model: nn.Module) -> dict[str, list[str]]:
    """Canonical parameter name -> every name it has in the model (tied weights share one)."""
    by_id: dict[int, list[str]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        by_id.setdefault(id(p), []).append(name)
    return {name: by_id[id(p)] for name, p in model.named_parameters()}


def _canonical_params(gm: fx.GraphModule, param_of: dict[str, str], aliases: dict[str, list[str]]) -> fx.GraphModule:
    """Tied weights: every placeholder is named by the parameter's first name in the model;
    a placeholder left without users by the tie is dropped (``param_of`` updated in place)."""
    canonical = {alias: names[0] for names in aliases.values() for alias in names}
    for node in list(gm.graph.nodes):
        if node.name in param_of:
            param_of[node.name] = canonical.get(param_of[node.name], param_of[node.name])
            if not node.users:
                del param_of[node.name]
                gm.graph.erase_node(node)
    gm.recompile()
    return gm


def _explain_trace_failure(model: nn.Module, err: Exception) -> str:
    """The failure, the user's line it happened at (not torch's, nor code generated at run time such
    as ``<string>``) and what to try for that kind of failure."""
    frames = traceback.extract_tb(err.__traceback__)
    user = [f for f in frames if "/torch/" not in f.filename and not f.filename.startswith("<")
            and not is_tracing_file(f.filename)]
    where = f"{user[-1].filename}:{user[-1].lineno}: {user[-1].line}" if user else "(no line of the model's code)"
    text = str(err).strip().splitlines()
    first = text[0] if text else type(err).__name__
    return (
        f"could not trace {type(model).__name__} with its loss: {type(err).__name__}: {first}\n"
        f"  at {where}\n  try: {_hint(err)}"
    )


def _hint(err: Exception) -> str:
    """What to try, by the kind of failure."""
    if "data-dependent" in str(err) or "DataDependent" in type(err).__name__:
        return ("control flow that depends on tensor values (if x.sum() > 0, .item(), .tolist(), "
                "data-dependent shapes) cannot be traced: compute it with torch.where / masks, or "
                "move it out of forward")
    if isinstance(err, TypeError):
        return ("a call got arguments it does not take: the model is called as model(*example_inputs) and "
                "the loss as loss_fn(output_fn(output), *example_targets); a model that needs extra "
                "non-tensor arguments can be wrapped in a small nn.Module whose forward takes only tensors")
    return ("autopar traces the forward with torch.export(strict=False) on fake tensors: the line above must "
            "run without real data (no .numpy(), no reading tensor values); a model that needs extra "
            "non-tensor arguments can be wrapped in a small nn.Module whose forward takes only tensors")
