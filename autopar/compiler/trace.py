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

Right after the export, before any pass: a custom ``torch.autograd.Function``
(whose backward export drops) stays its forward's ops where its backward is
their gradient, and is otherwise traced again as one op with its own backward
(``autopar::function``); an op whose output size depends on tensor values
(nonzero, boolean indexing, unique, ``.item()``) is refused with its line
(``static_shapes.py``).
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

from autopar.compiler.signatures import batch_names, call_errors
from autopar.compiler.static_shapes import check_static_shapes, holds_tensor
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
        logits = self.output_fn(self.model(*(batch[n] for n in self.input_names)))
        if isinstance(logits, torch.Tensor):  # marked for the evaluation graph (``_unmark_logits``)
            logits = _logits_marker(logits)
        return self.loss_fn(logits, *(batch[n] for n in self.target_names))


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
    moved to meta too), so large models can be compiled without memory.
    """
    inputs, targets = _example_tensors(model, example_inputs, example_targets)
    errors = call_errors(model, loss_fn, len(inputs), len(targets), default_loss=loss_fn is lm_cross_entropy)
    if errors:
        raise TraceError("\n".join(errors))
    input_names, target_names = batch_names(model, loss_fn, len(inputs), len(targets))
    wrapper = _LossWrapper(model, loss_fn, output_fn or default_logits, input_names, target_names)
    batch = dict(zip(input_names + target_names, inputs + targets, strict=True))
    functions = _FunctionCalls()
    ep = _export(model, wrapper, batch, functions)
    whole = _functions_kept_whole(functions.calls)
    if whole:  # traced again, those Functions as one op each with their own backward
        ep = _export(model, wrapper, batch, _FunctionCalls(route=whole))
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
            functions: _FunctionCalls) -> torch.export.ExportedProgram:
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


# --- custom autograd.Functions ------------------------------------------------------------------
#
# torch.export (non-strict, training IR) records the ops a ``torch.autograd.Function``'s forward
# runs and drops the Function itself: the graph then trains with plain autograd through those ops,
# not with the Function's backward. Every ``Function.apply`` during the export is recorded here;
# after it, each distinct call is run again on random inputs of its traced shapes, once through
# ``apply`` and backward, once as autograd of its forward. Where the two gradients agree (a
# Function that only computes its forward's gradient by hand, such as an approximated GELU), the
# traced ops train with the Function's gradient and the sharding rules see them. Every other
# Function is traced again as one op, ``autopar::function``, whose backward is the Function's own.

_FUNCTION_SEEDS = (0, 1)
"""The random draws each Function is checked on; the second at a wider scale (``_FUNCTION_SCALES``)."""
_FUNCTION_SCALES = (1.0, 4.0)
_FUNCTION_RTOL = {torch.float16: 3e-2, torch.bfloat16: 3e-2}
"""Largest relative gap (||g_function - g_autograd|| / ||g||) by dtype: 1e-3 for fp32 and fp64
(a hand-written derivative reorders rounding only), 3e-2 for the half types (8-11 bits of mantissa).
A Function whose backward is not its forward's gradient differs by order 1 (a straight-through
estimator: 100%)."""
_FUNCTION_RTOL_DEFAULT = 1e-3


class _TensorArg:
    """A tensor argument of a recorded call: shape and dtype, to draw a real one of."""

    def __init__(self, t: torch.Tensor):
        self.shape = tuple(t.shape)
        self.dtype = t.dtype

    def key(self) -> tuple:
        return (self.shape, self.dtype)


class _FunctionCall:
    """One ``Function.apply`` seen during the export: the class, its arguments, the user's line."""

    def __init__(self, cls: type, args: tuple, kwargs: dict, site: str):
        self.cls, self.site = cls, site
        self.nested = any(holds_tensor(a) and not isinstance(a, torch.Tensor) for a in (*args, *kwargs.values()))
        self.args = tuple(_TensorArg(a) if isinstance(a, torch.Tensor) else a for a in args)
        self.kwargs = {k: _TensorArg(v) if isinstance(v, torch.Tensor) else v for k, v in kwargs.items()}

    def key(self) -> tuple:
        def k(a):
            return ("T", *a.key()) if isinstance(a, _TensorArg) else repr(a)[:200]
        return (self.cls, tuple(k(a) for a in self.args), tuple((n, k(a)) for n, a in sorted(self.kwargs.items())))


