"""Where each parameter and buffer of a rank comes from: decided, and checked, before any work.

The first source that has it, for a parameter:

1. ``state_dict`` (full weights: then it must hold every parameter);
2. ``checkpoint``, a HuggingFace safetensors checkpoint (``hf.weights_in``; names through
   transformers' conversion mapping, ``hf.conversion``);
3. the model's own parameter, when it is real;
4. the model's own initialisation, for a parameter on the meta device
   (``initialize``), seeded by the base seed and the module's path;

and for a buffer the graph reads: ``state_dict``, the checkpoint (same name
and shape), the model's buffer when it is real, its module's initialisation.
A ``state_dict`` may hold buffers alone (those a meta-device model cannot
make); one with some parameters but not all is refused, as is a
``state_dict`` of parameters together with a checkpoint.

``plan_weights`` decides and checks (missing or mis-shaped checkpoint
tensors, modules with no code to make their values) from the program, the
model and the checkpoint's headers alone, before any weight is made
(``materialize`` makes every rank stop when one fails here): a
``WeightsError``, or ``MissingWeightsError`` for a ``state_dict`` that lacks
some parameters.
``WeightPlan.load`` then makes one rank's shards, each sharded tensor read
piece by piece (``shards.assemble``), never whole unless made whole by its
module's initialisation, and freed before the next module's.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import torch

from autopar.compiler.program import Program
from autopar.core.errors import AutoparError
from autopar.runtime.hf.conversion import Lazy
from autopar.runtime.hf.weights_in import HFCheckpoint
from autopar.runtime.weights.initialize import initialise_modules
from autopar.runtime.weights.module_init import check_initialisable
from autopar.runtime.weights.shards import Reader, assemble, expert_slice, narrow_reader

__all__ = ["WeightPlan", "plan_weights", "model_names", "WeightsError", "MissingWeightsError"]


def model_names(program: Program, name: str) -> tuple[str, ...]:
    """The model's parameters that parameter ``name`` holds: itself, or the experts a stacked one
    stacks (``TracedModel.stacked``), in order."""
    return program.traced.stacked.get(name, (name,))


class WeightsError(AutoparError, ValueError):
    """Weights given to ``materialize`` that do not fit the program, or a value of the traced model that
    nothing can give; the message names each tensor and the fix."""


class MissingWeightsError(WeightsError, KeyError):
    """A ``state_dict`` that holds some of the program's parameters but not all (a ``KeyError`` too)."""

    __str__ = BaseException.__str__  # the message as written, not quoted as a KeyError's key is


