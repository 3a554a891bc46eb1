"""The optimizer's state in a checkpoint, by parameter name, resharded with the parameters.

The optimizer is any ``torch.optim`` optimizer over ``engine.parameters()``
(the shards); its state is keyed by the shard tensors, and their identity gives
each its parameter name. Keys:

- ``optim.<name>.<state key>``: a tensor shaped like the shard (Adam's
  ``exp_avg``, ``exp_avg_sq``, SGD's momentum) as pieces of the parameter's
  full shape, so it reshards exactly like the parameter; a 0-d tensor (Adam's
  ``step``) whole; any other value (a plain number) as a stored object;
- ``optim.<name>.param_group``: the hyperparameters of the group holding the
  parameter (lr, betas, weight decay, ...: everything but its parameter list).

Loading needs the optimizer's own state tensors to read into, where and as it
keeps them (``step`` on the CPU for Adam, on the GPU when capturable):
``initialise_state`` makes them the way ``torch.distributed.checkpoint``'s own
state-dict helpers do, with one step of zero gradients at learning rate 0,
which leaves every parameter unchanged; the load then overwrites every value.
``holdings`` is the engine's ``engine.holdings`` (its program, mesh and shards by name;
unannotated: the engine imports this code).
"""

from __future__ import annotations

import torch

from autopar.runtime.checkpoint.dcp import Pieces
from autopar.runtime.checkpoint.description import CheckpointError
from autopar.runtime.checkpoint.model_state import as_pieces

__all__ = ["named_params", "optimizer_entries", "initialise_state", "optimizer_targets", "saved_state_keys",
           "optimizer_errors", "apply_loaded", "GROUP_KEY", "hyperparameters", "set_hyperparameters",
           "missing_state_error", "state_keys_errors"]

GROUP_KEY = "param_group"
"""``optim.<name>.param_group``: the hyperparameters of the parameter's group."""


def named_params(holdings, optimizer: torch.optim.Optimizer) -> list[tuple[str, torch.Tensor, dict]]:
    """(parameter name, shard, its param group) of every tensor the optimizer updates, in its order."""
    names = {id(p): n for n, p in holdings.named_local_parameters()}
    out = []
    for group in optimizer.param_groups:
        for p in group["params"]:
            if id(p) not in names:
                raise CheckpointError(f"the optimizer updates a tensor of shape {tuple(p.shape)} that is not one of "
                                      f"this engine's parameter shards: build it over engine.parameters()")
            out.append((names[id(p)], p, group))
    return out


def hyperparameters(group: dict) -> dict:
    """A param group's options as saved: everything but its parameter list."""
    return {k: v for k, v in group.items() if k != "params"}


def optimizer_entries(holdings, optimizer: torch.optim.Optimizer) -> dict:
    """``optim.*`` entries of every parameter this rank's optimizer updates."""
    out = {}
    for name, p, group in named_params(holdings, optimizer):
        out[f"optim.{name}.{GROUP_KEY}"] = hyperparameters(group)
        for key, value in optimizer.state.get(p, {}).items():
            out[f"optim.{name}.{key}"] = _entry(holdings, name, p, key, value)
    return out


def _entry(holdings, name: str, shard: torch.Tensor, key: str, value):
    """One state value as saved: pieces when shaped like the shard, a 0-d tensor whole, else the value."""
    if not isinstance(value, torch.Tensor):
        return value
    if value.dim() > 0 and value.shape == shard.shape:
        return as_pieces(holdings.program, name, value, holdings.mesh.tp_rank, holdings.mesh.ep_rank)
    if value.dim() == 0:
        return value
    raise CheckpointError(f"optimizer state '{key}' of parameter {name} has shape {tuple(value.shape)}, neither the "
                          f"shard's {tuple(shard.shape)} nor a scalar: only element-wise optimizer state (Adam, SGD "
                          f"momentum, ...) can be saved in the parameters' full shapes and resharded")