class _FunctionCalls:
    """Within ``with``: every ``torch.autograd.Function.apply`` (the class method every subclass
    inherits, also reached by ``super().apply`` from an override) recorded in ``calls``, then run
    as usual; or, for the classes in ``route``, called as the op ``autopar::function``."""

    def __init__(self, route: frozenset[type] = frozenset()):
        self.calls: list[_FunctionCall] = []
        self.route = route
        self._saved = None

    def __enter__(self):
        base = torch.autograd.Function
        self._saved = base.__dict__["apply"]
        original = self._saved.__func__
        calls, route = self.calls, self.route

        def apply(cls, *args, **kwargs):
            if cls in route:
                return _routed_call(cls, args, kwargs, _caller_line())
            if not _is_custom_op_autograd(cls):
                calls.append(_FunctionCall(cls, args, kwargs, _caller_line()))
            return original(cls, *args, **kwargs)

        base.apply = classmethod(apply)
        return self

    def __exit__(self, *exc) -> None:
        torch.autograd.Function.apply = self._saved


def _is_custom_op_autograd(cls: type) -> bool:
    """The Function ``torch.library`` makes for a custom op's registered autograd: the op stays one
    node of the graph with that backward, nothing of it is inlined."""
    return cls.__module__.startswith("torch._library")


def _caller_line() -> str:
    """The innermost frame of the stack outside torch and tracing's files: the line that called ``apply``."""
    torch_dir = torch.__file__.rsplit("/", 1)[0] + "/"
    for frame in reversed(traceback.extract_stack()[:-2]):
        if not frame.filename.startswith(torch_dir) and not frame.filename.startswith("<") \
                and not is_tracing_file(frame.filename):
            return f"{frame.filename}:{frame.lineno}: {(frame.line or '').strip()}"
    return "(no line outside torch)"


def _defined_at(cls: type) -> str:
    """``file:line`` of a class's definition (of its forward where the source cannot be read)."""
    import inspect

    try:
        return f"{inspect.getsourcefile(cls)}:{inspect.getsourcelines(cls)[1]}"
    except (OSError, TypeError):
        code = getattr(cls.forward, "__code__", None)
        return f"{code.co_filename}:{code.co_firstlineno}" if code else "(source not found)"


def _functions_kept_whole(calls: list[_FunctionCall]) -> frozenset[type]:
    """The Functions whose backward is not (or could not be shown to be) the autograd gradient of
    the ops the graph recorded: each is traced again as one op with its own backward."""
    seen, whole = set(), set()
    for call in calls:
        key = call.key()
        if key in seen or call.cls in whole:
            continue
        seen.add(key)
        if call.nested:  # tensors inside a list or dict: not compared here, kept whole (and refused there)
            whole.add(call.cls)
            continue
        try:
            gap, dtype = _function_gradient_gap(call)
        except Exception:  # noqa: BLE001 - the Function's code failed on random inputs: kept whole
            whole.add(call.cls)
            continue
        if gap > _FUNCTION_RTOL.get(dtype, _FUNCTION_RTOL_DEFAULT):
            whole.add(call.cls)
    return frozenset(whole)


def _function_refusal(cls: type, site: str, why: str) -> str:
    name = f"{cls.__module__}.{cls.__qualname__}"
    return (
        f"cannot trace the custom torch.autograd.Function {name} (defined at {_defined_at(cls)})\n"
        f"  at {site}\n"
        "  torch.export would keep its forward's ops and drop its backward, so autopar makes a Function whose "
        "backward is not shown to be its forward's gradient one op with its own backward; this one cannot be "
        f"an op: {why}.\n"
        "  try: pass its tensors as separate arguments and return tensors only; or write the forward so that "
        "autograd gives the intended gradient, e.g. a straight-through estimator as x + (f(x) - x).detach() "
        "(forward f(x), gradient 1), and drop the Function"
    )


# --- a Function as one op ---------------------------------------------------------------------

_ORIGINAL_APPLY = torch.autograd.Function.__dict__["apply"].__func__
"""``Function.apply`` itself, called by the op (never the recording one)."""


class _Slot:
    """The place of a tensor argument in a Function's arguments: the op's ``tensors[index]``."""

    def __init__(self, index: int):
        self.index = index

    def __repr__(self) -> str:
        return f"tensors[{self.index}]"


_ROUTED: dict[str, tuple[type, tuple, dict, str]] = {}
"""The op's ``key`` -> (Function class, arguments with tensors as ``_Slot``, keyword arguments,
the line that called it): what a node of ``autopar::function`` calls, in this process."""
_ROUTED_KEYS: dict[tuple, str] = {}


