"""What one number costs in memory: the byte sizes the memory model prices a run with.

A ``Precision`` names the bytes of a weight, a gradient, an activation, a
dropout mask and the optimizer's own copy of a weight, so the same formulas
price the paper's mixed-precision training (``MIXED``: fp16/bf16 weights and
activations, fp32 master weights and Adam moments) and what autopar's runtime
runs (``RUNTIME_FP32``; ``RUNTIME_BF16``, fp32 parameters under bf16 autocast).
``runtime_precision(name)`` maps a ``ParallelConfig.precision`` to the latter.
"""

from __future__ import annotations

from dataclasses import dataclass

from autopar.planning.errors import PlanError

__all__ = ["Precision", "MIXED", "RUNTIME_FP32", "RUNTIME_BF16", "runtime_precision"]


@dataclass(frozen=True)
class Precision:
    """Bytes per element of each kind of tensor a training step holds."""

    name: str
    weight: int
    """A parameter as the forward reads it."""
    grad: int
    """A parameter's gradient as the backward accumulates it."""
    activation: int
    """An activation kept for the backward (a layer input, a GEMM input, a softmax output)."""
    mask: int
    """A dropout mask element: 1 with fused dropout kernels, the activation's size when the mask is
    materialised as a tensor of the activation's dtype (PyTorch's CPU dropout)."""
    master: int
    """The optimizer's own copy of a weight: 4 (fp32) when the weights are 16-bit, 0 when the
    weights are the fp32 master themselves."""
    moments: int = 8
    """Adam's m and v, fp32."""
    norm_stats: int = 0
    """Bytes per token a normalisation keeps besides its input (LayerNorm's fp32 mean and
    1/std: 8); the paper's count leaves them out (0)."""

    @property
    def optimizer_state(self) -> int:
        """Bytes of optimizer state per parameter of a plain (unsharded) Adam: master + moments."""
        return self.master + self.moments

    @property
    def sharded_state(self) -> int:
        """Bytes per parameter the distributed optimizer shards over d: the master copy and the
        moments. With fp32 weights there is no master copy: the optimizer steps the parameters' own
        storage, its 1/d range of a flat buffer the parameters are views of (the runtime's
        ``masters_shared``), so only the moments are sharded."""
        return self.optimizer_state


MIXED = Precision("mixed fp16", weight=2, grad=2, activation=2, mask=1, master=4)
"""The paper's mixed precision (Megatron-LM 2021): 2 + 2 + 12 bytes of model state per parameter,
16-bit activations, 1-byte dropout masks."""

RUNTIME_FP32 = Precision("fp32", weight=4, grad=4, activation=4, mask=4, master=0, norm_stats=8)
"""autopar's runtime at ``precision='fp32'``: fp32 everywhere, Adam's moments only."""

RUNTIME_BF16 = Precision("bf16 autocast", weight=4, grad=4, activation=2, mask=2, master=0, norm_stats=8)
"""autopar's runtime at ``precision='bf16'``: fp32 parameters and gradients, bf16 activations
(autocast), Adam's moments only."""


def runtime_precision(name: str) -> Precision:
    """The byte sizes of autopar's runtime at ``ParallelConfig.precision == name``."""
    known = {"fp32": RUNTIME_FP32, "bf16": RUNTIME_BF16}
    if name not in known:
        raise PlanError(f"precision must be one of {sorted(known)}, got {name!r}")
    return known[name]
