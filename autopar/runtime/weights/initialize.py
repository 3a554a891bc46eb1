"""Weights of a meta-device model made by its own initialisation, one module at a time.

A model built under ``with torch.device("meta")`` costs no memory; its values
are made here by the model's own code (``module_init``: ``reset_parameters``,
HuggingFace's ``_init_weights``, or rebuilding a parameter-free module), one
module at a time, in ``named_modules()`` order: the module's own parameters
become fresh tensors (every other parameter of the model is on the meta
device meanwhile, so nothing else is touched), its initialisation runs, the
values asked for are handed to the caller, and the module goes back to the
meta device before the next one. A rank keeps its slices and frees the rest,
so its peak is its shards plus the largest module's own parameters.

Each module draws from the default generator seeded with
``module_seed(seed, path)``: a hash of a base seed and the module's path. So
the values do not depend on which rank makes them, in which order, or which
other modules it makes: any layout (tp, pp, dp, virtual stages) gets the same
full weights, and ``init_weights(model, seed)`` makes exactly them on one
device. They are different draws from ``torch.manual_seed(seed); Model()``
(one stream through the whole constructor) from the same distributions.

A value the initialisation leaves untouched (its version counter did not
move) is an error naming it: nothing would be silently left uninitialised.
"""

from __future__ import annotations

import contextlib
import hashlib
from collections.abc import Iterator

import torch
import torch.nn as nn

from autopar.runtime.weights.module_init import FIX, InitError, check_initialisable, init_steps, owner_path, rebuild

__all__ = ["init_weights", "initialise_modules", "module_seed", "params_on_meta", "InitError"]


