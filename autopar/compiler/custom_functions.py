"""Custom ``torch.autograd.Function`` calls: kept as their forward's ops, or as one op with their own backward.

torch.export (non-strict, training IR) records the ops a Function's forward
runs and drops the Function itself: the graph would then train with plain
autograd through those ops, not with the Function's backward. So every
``Function.apply`` during the export (wherever it is called: model, helpers,
loss) is recorded (``FunctionCalls``). After it, each distinct call is run
again on random inputs of its traced shapes, once through ``apply`` and
backward, once as autograd of its forward (``functions_kept_whole``). Where
the two gradients agree (relative gap at most 1e-3 in fp32, 3e-2 in the half
types: a Function that only computes its forward's gradient by hand, such as
an approximated GELU), the traced ops train with the Function's gradient and
the sharding rules see them. Every other Function (a straight-through
estimator differs by 100%) is traced again as one op, ``autopar::function``,
whose backward is the Function's own: its forward runs again in the
backward, on the saved inputs, to build the Function's own context.

A Function that cannot be one op is refused with ``TraceError``, naming its
class, where it is defined, the line that called it and what to do instead:
its tensors come inside a list or dict, it returns anything but tensors, or
its forward reads a parameter it is not passed (reentrant
``torch.utils.checkpoint``: the op would read the user's module, not the
rank's shard, and give the parameter no gradient).

``trace.py`` runs the export within ``FunctionCalls``. The op is registered
here, once, when this module is imported (``trace.py`` imports it).
"""

from __future__ import annotations

import traceback
from collections.abc import Callable
from typing import Any

import torch
import torch.nn as nn

from autopar.compiler.static_shapes import holds_tensor
from autopar.compiler.trace_error import TraceError, is_tracing_file

__all__ = ["FunctionCalls", "functions_kept_whole"]


# --- the calls recorded during the export, and the gradient check -----------------------------

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


class FunctionCalls:
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
    """A Function of torch's own internals (``torch._library``'s for a custom op's registered autograd,
    ``torch._higher_order_ops``' behind ``cond`` or flex attention, ...): the op stays one node of
    the graph with its backward, nothing of it is inlined. Public torch Functions (reentrant
    ``torch.utils.checkpoint``) are checked like the model's own."""
    return cls.__module__.startswith("torch._")


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


def functions_kept_whole(calls: list[_FunctionCall]) -> frozenset[type]:
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
