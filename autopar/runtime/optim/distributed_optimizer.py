"""Megatron-LM's distributed optimizer (ZeRO stage 1): optimizer state sharded over the d replicas.

``engine.distributed_optimizer(torch.optim.AdamW, lr=3e-4)`` returns a
``DistributedOptimizer``: a ``torch.optim.Optimizer`` (``step``,
``zero_grad``, ``state_dict``/``load_state_dict``, ``param_groups``; an LR
scheduler drives it) that keeps only 1/d of the optimizer state on each
data-parallel replica:

- this rank's parameters are laid out in flat buckets (``flat_buffers.py``),
  cut exactly as ``GradientSync`` cuts its gradient buckets; each replica owns
  a contiguous 1/d of every bucket and keeps an fp32 master copy of it;
- the gradient buckets are reduce-scattered instead of all-reduced (the same
  buckets, started when their gradients are final, overlapping the rest of the
  backward), so each replica receives the averaged gradient of its range only;
- ``step()`` runs the inner ``torch.optim`` optimizer on views of the owned
  range, then starts the all-gathers of the updated ranges back into the
  parameters, one per bucket, and returns (``param_gathers.py``): each bucket is
  waited for right before the first forward that reads one of its parameters
  (or anything else that reads them), so the gathers overlap the next step's
  start. ``overlap_param_gather=False`` waits for them all inside ``step()``;
- ``engine.clip_grad_norm_`` clips over the shards, with the same global norm;
- a training step whose loss or gradient norm is not finite is skipped by
  ``step()`` itself (the engine's ``step_guard``, ``engine/step_health.py``):
  the masters, the inner optimizer's state and its step count are left as
  they were, and the step's gradient shards dropped;
- with context parallelism the c cp ranks of each replica share the buckets
  like replicas: each of the d x c ranks ('dp_cp') owns 1/(d c) of every
  dense bucket;
- with expert parallelism, the stacked expert weights get flat buckets of
  their own, shared by the d/ep replicas holding the same experts (mesh
  'edp'): reduce-scattered, owned and all-gathered over those, averaged by
  d/ep (the graph already scaled their gradients by 1/ep). With d = ep no other
  replica holds them: each rank owns its experts' buckets whole;
- ``engine.save`` / ``engine.load`` store the state by parameter name in the
  parameters' full shapes, as the plain optimizer's (``checkpoint/sharded_optimizer_state.py``).

Parameters in bf16 (a model cast to bf16) keep fp32 master copies here: the
inner optimizer updates the masters, and the parameters receive them rounded.

Only an optimizer whose update of each parameter entry reads that entry alone
(its gradient, its own state) can step a slice of a parameter and get the
entries the whole parameter would get: Adam, AdamW, SGD (with momentum),
Adagrad, ... (``ELEMENTWISE_OPTIMIZERS``). One that reads a whole parameter
(LBFGS's line search over the flat vector, Adafactor's row and column
factors, Muon's orthogonalised matrix) would silently compute something else,
and is refused before any work. A class outside the list (your own) is refused
too, naming the fix: ``elementwise=True`` when its update is element-wise.

Parameters changed outside the optimizer (a checkpoint loaded, a user's
``copy_``) are noticed by their version counter and re-read into the master
copies before the next step.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

import torch

from autopar.runtime.optim.errors import OptimizerError, OptimizerTypeError, StepOrderError
from autopar.runtime.optim.flat_buffers import FlatBucket, Piece
from autopar.runtime.optim.gradient_sync import GradientSync, bucket_names
from autopar.runtime.optim.param_gathers import ParamGathers

__all__ = ["DistributedOptimizer", "ELEMENTWISE_OPTIMIZERS", "elementwise_errors"]

ELEMENTWISE_OPTIMIZERS: tuple[type, ...] = (
    torch.optim.SGD, torch.optim.Adam, torch.optim.AdamW, torch.optim.Adagrad, torch.optim.Adadelta,
    torch.optim.Adamax, torch.optim.NAdam, torch.optim.RAdam, torch.optim.RMSprop, torch.optim.Rprop,
    torch.optim.ASGD,
)
"""``torch.optim`` optimizers whose update of an entry reads only that entry's gradient and state."""


