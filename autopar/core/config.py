"""``ParallelConfig``: the layout and training options of a program, validated up front.

Every check here runs before anything is traced or any process starts, and
its message shows the numbers and the fix ("tp(2) * pp(2) * dp(3) = 12, but
the world size is 8").
"""

from __future__ import annotations

from dataclasses import dataclass

from enum import Enum

from autopar.core.mesh import MeshShape

__all__ = ["ParallelConfig", "Recompute", "RECOMPUTE", "PRECISIONS", "SCHEDULE_NAMES", "microbatch_errors", "size_errors",
           "optimizer_bytes_per_param"]


class Recompute(str, Enum):
    """Activation recomputation, one vocabulary for the compiler, the runtime and the cost model."""

    NONE = "none"
    """Keep every activation between a microbatch's forward and its backward."""
    LAYER = "layer"
    """Keep each layer's input; recompute the layer in the backward (Megatron's full recomputation)."""
    CHUNK = "chunk"
    """Keep each pipeline chunk's input; recompute the whole chunk in the backward."""

    def __str__(self) -> str:
        return self.value


RECOMPUTE: tuple[str, ...] = tuple(r.value for r in Recompute)
PRECISIONS: tuple[str, ...] = ("fp32", "bf16")
SCHEDULE_NAMES: tuple[str, ...] = ("gpipe", "1f1b", "interleaved")
"""Pipeline schedules the generators know (``autopar.schedules.generate``)."""


def size_errors(**sizes: int) -> list[str]:
    """Each of ``sizes`` that is not a positive integer, with the fix."""
    return [f"{key} must be a positive integer, got {key}={value!r}; use {key} >= 1"
            for key, value in sizes.items() if not isinstance(value, int) or value < 1]


def microbatch_errors(schedule: str, p: int, v: int, m: int, names: tuple[str, str, str] = ("p", "v", "m")) -> list[str]:
    """Every rule of ``schedule`` that (p, v, m) breaks, each with its numbers and the fix.

    The one statement of the microbatch rules: 1F1B and interleaved 1F1B need
    m >= p (the pipeline must fill); interleaved 1F1B needs m % p == 0
    (Megatron's rule); 1F1B runs one chunk per stage; GPipe takes any m.
    ``names``: what the caller calls p, v and m (``("pp", "virtual_stages",
    "microbatches")`` for ``parallelize``), so the message speaks its words.
    """
    P, V, M = names
    errs = size_errors(**{P: p, V: v, M: m})
    if errs:
        return errs
    if schedule not in SCHEDULE_NAMES:
        return [f"unknown schedule {schedule!r}; known: {', '.join(SCHEDULE_NAMES)}"]
    if schedule == "1f1b" and v != 1:
        errs.append(f"1f1b runs one chunk per stage, got {V}={v}; use {V}=1, or 'interleaved' for {V} > 1")
    if schedule in ("1f1b", "interleaved") and p > 1 and m < p:
        errs.append(f"{schedule} needs at least one microbatch per stage: {M}={m} < {P}={p}. Use {M} >= {p} "
                    f"(more microbatches also shrink the bubble (p-1)/m), or 'gpipe', which accepts any {M}")
    if schedule == "interleaved" and m % p:
        below, above = (m // p) * p, (m // p + 1) * p
        fix = f"{M}={above}" if below == 0 else f"{M}={below} or {M}={above}"
        errs.append(f"interleaved 1F1B needs {M} to be a multiple of {P} (Megatron's rule): "
                    f"{M}={m}, {P}={p}, {M} % {P} = {m % p}. Use {fix}")
    return errs


def optimizer_bytes_per_param(param_bytes: int) -> int:
    """Adam's state per parameter: moments m and v in fp32 (8 bytes), plus an fp32 master
    copy (4 more) when the parameters themselves are 16-bit (``param_bytes`` < 4: mixed
    precision, 12 bytes). autopar's 'bf16' precision autocasts fp32 parameters: 8 bytes."""
    return 8 if param_bytes >= 4 else 12


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
    recompute: Recompute | str = Recompute.NONE
    """Activation recomputation: 'none', 'layer' (keep each layer's input) or 'chunk' (each chunk's input)."""
    precision: str = "fp32"
    """'fp32', or 'bf16': bf16 autocast with fp32 parameters, gradients and gradient reduction."""

    def __post_init__(self):
        if self.recompute not in RECOMPUTE:
            raise ValueError(f"recompute must be one of {list(RECOMPUTE)}, got {self.recompute!r}")
        object.__setattr__(self, "recompute", Recompute(self.recompute))
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
        errs = microbatch_errors(self.schedule, self.pp, self.virtual_stages, self.microbatches,
                                 names=("pp", "virtual_stages", "microbatches"))
        if errs:
            raise ValueError("; ".join(errs))
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