def _routed_call(cls: type, args: tuple, kwargs: dict, site: str):
    """``cls.apply(*args, **kwargs)`` as the op ``autopar::function``: the tensors passed as a list,
    everything else kept under a key; its value as ``apply`` returns it (a tensor or a tuple)."""
    tensors: list[torch.Tensor] = []

    def slot(a):
        if isinstance(a, torch.Tensor):
            tensors.append(a)
            return _Slot(len(tensors) - 1)
        if holds_tensor(a):
            raise TraceError(_function_refusal(cls, site, f"an argument is a {type(a).__name__} of tensors "
                                                           "(an op takes tensors and plain values)"))
        return a

    template = (tuple(slot(a) for a in args), {k: slot(v) for k, v in kwargs.items()})
    ident = (cls, repr(template), site)
    key = _ROUTED_KEYS.get(ident)
    if key is None:
        key = _ROUTED_KEYS[ident] = f"{cls.__module__}.{cls.__qualname__}#{len(_ROUTED_KEYS)}"
        _ROUTED[key] = (cls, *template, site)
    outs = torch.ops.autopar.function(tensors, key)
    return outs[0] if _ROUTED_SINGLE[key] else tuple(outs)


_ROUTED_SINGLE: dict[str, bool] = {}
"""Whether the Function under a key returns one tensor (else a tuple): learnt from its first call."""


def _apply_routed(key: str, tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """The Function under ``key`` applied to ``tensors`` in their places; its tensors as a list."""
    cls, args, kwargs, site = _ROUTED[key]
    out = _ORIGINAL_APPLY(cls, *(tensors[a.index] if isinstance(a, _Slot) else a for a in args),
                          **{k: tensors[v.index] if isinstance(v, _Slot) else v for k, v in kwargs.items()})
    single = isinstance(out, torch.Tensor)
    outs = [out] if single else list(out) if isinstance(out, (tuple, list)) else [out]
    if not all(isinstance(o, torch.Tensor) for o in outs):
        raise TraceError(_function_refusal(cls, site, "it returns " + ", ".join(type(o).__name__ for o in outs)
                                           + " (only tensors can be an op's outputs)"))
    _ROUTED_SINGLE.setdefault(key, single)
    return outs


@torch.library.custom_op("autopar::function", mutates_args=())
def _function_op(tensors: list[torch.Tensor], key: str) -> list[torch.Tensor]:
    """A custom autograd Function as one op: its forward here, its own backward in ``_function_backward``."""
    outs = _apply_routed(key, tensors)
    taken = {t.untyped_storage().data_ptr() for t in tensors}
    result = []
    for o in outs:  # an op's outputs are new tensors: one aliasing an input or another output is copied
        ptr = o.untyped_storage().data_ptr()
        result.append(o.clone() if ptr in taken else o)
        taken.add(ptr)
    return result


@_function_op.register_fake
def _(tensors: list[torch.Tensor], key: str) -> list[torch.Tensor]:
    with _ParameterReads(tensors) as reads:  # at trace time, on fake tensors
        outs = _apply_routed(key, tensors)
    if reads.found is not None:
        cls, _, _, site = _ROUTED[key]
        raise TraceError(_function_refusal(cls, site, reads.why()))
    return [torch.empty_like(o) for o in outs]


class _ParameterReads(torch.overrides.TorchFunctionMode):
    """Within ``with``: the first parameter a torch call reads that is not one of ``allowed`` (a
    Function's forward reading a module's weight from its closure: the Function gives it no
    gradient, and the op would read the user's module, not the rank's shard)."""

    def __init__(self, allowed: list[torch.Tensor]):
        super().__init__()
        self.allowed = {id(t) for t in allowed}
        self.found: torch.Tensor | None = None

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if self.found is None:
            for a in torch.utils._pytree.tree_leaves((args, kwargs)):
                if isinstance(a, nn.Parameter) and id(a) not in self.allowed:
                    self.found = a
                    break
        return func(*args, **kwargs)

    def why(self) -> str:
        return (f"its forward reads a parameter of shape {tuple(self.found.shape)} that is not one of its "
                "arguments (pass it to apply and return its gradient from backward; for "
                "torch.utils.checkpoint, use_reentrant=False or autopar's recompute=)")


def _function_setup(ctx, inputs, output) -> None:
    tensors, key = inputs
    ctx.key = key
    ctx.save_for_backward(*tensors)


def _function_backward(ctx, grads):
    """The Function's own backward: its forward run again on the saved inputs under autograd (so its
    ``ctx`` is its own), and autograd through it, which calls the Function's backward."""
    with torch.enable_grad():
        inputs = [t.detach().requires_grad_() if t.is_floating_point() or t.is_complex() else t
                  for t in ctx.saved_tensors]
        outs = _apply_routed(ctx.key, inputs)
        pairs = [(o, g) for o, g in zip(outs, grads, strict=True) if g is not None and o.requires_grad]
        wants = [t for t in inputs if t.requires_grad]
        got = (torch.autograd.grad([o for o, _ in pairs], wants, [g for _, g in pairs], allow_unused=True)
               if pairs and wants else [None] * len(wants))
    got = iter(got)
    return [next(got) if t.requires_grad else None for t in inputs], None


_function_op.register_autograd(_function_backward, setup_context=_function_setup)


def _function_gradient_gap(call: _FunctionCall) -> tuple[float, torch.dtype]:
    """The largest relative gap between the Function's gradients (``apply``, backward) and the
    autograd gradients of its forward, over its floating inputs and ``_FUNCTION_SEEDS``; and the
    dtype compared."""
    gap, dtype = 0.0, torch.float32
    for seed, scale in zip(_FUNCTION_SEEDS, _FUNCTION_SCALES, strict=True):
        gen = torch.Generator().manual_seed(seed)
        args = tuple(_draw(a, gen, scale) for a in call.args)
        kwargs = {k: _draw(v, gen, scale) for k, v in call.kwargs.items()}
        floats = [a for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor) and a.is_floating_point()]
        if not floats:
            return 0.0, dtype
        dtype = floats[0].dtype
        with torch.enable_grad():
            own = _grads(call.cls.apply, args, kwargs, floats)
            with _ParameterReads(floats) as reads:
                inlined = _grads(_forward_of(call.cls), args, kwargs, floats)
        if reads.found is not None:  # the traced ops would train a parameter the Function does not
            return 1.0, dtype
        for a, b in zip(own, inlined, strict=True):
            scale_ab = max(float(a.double().norm()), float(b.double().norm()), 1e-30)
            gap = max(gap, float((a.double() - b.double()).norm()) / scale_ab)
    return gap, dtype