def module_seed(seed: int, path: str) -> int:
    """The seed of the module at ``path``: the first 63 bits of sha256(``seed``, ``path``)."""
    digest = hashlib.sha256(f"{int(seed)}/{path}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & (2**63 - 1)


@contextlib.contextmanager
def _seeded(seed: int, device: torch.device):
    """The default generator of ``device`` (and the CPU's) seeded with ``seed``; restored after."""
    cuda = [device.index if device.index is not None else torch.cuda.current_device()] \
        if device.type == "cuda" else []
    with torch.random.fork_rng(devices=cuda):
        torch.random.default_generator.manual_seed(seed)
        for index in cuda:
            torch.cuda.default_generators[index].manual_seed(seed)
        yield


@contextlib.contextmanager
def params_on_meta(model: nn.Module):
    """Every real parameter of ``model`` replaced by a meta twin (tied ones by one twin), restored
    after: a module's initialisation then touches nothing but the module being made."""
    twins: dict[int, nn.Parameter] = {}
    saved = []
    for module in model.modules():
        for name, p in module._parameters.items():
            if p is None or p.is_meta:
                continue
            if id(p) not in twins:
                twins[id(p)] = nn.Parameter(torch.empty_like(p, device="meta"), requires_grad=p.requires_grad)
            saved.append((module, name, p))
            module._parameters[name] = twins[id(p)]
    try:
        yield
    finally:
        for module, name, p in saved:
            module._parameters[name] = p


def initialise_modules(model: nn.Module, seed: int, device: torch.device, params: set[str],
                       buffers: set[str]) -> Iterator[dict[str, torch.Tensor]]:
    """For each module owning one of ``params`` or ``buffers`` (full names; tied parameters by
    their first name), in ``named_modules()`` order: those of its values, made by its own
    initialisation on ``device``. Drop each before asking for the next to keep one module's
    values at a time. Check ``check_initialisable`` first."""
    wanted: dict[str, list[str]] = {}
    for name in list(params) + list(buffers):
        wanted.setdefault(owner_path(name), []).append(name)
    with params_on_meta(model):
        for path, module in model.named_modules():
            if path in wanted:
                yield _make_module(model, path, module, module_seed(seed, path), device,
                                   set(wanted[path]) & params, set(wanted[path]) & buffers)


def _make_module(model: nn.Module, path: str, module: nn.Module, seed: int, device: torch.device,
                 params: set[str], buffers: set[str]) -> dict[str, torch.Tensor]:
    """The module's ``params`` and ``buffers`` (full names), made by its initialisation on
    ``device``; the module is left as it was."""
    prefix = f"{path}." if path else ""
    wanted = params | buffers
    shapes = {prefix + n: tuple(t.shape) for n, t in _own(module) if t is not None}
    steps = init_steps(model, path)
    with _fresh(module, prefix, device) as fresh, _seeded(seed, device), torch.no_grad():
        versions = {name: t._version for name, t in fresh.items()}
        for _, step in steps:
            step()
        now = {prefix + n: t for n, t in _own(module)}
        untouched = [n for n in wanted if now[n] is fresh[n] and now[n]._version == versions[n]]
        now.update(_rebuilt_buffers(module, prefix, [n for n in untouched if n in buffers], device))
        untouched = [n for n in untouched if now[n] is fresh[n]]
        return _checked(path, module, [label for label, _ in steps], {n: now[n] for n in wanted}, shapes, untouched)


def _own(module: nn.Module) -> list[tuple[str, torch.Tensor | None]]:
    """The module's own parameters and buffers, by local name."""
    return list(module._parameters.items()) + list(module._buffers.items())


@contextlib.contextmanager
def _fresh(module: nn.Module, prefix: str, device: torch.device):
    """Inside: the module's own parameters and buffers replaced by new tensors on ``device`` (empty;
    a real buffer copied, so the model's stays untouched), yielded by full name; restored after."""
    saved_params, saved_buffers = dict(module._parameters), dict(module._buffers)
    fresh: dict[str, torch.Tensor] = {}
    try:
        for name, p in saved_params.items():
            if p is not None:
                fresh[prefix + name] = module._parameters[name] = nn.Parameter(
                    torch.empty(p.shape, dtype=p.dtype, device=device), requires_grad=p.requires_grad)
        for name, b in saved_buffers.items():
            if b is not None:
                fresh[prefix + name] = module._buffers[name] = \
                    torch.empty(b.shape, dtype=b.dtype, device=device) if b.is_meta else b.to(device, copy=True)
        yield fresh
    finally:
        module._parameters.update(saved_params)
        module._buffers.update(saved_buffers)


def _rebuilt_buffers(module: nn.Module, prefix: str, names: list[str], device: torch.device) -> dict:
    """Buffers the initialisation left untouched, taken from the module built again (rule 3)."""
    if not names:
        return {}
    twin = rebuild(module, device)
    if twin is None:
        return {}
    return {n: twin._buffers[n[len(prefix):]] for n in names if twin._buffers.get(n[len(prefix):]) is not None}


def _checked(path: str, module: nn.Module, ran: list[str], made: dict[str, torch.Tensor],
             shapes: dict[str, tuple[int, ...]], untouched: list[str]) -> dict[str, torch.Tensor]:
    """``made`` (detached), or an ``InitError`` naming a value nothing made or one of another shape."""
    where = f"module '{path or '(the model)'}' ({type(module).__name__})"
    if untouched:
        raise InitError(f"{where}: its initialisation ({', '.join(ran) or 'nothing'}) left {sorted(untouched)} "
                        f"unset, and a buffer is rebuilt only by a module without parameters that kept its "
                        f"constructor's arguments as attributes. Fix: set them in the module's "
                        f"reset_parameters(), or {FIX}")
    for name, value in made.items():
        if tuple(value.shape) != shapes[name]:
            raise InitError(f"{where}: its initialisation made '{name}' of shape {tuple(value.shape)}, but the "
                            f"model has {shapes[name]}. Fix: {FIX}")
    return {name: value.detach() for name, value in made.items()}


def init_weights(model: nn.Module, seed: int, device: torch.device | str = "cpu",
                 buffers: dict[str, torch.Tensor] | None = None) -> nn.Module:
    """Give ``model`` (on the meta device, or real) the full weights that ``materialize`` of any
    layout makes for it with the same ``seed``, on one device; returns the model.

    Every parameter is made by its module's own initialisation seeded by
    ``module_seed(seed, path)``; a buffer on the meta device too (a real one is
    kept, moved to ``device``), unless ``buffers`` gives it. Parameters are
    replaced by new ones (tied ones stay tied): build the optimizer after.
    Bitwise equal to a rank's weights made on the same kind of device (a GPU's
    generator draws differently from the CPU's).
    """
    device = torch.device(device)
    buffers = dict(buffers or {})
    params = {name for name, _ in model.named_parameters()}
    wanted_buffers = {n for n, b in model.named_buffers() if b.is_meta and n not in buffers}
    check_initialisable(model, params, wanted_buffers)
    values: dict[str, torch.Tensor] = {}
    for made in initialise_modules(model, seed, device, params, wanted_buffers):
        values.update(made)
    _assign(model, values, buffers, device)
    return model


def _assign(model: nn.Module, values: dict[str, torch.Tensor], buffers: dict[str, torch.Tensor],
            device: torch.device) -> None:
    """Put the made values into ``model``: one new parameter per tied group, made or given buffers,
    the model's other buffers moved to ``device``."""
    first_name: dict[int, str] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        first_name.setdefault(id(p), name)
    new = {name: nn.Parameter(values[name], requires_grad=p.requires_grad)
           for name, p in model.named_parameters()}
    for path, module in model.named_modules(remove_duplicate=False):
        prefix = f"{path}." if path else ""
        for name, p in module._parameters.items():
            if p is not None:
                module._parameters[name] = new[first_name[id(p)]]
        for name, b in module._buffers.items():
            if b is not None:
                value = buffers.get(prefix + name, values.get(prefix + name, b))
                module._buffers[name] = value.to(device)