def elementwise_errors(optimizer_class: type, elementwise: bool) -> list[str]:
    """Why ``optimizer_class`` cannot step slices of parameters (empty when it can)."""
    if not (isinstance(optimizer_class, type) and issubclass(optimizer_class, torch.optim.Optimizer)):
        return [f"the distributed optimizer wraps a torch.optim.Optimizer class (e.g. torch.optim.AdamW), "
                f"got {optimizer_class!r}"]
    if elementwise or optimizer_class in ELEMENTWISE_OPTIMIZERS:
        return []
    known = ", ".join(c.__name__ for c in ELEMENTWISE_OPTIMIZERS)
    return [f"{optimizer_class.__module__}.{optimizer_class.__qualname__} is not known to update each "
            f"parameter entry from that entry alone: the distributed optimizer steps only this replica's "
            f"1/d slice of the parameters, which is right only for element-wise updates ({known}); an "
            f"optimizer that reads a whole parameter or the whole gradient vector (LBFGS, Adafactor's "
            f"factored statistics, Muon's orthogonalisation, a norm-based trust ratio such as LAMB's) would "
            f"compute something else. Fix: use one of those, or a plain optimizer over engine.parameters(); "
            f"if {optimizer_class.__name__}'s update is element-wise, pass elementwise=True"]


