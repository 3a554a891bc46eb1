"""``ParallelConfig``: the layout and training options of a program, validated up front.

Every check here runs before anything is traced or any process starts, and
its message shows the numbers and the fix ("tp(2) * pp(2) * dp(3) = 12, but
the world size is 8").
"""

from __future__ import annotations

from dataclasses import dataclass

from autopar.mesh import MeshShape
from autopar.schedules import SCHEDULE_NAMES

__all__ = ["ParallelConfig", "RECOMPUTE", "PRECISIONS"]


RECOMPUTE = ("none", "layer", "chunk")
PRECISIONS = ("fp32", "bf16")


@dataclass(frozen=True)
class ParallelConfig:
    tp: int = 1
    """Tensor-parallel degree t: each layer's matrices are split t ways."""
    pp: int = 1
    """Pipeline stages p."""
    virtual_stages: int = 1
    """Model chunks per pipeline stage v (interleaved schedule when > 1)."""
    microbatches: int = 1
    """Microbatches m per step and data-parallel replica."""
    schedule: str = "1f1b"
    """'gpipe', '1f1b' or 'interleaved'."""
    dp: int | None = None
    """Data-parallel replicas d; None: world size / (tp * pp) when the world is known, else 1."""
    world_size: int | None = None
    """Ranks that will run the program (checked against tp * pp * dp when known)."""
    scatter_gather: bool = True
    """Send stage boundaries as 1/tp slices and all-gather them on arrival."""
    recompute: str = "none"
    """Activation recomputation: 'none', 'layer' (keep each layer's input) or 'chunk' (each chunk's input)."""
    precision: str = "fp32"
    """'fp32', or 'bf16': bf16 autocast with fp32 parameters, gradients and gradient reduction."""

    def __post_init__(self):
        if self.recompute not in RECOMPUTE:
            raise ValueError(f"recompute must be one of {list(RECOMPUTE)}, got {self.recompute!r}")
        if self.precision not in PRECISIONS:
            raise ValueError(f"precision must be one of {list(PRECISIONS)}, got {self.precision!r}")
        for name in ("tp", "pp", "virtual_stages", "microbatches"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {name}={getattr(self, name)}")
        if self.schedule not in SCHEDULE_NAMES:
            raise ValueError(f"unknown schedule {self.schedule!r}; choose one of {list(SCHEDULE_NAMES)}")
        if self.virtual_stages > 1 and self.schedule != "interleaved" and self.schedule != "gpipe":
            raise ValueError(f"virtual_stages={self.virtual_stages} needs schedule='interleaved' (or 'gpipe'), "
                             f"got schedule={self.schedule!r}")
        p, m = self.pp, self.microbatches
        if self.schedule in ("1f1b", "interleaved") and p > 1 and m < p:
            raise ValueError(f"schedule {self.schedule!r} with pp={p} needs at least {p} microbatches, got "
                             f"microbatches={m}: the pipeline would never fill. Fix: microbatches >= {p} "
                             f"(more microbatches also shrink the bubble (p-1)/m), or schedule='gpipe'")
        if self.schedule == "interleaved" and m % p:
            raise ValueError(f"the interleaved schedule needs microbatches to be a multiple of pp: "
                             f"microbatches={m}, pp={p}. Fix: microbatches={-(-m // p) * p}")
        if self.world_size is not None:
            w = self.world_size
            if self.tp > w or w % self.tp:
                raise ValueError(
                    f"tp={self.tp} does not fit a world of {w} ranks: tensor parallelism needs "
                    f"tp <= world size and world size divisible by tp. Use tp in "
                    f"{[d for d in range(1, w + 1) if w % d == 0]} or start more ranks."
                )
            dp = self.dp if self.dp is not None else w // (self.tp * self.pp)
            if self.tp * self.pp * dp != w:
                raise ValueError(f"tp({self.tp}) * pp({self.pp}) * dp({dp}) = {self.tp * self.pp * dp}, "
                                 f"but the world size is {w}. Fix: choose tp * pp * dp = {w}")

    @property
    def data_parallel(self) -> int:
        if self.dp is not None:
            return self.dp
        if self.world_size is not None:
            return self.world_size // (self.tp * self.pp)
        return 1

    @property
    def mesh(self) -> MeshShape:
        return MeshShape(self.tp, self.pp, self.data_parallel)