def _draw(arg: Any, gen: torch.Generator, scale: float) -> Any:
    """A real tensor for a recorded tensor argument: floats normal (times ``scale``), integers zero
    (a valid index), booleans random; other arguments as recorded."""
    if not isinstance(arg, _TensorArg):
        return arg
    if arg.dtype.is_floating_point:
        return (torch.randn(arg.shape, generator=gen) * scale).to(arg.dtype)
    if arg.dtype == torch.bool:
        return torch.rand(arg.shape, generator=gen) < 0.5
    return torch.zeros(arg.shape, dtype=arg.dtype)


def _forward_of(cls: type) -> Callable:
    """The Function's forward as plain code: what the exported graph runs."""
    from torch.autograd.function import FunctionCtx, _is_setup_context_defined

    if _is_setup_context_defined(cls.setup_context):
        return cls.forward

    def forward(*args, **kwargs):
        ctx = FunctionCtx()
        ctx.needs_input_grad = tuple(isinstance(a, torch.Tensor) and a.requires_grad for a in args)
        return cls.forward(ctx, *args, **kwargs)

    return forward


def _grads(fn: Callable, args: tuple, kwargs: dict, floats: list[torch.Tensor]) -> list[torch.Tensor]:
    """Gradients of sum(output * g) for fixed random g, with respect to ``floats`` (copies of them
    taken by position in args and kwargs, so both runs start from the same values)."""
    fresh = {id(a): a.detach().clone().requires_grad_() for a in floats}
    args = tuple(fresh.get(id(a), a) for a in args)
    kwargs = {k: fresh.get(id(v), v) for k, v in kwargs.items()}
    inputs = [fresh[id(a)] for a in floats]
    out = fn(*args, **kwargs)
    outs = [o for o in (out if isinstance(out, (tuple, list)) else (out,)) if isinstance(o, torch.Tensor)]
    cotangent = torch.Generator().manual_seed(1234)
    pairs = [(o, torch.randn(o.shape, generator=cotangent).to(o.dtype)) for o in outs]
    pairs = [(o, g) for o, g in pairs if o.requires_grad and o.is_floating_point()]
    if not pairs:
        return [torch.zeros_like(a) for a in inputs]
    grads = torch.autograd.grad([o for o, _ in pairs], inputs, [g for _, g in pairs], allow_unused=True)
    return [torch.zeros_like(a) if g is None else g for a, g in zip(inputs, grads, strict=True)]