class DistributedOptimizer(torch.optim.Optimizer):
    """An inner ``torch.optim`` optimizer over this replica's 1/d of the parameters' entries.

    ``param_groups`` and ``state`` are the inner optimizer's: one tensor per piece of a parameter this
    replica owns (``FlatBucket.pieces``), grouped as the parameters were. Made over this rank's
    ``shards`` (original name -> parameter), the engine's gradient reduction ``grads`` (switched to
    reduce-scatter into this optimizer's buffers) and its ``gradient_groups`` (the names whose
    reduction starts together), by ``engine.distributed_optimizer``; the engine waits for ``gathers``
    before each read of the parameters.
    """

    def __init__(self, shards: dict[str, torch.nn.Parameter], grads: GradientSync, gradient_groups: list[list[str]],
                 optimizer_class: type, params=None, *, elementwise: bool = False, overlap_param_gather: bool = True,
                 step_guard: Callable[[], bool] | None = None,
                 watched: Callable[[str], contextlib.AbstractContextManager] | None = None, **defaults: Any):
        if grads.sharded is not None:
            raise StepOrderError("this engine already has a distributed optimizer: its gradients are reduce-scattered "
                                 "into that optimizer's buffers; make one distributed optimizer per engine")
        errors = elementwise_errors(optimizer_class, elementwise)
        if errors:
            raise OptimizerTypeError(errors[0])
        self.grads = grads
        """The engine's gradient reduction, switched to reduce-scatter into this optimizer's buffers."""
        self.mesh = grads.mesh
        self.params = dict(shards)
        """Original name -> this rank's shard (an engine parameter)."""
        held = [n for n, p in self.params.items() if p.grad is not None]
        if held:
            raise StepOrderError(f"{len(held)} parameter(s) ({', '.join(held[:3])}...) already hold gradients of a "
                                 f"step reduced without the distributed optimizer (all-reduced; tied ones summed "
                                 f"across stages), which its reduce-scatter would reduce again: call "
                                 f"engine.zero_grad() before making the distributed optimizer")
        groups = self._user_groups(params)
        self.group_of = {name: i for i, (names, _) in enumerate(groups) for name in names}
        """Parameter name -> the index of the param group updating it (every parameter in a group)."""
        self.buckets = self._plan_buckets(gradient_groups)
        self.owned: dict[str, tuple[FlatBucket, Piece, torch.nn.Parameter]] = {}
        """Parameter name -> (its bucket, the piece of it this replica owns, the inner optimizer's view
        of that piece): the parameters with entries in this replica's ranges."""
        self.inner = optimizer_class(self._inner_groups(groups), **defaults)
        self.defaults = self.inner.defaults
        self.overlap_param_gather = overlap_param_gather
        """Whether ``step()`` returns with the parameter all-gathers in flight (waited for by the reads)."""
        self.gathers = ParamGathers(self.buckets, self.params, self.mesh.groups, self._written)
        """The parameters' all-gathers after a step: the engine waits for them before each read."""
        self._versions = self._param_versions()
        self._opt_called = False
        self.step_guard = step_guard
        """Asked by ``step()`` whether this training step's numbers are finite (the engine's skip
        policy: it may raise ``NonFiniteError``); None: every step is taken."""
        self.watched = watched or (lambda what: contextlib.nullcontext())
        """``watched(what)``: the engine's failure watch over a collective call (``StepFailures.watched``),
        so a peer that stops answering during ``step()`` fails it, named, on every rank."""
        grads.reduce_scatter_into(self.buckets)

    def add_param_group(self, param_group: dict) -> None:
        """Refused: the flat buffers, the owned ranges and the gradients' reduce-scatter are laid out
        once, for the parameters given at construction."""
        raise StepOrderError("the distributed optimizer lays out its flat buffers for the parameters it is made "
                             "with; add_param_group cannot join more. Fix: pass every group when making it "
                             "(engine.distributed_optimizer(cls, params=[{...}, {...}])); a group can start "
                             "frozen with lr=0 and get its learning rate later")

    # ------------------------------------------------------------- layout
    def _user_groups(self, params) -> list[tuple[list[str], dict]]:
        """The parameter groups as (parameter names, options): all of the engine's by default; else
        ``params`` as torch.optim takes it (tensors, or dicts with ``params``), each an engine parameter."""
        if params is None:
            return [(list(self.params), {})]
        params = list(params)
        raw = params if params and isinstance(params[0], dict) else [{"params": params}]
        name_of = {id(p): n for n, p in self.params.items()}
        groups, seen = [], set()
        for i, group in enumerate(raw):
            names = []
            for p in group["params"]:
                if id(p) not in name_of:
                    raise OptimizerError(f"param group {i}: a tensor of shape {tuple(p.shape)} is not one of this "
                                         f"engine's parameters: pass tensors from engine.parameters()")
                if id(p) in seen:
                    raise OptimizerError(f"parameter {name_of[id(p)]} appears in more than one param group")
                seen.add(id(p))
                names.append(name_of[id(p)])
            groups.append((names, {k: v for k, v in group.items() if k != "params"}))
        return groups

    def _plan_buckets(self, gradient_groups: list[list[str]]) -> list[FlatBucket]:
        """The flat buckets, cut as ``GradientSync.start`` cuts the gradients: per group of parameters
        final after one chunk's last backward (``gradient_groups``), its stacked expert weights apart
        (shared by the d/ep replicas holding the same experts, mesh 'edp'), then the tied parameters
        (final at the step's end)."""
        # the dense buckets are shared by the d x c ranks averaging gradients ('dp_cp'; 'dp' when c = 1)
        bucket_bytes, d, r = self.grads.bucket_bytes, self.mesh.shape.dp_cp, self.mesh.dp_cp_rank
        axis = "dp" if self.mesh.shape.cp == 1 else "dp_cp"
        experts = self.grads.program.expert_params
        buckets = []
        for names in gradient_groups:
            for cut in bucket_names([n for n in names if n in experts], self.params, bucket_bytes):
                buckets.append(FlatBucket(self.params, cut, self.mesh.shape.edp, self.mesh.edp_rank,
                                          share_params=True, axis="edp"))
            for cut in bucket_names([n for n in names if n not in experts], self.params, bucket_bytes):
                buckets.append(FlatBucket(self.params, cut, d, r, share_params=True, axis=axis))
        tied = [n for n in self.grads.program.tied_params if n in self.params]
        if any(n in experts for n in tied):
            raise OptimizerError(f"stacked expert weight(s) {[n for n in tied if n in experts]} are read by several "
                                 f"pipeline stages (tied): the distributed optimizer shards tied parameters over "
                                 f"all of dp, expert weights over their d/ep replicas, not both. Fix: untie them, "
                                 f"or use a plain optimizer over engine.parameters()")
        for cut in bucket_names(tied, self.params, bucket_bytes) if tied else []:
            buckets.append(FlatBucket(self.params, cut, d, r, tied=True, share_params=True, axis=axis))
        return buckets

    def _inner_groups(self, groups: list[tuple[list[str], dict]]) -> list[dict]:
        """The inner optimizer's groups: each user group's pieces on this replica, views of the masters
        with views of the gradient shards as their ``.grad``."""
        for bucket in self.buckets:
            for piece in (p for p in bucket.pieces if p.name in self.group_of):
                view = torch.nn.Parameter(bucket.master[piece.at : piece.at + piece.length])
                view.grad = bucket.grad[piece.at : piece.at + piece.length]
                self.owned[piece.name] = (bucket, piece, view)
        return [{"params": [self.owned[n][2] for n in names if n in self.owned], **options}
                for names, options in groups]

    # ---------------------------------------------------- torch.optim interface
    @property
    def param_groups(self) -> list[dict]:
        return self.inner.param_groups

    @param_groups.setter
    def param_groups(self, value) -> None:
        self.inner.param_groups = value

    @property
    def state(self):
        return self.inner.state

    @state.setter
    def state(self, value) -> None:
        self.inner.state = value

    @torch.no_grad()
    def step(self, closure=None):
        """Update this replica's ranges with the inner optimizer, then start the all-gathers of every
        range back into the parameters (waited for here unless ``overlap_param_gather``).
        Collective: every rank calls it. A step the engine found non-finite (``step_guard``) is
        skipped: nothing is updated, and the step's gradients are dropped (``zero_grad``)."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        with self.watched("the distributed optimizer's step"):
            if self.step_guard is not None and not self.step_guard():
                self.zero_grad()
                return loss
            self.gathers.wait_all("step")
            self._reload_edited_params()
            self.inner.step()
            self._write_back()
        return loss

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Clear the parameters' gradients (``None``, or zeros) and this replica's gradient shards."""
        for p in self.params.values():
            if p.grad is not None:
                if set_to_none:
                    p.grad = None
                else:
                    p.grad.zero_()
        for bucket in self.buckets:
            bucket.grad.zero_()

    def state_dict(self) -> dict:
        """This replica's state: the inner optimizer's, the master copies and the layout they fit.

        Loads back at the same layout only (same program, d and replica); ``engine.save`` and
        ``engine.load`` store it by parameter name, loadable at any layout and by a plain optimizer."""
        return {"inner": self.inner.state_dict(), "master": [b.master.clone() for b in self.buckets],
                "layout": [b.signature() for b in self.buckets]}

    def load_state_dict(self, state_dict: dict) -> None:
        """Restore a ``state_dict()`` of this replica and write its master copies into the parameters.
        Collective over the data-parallel replicas."""
        mine = [b.signature() for b in self.buckets]
        if state_dict.get("layout") != mine:
            raise OptimizerError(f"this distributed optimizer state was saved for another layout of the flat buckets "
                                 f"(d, replica, parameters per bucket): saved {_short(state_dict.get('layout'))}, "
                                 f"here {_short(mine)}; load it in the same program at the same tp, pp and dp")
        self.gathers.wait_all("load_state_dict")
        self.inner.load_state_dict(state_dict["inner"])
        for bucket, master in zip(self.buckets, state_dict["master"]):
            bucket.master.copy_(master)
        with torch.no_grad():
            self._write_back()

    def masters_loaded(self, kept: set[str] = frozenset()) -> None:
        """After a checkpoint load wrote the parameters and the state: the master copies re-read from
        the parameters just loaded, except those of ``kept`` (lower-precision parameters whose fp32
        masters the load itself wrote)."""
        for name, (bucket, _, _) in self.owned.items():
            if name not in kept:
                bucket.load_master(self.params, [name])
        self._versions = self._param_versions()

    def keeps_wider_masters(self, name: str) -> bool:
        """Whether parameter ``name`` is of a lower precision than its master copy (a bf16 model): the
        master then holds bits the parameter lacks, and a checkpoint stores it."""
        bucket = self.owned[name][0] if name in self.owned else None
        return bucket is not None and self.params[name].dtype != bucket.dtype

    # ------------------------------------------------------------- internals
    def _write_back(self) -> None:
        """Start each bucket's all-gather of the updated ranges into the parameters; wait for them
        all now unless the reads of the parameters are to wait (``overlap_param_gather``)."""
        self.gathers.launch()
        if not self.overlap_param_gather:
            self.gathers.wait_all("step")

    def _written(self, names: list[str]) -> None:
        """The gathers wrote these parameters: their new versions are the optimizer's own."""
        for name in names:
            self._versions[name] = self.params[name]._version

    def _param_versions(self) -> dict[str, int]:
        return {n: p._version for n, p in self.params.items()}

    def _reload_edited_params(self) -> None:
        """Re-read into the masters the parameters changed since the last write-back."""
        edited = [n for n, v in self._param_versions().items() if v != self._versions[n]]
        if edited:
            for bucket in self.buckets:
                bucket.load_master(self.params, edited)

    def buffer_bytes(self) -> int:
        """Bytes this optimizer keeps beside its state: the gradient shards, and master copies that are
        not the parameters' own storage (bf16 parameters)."""
        return sum(b.grad.numel() * b.grad.element_size()
                   + (0 if b.masters_shared else b.master.numel() * b.master.element_size()) for b in self.buckets)

    def state_bytes(self) -> int:
        """Bytes of the inner optimizer's state tensors on this rank (the sharded part of the memory)."""
        return sum(t.numel() * t.element_size() for s in self.inner.state.values() for t in s.values()
                   if isinstance(t, torch.Tensor))

    def __repr__(self) -> str:
        owned = sum(b.shard_numel for b in self.buckets)
        return (f"DistributedOptimizer({type(self.inner).__name__}, {len(self.buckets)} bucket(s), "
                f"{owned} entries owned of {sum(b.padded for b in self.buckets)}, d={self.mesh.shape.dp}"
                + (f", cp={self.mesh.shape.cp})" if self.mesh.shape.cp > 1 else ")"))


def _short(layout) -> str:
    if not isinstance(layout, list):
        return repr(layout)
    return f"{len(layout)} bucket(s), first {layout[:1]}"[:300]