@dataclass
class WeightPlan:
    """Each parameter's and buffer's source (see the module's docstring)."""

    program: Program
    given: dict[str, torch.Tensor | tuple[torch.Tensor, ...]] = field(default_factory=dict)
    """Parameter -> its full value (the ``state_dict``'s or the model's own); a stacked parameter's
    experts' values, stacked when its shard is cut."""
    checkpoint: HFCheckpoint | None = None
    entries: dict[str, Lazy] = field(default_factory=dict)
    """Parameter -> its tensor in the checkpoint (after transformers' conversion mapping)."""
    init_params: set[str] = field(default_factory=set)
    """Parameters made by the model's initialisation."""
    given_buffers: dict[str, torch.Tensor] = field(default_factory=dict)
    checkpoint_buffers: dict[str, Lazy] = field(default_factory=dict)
    init_buffers: set[str] = field(default_factory=set)
    ep_rank: int = 0
    """The expert-parallel rank ``load`` reads for (its experts of each stacked expert weight)."""
    _pending: dict[str, dict[str, torch.Tensor]] = field(default_factory=dict)
    """A stacked parameter -> its experts' values made so far by their modules' initialisation."""

    @property
    def _stack_of(self) -> dict[str, str]:
        return {m: s for s, members in self.program.traced.stacked.items() for m in members}

    def load(self, stage: int, tp_rank: int, device: torch.device, seed: int, ep_rank: int = 0
             ) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
        """(this rank's parameter shards in the program's order, the graph's buffers), on ``device``;
        stacked expert weights cut to expert-parallel rank ``ep_rank``'s experts first."""
        self.ep_rank = ep_rank
        held = [n for n in self.program.param_names if stage in self.program.param_stages[n]]
        local: dict[str, torch.Tensor] = {}
        buffers = {n: b.detach().to(device, copy=True) for n, b in self.given_buffers.items()}
        for n in held:
            if n in self.given:
                given = self.given[n]
                value = torch.stack([g.detach() for g in given]) if isinstance(given, tuple) else given.detach()
                local[n] = self._shard(n, narrow_reader(value, self.program.param_spec(n)), self._dtype(n), tp_rank,
                                       device)
                value = None
        if self.checkpoint is not None:
            self._read_checkpoint([n for n in held if n in self.entries], local, buffers, tp_rank, device)
        params = self.init_params & set(held)
        if params or self.init_buffers:
            made_names = {m for n in params for m in model_names(self.program, n)}
            for made in initialise_modules(self.program.model, seed, device, made_names, self.init_buffers):
                self._keep(made, params, local, buffers, tp_rank, device)
                made = None  # the module's full tensors go before the next module's are made
        return {n: local[n] for n in held}, buffers

    def _dtype(self, name: str) -> torch.dtype:
        """The model's dtype of parameter ``name`` (a stacked one: its first expert's)."""
        return self.program.model.get_parameter(model_names(self.program, name)[0]).dtype

    def _read_checkpoint(self, names: list[str], local: dict, buffers: dict, tp_rank: int,
                         device: torch.device) -> None:
        """This rank's slices of ``names`` and the checkpoint's buffers, in the model's dtypes."""
        model = self.program.model
        with self.checkpoint.opened(device) as ckpt:
            for n in names:
                dtype = self._dtype(n)
                experts = self.program.expert_range(n, self.ep_rank)  # read for this rank's experts only
                read = ckpt.reader(self.entries[n], self.program.param_spec(n), dtype, n, experts)
                local[n] = self._shard(n, read, dtype, tp_rank, device, experts_read=experts is not None)
            for n, entry in self.checkpoint_buffers.items():
                buffers[n] = ckpt.read(entry, model.get_buffer(n).dtype, n).to(device)

    def _keep(self, made: dict[str, torch.Tensor], params: set[str], local: dict, buffers: dict, tp_rank: int,
              device: torch.device) -> None:
        """One module's made values: this rank's shard of each parameter, buffers whole. An expert's
        parameter waits for the other experts' stacked with it (``TracedModel.stacked``)."""
        stacked = self.program.traced.stacked
        for n, value in made.items():
            into = self._stack_of.get(n)
            if into is not None:
                self._pending.setdefault(into, {})[n] = value
                if len(self._pending[into]) < len(stacked[into]):
                    continue
                parts = self._pending.pop(into)
                n, value = into, torch.stack([parts[m] for m in stacked[into]])
                parts = None
            if n in params:
                local[n] = self._shard(n, narrow_reader(value, self.program.param_spec(n)), value.dtype, tp_rank,
                                       device)
            else:
                buffers[n] = value

    def _shard(self, name: str, read: Reader, dtype: torch.dtype, tp_rank: int,
               device: torch.device, experts_read: bool = False) -> torch.Tensor:
        """This rank's shard of parameter ``name`` from ``read``, as ``dtype`` on ``device``: a stacked
        expert weight is first cut to this rank's experts (``expert_slice``), unless ``read`` reads
        those experts only already (``experts_read``: a checkpoint's reader)."""
        program = self.program
        spec, full = program.param_spec(name), program.full_shape(name)
        experts = program.expert_range(name, self.ep_rank)
        if experts is not None and experts_read:
            full = (experts[1], *full[1:])
        elif experts is not None:
            read, full = expert_slice(read, full, spec, *experts)
        return assemble(read, full, spec, tp_rank, program.tp, dtype, device)