def initialise_state(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    """Give every parameter without state its state, as the optimizer makes it: one step of zero
    gradients at learning rate 0 (a parameter moves by lr * update = 0). Returns those parameters."""
    params = [p for g in optimizer.param_groups for p in g["params"]]
    fresh = [p for p in params if not optimizer.state.get(p)]
    if not fresh:
        return []
    grads = [p.grad for p in params]
    lrs = [g["lr"] for g in optimizer.param_groups]
    fresh_ids = {id(p) for p in fresh}
    try:
        for g in optimizer.param_groups:
            g["lr"] = torch.zeros_like(g["lr"]) if isinstance(g["lr"], torch.Tensor) else 0.0
        for p in params:  # only the fresh ones take part: the others' state is left as it is
            p.grad = torch.zeros_like(p) if id(p) in fresh_ids else None
        optimizer.step()
    finally:
        for g, lr in zip(optimizer.param_groups, lrs):
            g["lr"] = lr
        for p, grad in zip(params, grads):
            p.grad = grad
    return fresh


def optimizer_targets(holdings, optimizer: torch.optim.Optimizer, saved_keys) -> dict:
    """Where a load puts each ``optim.*`` value the checkpoint holds: views of the optimizer's own
    state tensors (DCP writes into them), None for stored objects (DCP puts the value in its place).
    A parameter without saved state gets only its ``param_group``."""
    out = {}
    for name, p, _ in named_params(holdings, optimizer):
        out[f"optim.{name}.{GROUP_KEY}"] = None
        if not saved_state_keys(saved_keys, name):
            continue
        for key, value in optimizer.state[p].items():
            if isinstance(value, torch.Tensor) and value.dim() > 0:
                out[f"optim.{name}.{key}"] = as_pieces(holdings.program, name, value, holdings.mesh.tp_rank,
                                                       holdings.mesh.ep_rank)
            else:
                out[f"optim.{name}.{key}"] = value if isinstance(value, torch.Tensor) else None
    return out


def optimizer_errors(holdings, optimizer: torch.optim.Optimizer, saved_keys) -> list[str]:
    """Why the checkpoint's optimizer state does not fit this optimizer (empty when it does)."""
    errors = []
    for name, p, _ in named_params(holdings, optimizer):
        if f"optim.{name}.{GROUP_KEY}" not in saved_keys:
            return [missing_state_error(name)]
        errors += state_keys_errors(name, saved_state_keys(saved_keys, name), set(optimizer.state[p]))
    return errors


def missing_state_error(name: str) -> str:
    """The checkpoint holds nothing of the optimizer for parameter ``name``."""
    return (f"holds no optimizer state for parameter {name}: it was saved without an optimizer "
            f"(load the weights alone with optimizer=None)")


def state_keys_errors(name: str, saved: set[str], mine: set[str]) -> list[str]:
    """The state keys saved for parameter ``name`` are not the ones this optimizer keeps."""
    if not saved or saved == mine:
        return []
    return [f"holds optimizer state {sorted(saved)} for parameter {name}, but this optimizer keeps "
            f"{sorted(mine)}: another optimizer, or other settings (amsgrad, momentum)?"]


def saved_state_keys(saved_keys, name: str) -> set[str]:
    """The state keys the checkpoint holds for parameter ``name`` (its ``param_group`` excluded)."""
    prefix = f"optim.{name}."
    rest = (k[len(prefix):] for k in saved_keys if k.startswith(prefix))
    return {k for k in rest if "." not in k and k != GROUP_KEY}


def restore_objects(state: dict, holder: torch.Tensor, name: str, loaded: dict) -> None:
    """Into ``state[holder]`` (the state of parameter ``name``, or of the range of it a sharded
    optimizer owns) the stored values DCP does not fill in place (step counts and other objects);
    no state at all when the checkpoint holds none for it (it had had no gradient when saved)."""
    keys = [k for k in state[holder] if f"optim.{name}.{k}" in loaded]
    if not keys:
        state.pop(holder, None)
    for key in keys:
        value = loaded[f"optim.{name}.{key}"]
        if not isinstance(value, (torch.Tensor, Pieces)):
            state[holder][key] = value


def apply_loaded(holdings, optimizer: torch.optim.Optimizer, loaded: dict) -> None:
    """After DCP filled ``loaded`` (``optimizer_targets``): the stored values into the state, each
    group's hyperparameters, and no state for a parameter the checkpoint holds none for (it had
    had no gradient yet when saved)."""
    groups_done = set()
    for name, p, group in named_params(holdings, optimizer):
        restore_objects(optimizer.state, p, name, loaded)
        if id(group) not in groups_done:
            groups_done.add(id(group))
            set_hyperparameters(group, loaded[f"optim.{name}.{GROUP_KEY}"])


def set_hyperparameters(group: dict, saved: dict) -> None:
    """A param group's options set to the saved ones (a tensor option, a tensor lr, copied into)."""
    for key, value in saved.items():
        if isinstance(group.get(key), torch.Tensor) and isinstance(value, torch.Tensor):
            group[key].copy_(value)
        else:
            group[key] = value