def plan_weights(program: Program, state_dict: dict[str, torch.Tensor] | None = None,
                 checkpoint: str | Path | None = None) -> WeightPlan:
    """Each parameter's and buffer's source, checked: bad input fails here, on every rank alike."""
    state_dict = state_dict or {}
    plan = WeightPlan(program)
    present = [n for n in program.param_names if all(m in state_dict for m in model_names(program, n))]
    if present and checkpoint is not None:
        raise WeightsError("pass the parameters once: materialize(state_dict=...) with parameters, or "
                           "checkpoint=...; a state_dict next to a checkpoint may hold buffers only")
    if present and len(present) < len(program.param_names):
        missing = [m for n in program.param_names for m in model_names(program, n) if m not in state_dict]
        raise MissingWeightsError(f"state_dict lacks {len(missing)} parameter(s), e.g. {missing[:3]}: pass every "
                                  "parameter, or none (then the model's own, a checkpoint's, or its "
                                  "initialisation's are used)")
    if checkpoint is not None:
        plan.checkpoint = HFCheckpoint.open(checkpoint)
        plan.entries = plan.checkpoint.match(program)
    model_params = dict(program.model.named_parameters())
    for name in program.param_names:
        members = model_names(program, name)
        one = name not in program.traced.stacked
        if name in present:
            plan.given[name] = state_dict[name] if one else tuple(state_dict[m] for m in members)
        elif name not in plan.entries and any(model_params[m].is_meta for m in members):
            plan.init_params.add(name)
        elif name not in plan.entries:
            plan.given[name] = model_params[name] if one else tuple(model_params[m] for m in members)
    _check_given(program, state_dict)
    _plan_buffers(plan, state_dict)
    _check_constants(program)
    if plan.init_params or plan.init_buffers:
        check_initialisable(program.model, [m for n in plan.init_params for m in model_names(program, n)],
                            plan.init_buffers)
    return plan


def _check_given(program: Program, state_dict: dict[str, torch.Tensor]) -> None:
    """Every tensor given in ``state_dict`` has the model's shape (a larger one would be cut, a smaller
    one broadcast): one error listing each mismatch."""
    want = {m: program.full_shape(n)[1:] if n in program.traced.stacked else program.full_shape(n)
            for n in program.param_names for m in model_names(program, n)}
    want.update({n: tuple(b.shape) for n, b in program.model.named_buffers(remove_duplicate=False)})
    bad = [f"{n}: given {tuple(t.shape)}, the model has {want[n]}" for n, t in state_dict.items()
           if n in want and tuple(t.shape) != tuple(want[n])]
    if bad:
        raise WeightsError(f"materialize(state_dict=...): {len(bad)} tensor(s) of another shape than the model's: "
                           + "; ".join(bad[:5]) + (" ..." if len(bad) > 5 else "")
                           + ". Fix: pass the weights of this model (same vocabulary, widths and layer count)")


def _plan_buffers(plan: WeightPlan, state_dict: dict[str, torch.Tensor]) -> None:
    """The source of every buffer the graph reads (state_dict, checkpoint, the model's, its init)."""
    model_buffers = dict(plan.program.model.named_buffers(remove_duplicate=False))
    for name in dict.fromkeys(plan.program.traced.buffer_of.values()):
        own = model_buffers[name]
        entry = plan.checkpoint.buffer(name, tuple(own.shape), plan.program.model) \
            if plan.checkpoint and name not in state_dict \
            else None
        if name in state_dict:
            plan.given_buffers[name] = state_dict[name]
        elif entry is not None:
            plan.checkpoint_buffers[name] = entry
        elif not own.is_meta:
            plan.given_buffers[name] = own
        else:
            plan.init_buffers.add(name)


def _check_constants(program: Program) -> None:
    """A tensor constant traced on the meta device has no value; only an empty one can be made."""
    lost = [(name, tuple(value.shape)) for name, value in program.traced.constants.items()
            if value.is_meta and value.numel() > 0 and name in program.traced.constant_of.values()]
    if lost:
        raise WeightsError(
            f"{len(lost)} tensor constant(s) of the traced model have no value: made on the meta device (a plain "
            f"tensor attribute, or a tensor built from Python data in forward): {lost[:3]}; fix: register it as "
            f"a buffer (register_buffer) so the initialisation or materialize(state_dict=...) can give it, or "
            f"build the model on a real device")
