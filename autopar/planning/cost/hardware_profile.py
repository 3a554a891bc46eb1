"""The hardware profile ``autopar tune`` writes: a versioned JSON file of what the machines in hand
measured, read back as the planner's ``Hardware``.

The file (``docs/hardware-profile.md`` lists every field)::

    {"autopar_hardware_profile": 5,
     "device": {"kind": "cuda", "name": "NVIDIA H200", "per_node": 8, "nodes": 2, "memory_bytes": ..., "sm_count": 132},
     "gemm": [{"dtype": "bf16", "name": "fc1 t=1", "batch": 1, "m": 2048, "n": 4096, "k": 1024,
               "flops_per_s": ..., "seconds": ...}, ...],
     "memory_bw_bytes_per_s": ..., "eager_op_s": ..., "compiled_call_s": null,
     "runtime": {"step_s": ..., "node_s": ..., ...} or null,
     "layers": [{"signature": "h128 a4 kv4 f512 s64", "nodes": 20, "micro_batch": 1, "tp": 1,
                 "sequence_parallel": false, "seconds": ..., "recompute_seconds": ..., "split_seconds": ...,
                 "steps": [], "microbatches": 0}, ...],
     "data_parallel": [{"signature": ..., "params": ..., "sync_seconds": ..., ...}],
     "pipeline": [{"signature": ..., "micro_batch": 1, "one_f_one_b_seconds": ..., "interleaved_seconds": ...}],
     "collectives": [{"op": "all_reduce", "ranks": 2, "placement": "intra", "alpha_s": ..., "beta_bytes_per_s": ...,
                      "sizes_bytes": [...], "seconds": [...]}, ...],
     "sources": {"gemm": "torch.matmul, median of ...", ...},
     "tune_flags": "--model gpt-1.7b --micro-batch 1", "created": "...", "torch": "2.13.0"}

``load_profile`` checks the version and every field (``ProfileVersionError``, ``ProfileFieldError``);
``to_hardware`` turns a profile into the ``Hardware`` the cost model prices with: GEMMs at the
measured rate of the nearest shape, memory-bound kernels at the measured bandwidth plus the eager
per-op overhead, collectives by their fits (``network.measured_link``, which refuses a group the
profile lacks: ``ProfileCoverageError``). ``fit_alpha_beta`` fits a collective's timings.

The cost model counts 2-byte elements (``op_costs.FP16``). A profile priced for fp32 runs (``dtype``
``fp32``, the default on a CPU) halves its memory and link bandwidths, so that a 2-byte count takes the
time its 4-byte tensors take; GEMMs are priced by FLOPs at the dtype's measured rate.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from autopar.core.collectives import ALL_REDUCE, wire_factor
from autopar.planning.cost.hardware import (
    LINK_OPS,
    PLACEMENTS,
    PROFILES,
    Efficiency,
    Hardware,
    MeasuredDataParallel,
    MeasuredPipeline,
    MeasuredGemm,
    MeasuredLayer,
    MeasuredLink,
    RuntimeOverheads,
    get_hardware,
)
from autopar.planning.errors import ProfileFieldError, ProfileVersionError

__all__ = ["PROFILE_VERSION", "VERSION_KEY", "GemmFigure", "LinkFigure", "HardwareProfile", "fit_alpha_beta",
           "load_profile", "write_profile", "to_hardware", "load_hardware", "resolve_hardware", "nearest_preset",
           "DTYPE_BYTES"]

PROFILE_VERSION = 5
"""The format version this autopar writes and reads (5: the steps a layer at t > 1 is fitted to,
``layers[].steps``; 4: the model's pipeline, ``pipeline``; 3: the model's
layers measured on the engine, ``layers``, its data-parallel side, ``data_parallel``, a multi-rank step's own
cost, ``runtime.world_step_s``, and the distributed optimizer's, ``runtime.distopt_step_s``; 2 added the
runtime's own overheads, ``runtime``, and the runtime's tensor-parallel all-reduce, ``tp_all_reduce``)."""

VERSION_KEY = "autopar_hardware_profile"
"""The key holding the version: it also marks a JSON file as a profile."""

DTYPE_BYTES: dict[str, int] = {"fp32": 4, "bf16": 2, "fp16": 2}
"""Bytes of an element of each dtype a profile may measure GEMMs in."""


@dataclass(frozen=True)
class GemmFigure:
    """One GEMM shape as measured: C (batch, M, N) = A (batch, M, K) B (batch, K, N) in ``dtype``."""

    dtype: str
    name: str
    """Which of the model's GEMMs it is (``fc1 t=2``: fc1 at tensor-parallel degree 2)."""
    batch: int
    m: int
    n: int
    k: int
    flops_per_s: float
    seconds: float
    """Median seconds of one product."""


@dataclass(frozen=True)
class LinkFigure:
    """One collective as measured over a group: the timed sizes and the fit time = alpha + bytes / beta."""

    op: str
    """One of ``hardware.LINK_OPS``."""
    ranks: int
    placement: str
    """``intra`` (the group inside one node) or ``inter`` (across nodes)."""
    alpha_s: float
    beta_bytes_per_s: float
    sizes_bytes: tuple[int, ...]
    seconds: tuple[float, ...]
    """Median seconds of one call at each size."""


@dataclass(frozen=True)
class HardwareProfile:
    """What ``autopar tune`` measured (one JSON file)."""

    device_kind: str
    """``cuda`` or ``cpu``."""
    device_name: str
    devices_per_node: int
    """Ranks on one node (``LOCAL_WORLD_SIZE`` when tuned): a planned group of at most this many is intra-node."""
    nodes: int
    memory_bytes: float
    """Memory of one device (a CPU rank: the machine's memory over its ranks)."""
    gemm: tuple[GemmFigure, ...]
    memory_bw: float
    """Bytes/s a large copy moves (read + write)."""
    eager_op_s: float
    """Seconds of a tiny eager op: the per-kernel overhead of an op-by-op chunk."""
    collectives: tuple[LinkFigure, ...]
    compiled_call_s: float | None = None
    """Seconds of a call of a tiny compiled function (``autopar tune --compiled``), or None."""
    runtime: dict[str, float] | None = None
    """The runtime's own overheads (``hardware.RuntimeOverheads``' fields), or None when not measured."""
    sm_count: int = 1
    layers: tuple[MeasuredLayer, ...] = ()
    """The model's layers timed on the engine (``cli/tune_layers.py``); empty when not measured."""
    data_parallel: tuple[MeasuredDataParallel, ...] = ()
    """The model's data-parallel side timed on the engine; empty when not measured."""
    pipeline: tuple[MeasuredPipeline, ...] = ()
    """The model's pipeline timed on the engine, in each schedule; empty when not measured."""
    sources: dict[str, str] = field(default_factory=dict)
    """Where each number came from, in words, by section."""
    tune_flags: str = ""
    """The flags ``autopar tune`` ran with (the model, micro-batch, output), to measure more alike."""
    created: str = ""
    torch: str = ""

    @property
    def world(self) -> int:
        return self.devices_per_node * self.nodes

    def dtypes(self) -> list[str]:
        return list(dict.fromkeys(g.dtype for g in self.gemm))

    def as_json(self) -> dict[str, Any]:
        return {
            VERSION_KEY: PROFILE_VERSION,
            "created": self.created, "torch": self.torch, "tune_flags": self.tune_flags,
            "device": {"kind": self.device_kind, "name": self.device_name, "per_node": self.devices_per_node,
                       "nodes": self.nodes, "memory_bytes": self.memory_bytes, "sm_count": self.sm_count},
            "gemm": [{"dtype": g.dtype, "name": g.name, "batch": g.batch, "m": g.m, "n": g.n, "k": g.k,
                      "flops_per_s": g.flops_per_s, "seconds": g.seconds} for g in self.gemm],
            "memory_bw_bytes_per_s": self.memory_bw,
            "eager_op_s": self.eager_op_s,
            "compiled_call_s": self.compiled_call_s,
            "runtime": None if self.runtime is None else dict(self.runtime),
            "layers": [dataclasses.asdict(x) for x in self.layers],
            "data_parallel": [dataclasses.asdict(x) for x in self.data_parallel],
            "pipeline": [dataclasses.asdict(x) for x in self.pipeline],
            "collectives": [{"op": c.op, "ranks": c.ranks, "placement": c.placement, "alpha_s": c.alpha_s,
                             "beta_bytes_per_s": c.beta_bytes_per_s, "sizes_bytes": list(c.sizes_bytes),
                             "seconds": list(c.seconds)} for c in self.collectives],
            "sources": dict(self.sources),
        }


def fit_alpha_beta(sizes: list[float] | tuple[float, ...], seconds: list[float] | tuple[float, ...]) -> tuple[float, float]:
    """(alpha seconds, beta bytes/s) of time = alpha + bytes / beta, by least squares on the relative
    error (each timing weighted by 1 / time^2, so the small sizes set alpha and the large ones beta).

    Noise can make the fitted intercept negative (then the line goes through the origin) or the slope
    non-positive (then the sizes cost nothing measurable: beta = inf is reported as 1e18 B/s)."""
    n = len(sizes)
    if n != len(seconds) or n < 2 or min(seconds) <= 0:
        raise ProfileFieldError(f"fitting a collective needs two or more timed sizes with positive times, got "
                                f"sizes {list(sizes)} and times {list(seconds)}")
    w = [1 / y**2 for y in seconds]
    sw = sum(w)
    sx, sy = sum(wi * x for wi, x in zip(w, sizes)), sum(wi * y for wi, y in zip(w, seconds))
    sxx = sum(wi * x * x for wi, x in zip(w, sizes))
    sxy = sum(wi * x * y for wi, x, y in zip(w, sizes, seconds))
    det = sw * sxx - sx * sx
    slope = (sw * sxy - sx * sy) / det if det else 0.0
    alpha = (sy - slope * sx) / sw
    if alpha < 0:
        alpha, slope = 0.0, sxy / sxx
    return alpha, (1.0 / slope if slope > 0 else 1e18)


# ------------------------------------------------------------------------------------------ reading


def _get(d: dict, key: str, kind: type | tuple[type, ...], where: str, path: str) -> Any:
    if not isinstance(d, dict) or key not in d:
        raise ProfileFieldError(f"hardware profile {path}: {where}{key} is missing; the file is incomplete or "
                                f"hand-edited: measure it again with `autopar tune` (docs/hardware-profile.md lists "
                                f"the fields)")
    value = d[key]
    if kind is float:
        kind = (int, float)
    if not isinstance(value, kind) or (isinstance(value, bool) and kind is not bool):
        raise ProfileFieldError(f"hardware profile {path}: {where}{key} is {value!r}, not a "
                                f"{getattr(kind, '__name__', 'number')}")
    return value


def _positive(value: float, name: str, path: str) -> float:
    if not value > 0:
        raise ProfileFieldError(f"hardware profile {path}: {name} must be positive, got {value!r}")
    return float(value)


def _non_negative(value: float, name: str, path: str) -> float:
    if value < 0:
        raise ProfileFieldError(f"hardware profile {path}: {name} must not be negative, got {value!r}")
    return float(value)


def _gemm(d: dict, i: int, path: str) -> GemmFigure:
    w = f"gemm[{i}]."
    dtype = _get(d, "dtype", str, w, path)
    if dtype not in DTYPE_BYTES:
        raise ProfileFieldError(f"hardware profile {path}: {w}dtype is {dtype!r}; known: {sorted(DTYPE_BYTES)}")
    dims = [_get(d, k, int, w, path) for k in ("batch", "m", "n", "k")]
    return GemmFigure(dtype, d.get("name", ""), *dims,
                      flops_per_s=_positive(_get(d, "flops_per_s", float, w, path), f"{w}flops_per_s", path),
                      seconds=float(_get(d, "seconds", float, w, path)))


def _link(d: dict, i: int, path: str) -> LinkFigure:
    w = f"collectives[{i}]."
    op, placement = _get(d, "op", str, w, path), _get(d, "placement", str, w, path)
    if op not in LINK_OPS:
        raise ProfileFieldError(f"hardware profile {path}: {w}op is {op!r}; known: {', '.join(LINK_OPS)}")
    if placement not in PLACEMENTS:
        raise ProfileFieldError(f"hardware profile {path}: {w}placement is {placement!r}; known: "
                                f"{', '.join(PLACEMENTS)}")
    return LinkFigure(op, _get(d, "ranks", int, w, path), placement,
                      alpha_s=float(_get(d, "alpha_s", float, w, path)),
                      beta_bytes_per_s=_positive(_get(d, "beta_bytes_per_s", float, w, path),
                                                 f"{w}beta_bytes_per_s", path),
                      sizes_bytes=tuple(_get(d, "sizes_bytes", list, w, path)),
                      seconds=tuple(_get(d, "seconds", list, w, path)))


RUNTIME_FIELDS: tuple[str, ...] = ("step_s", "action_s", "node_s", "checkpoint_s", "optimizer_per_param_s",
                                    "send_s", "split_node_s", "split_pipeline_s", "tp_collective_s", "world_step_s", "distopt_step_s",
                                    "layer_nodes",
                                    "end_nodes")
"""The fields of a profile's ``runtime`` section (``hardware.RuntimeOverheads``)."""


def _runtime(d: Any, path: str) -> dict[str, float] | None:
    if d is None:
        return None
    values = {k: _get(d, k, float, "runtime.", path) for k in RUNTIME_FIELDS}
    for k in RUNTIME_FIELDS:
        if values[k] < 0:
            raise ProfileFieldError(f"hardware profile {path}: runtime.{k} must not be negative, got {values[k]!r}")
    return values


def _layer(d: dict, i: int, path: str) -> MeasuredLayer:
    w = f"layers[{i}]."
    return MeasuredLayer(signature=_get(d, "signature", str, w, path), nodes=_get(d, "nodes", int, w, path),
                         micro_batch=_get(d, "micro_batch", int, w, path), tp=_get(d, "tp", int, w, path),
                         sequence_parallel=_get(d, "sequence_parallel", bool, w, path),
                         seconds=_positive(_get(d, "seconds", float, w, path), f"{w}seconds", path),
                         recompute_seconds=_non_negative(_get(d, "recompute_seconds", float, w, path),
                                                         f"{w}recompute_seconds", path),
                         split_seconds=_non_negative(_get(d, "split_seconds", float, w, path), f"{w}split_seconds",
                                                     path),
                         steps=_steps(_get(d, "steps", list, w, path), f"{w}steps", path),
                         microbatches=_microbatches(d, w, path))


def _microbatches(d: dict, where: str, path: str) -> int:
    """A layer's ``microbatches``: at least 1 where it has steps (they are steps of that many)."""
    value = _get(d, "microbatches", int, where, path)
    if d.get("steps") and value < 1:
        raise ProfileFieldError(f"hardware profile {path}: {where}microbatches is {value}, but {where}steps holds "
                                f"steps: say how many microbatches each ran (autopar tune writes 4)")
    return value


def _steps(value: list, name: str, path: str) -> tuple[tuple[int, float], ...]:
    """A layer's measured steps: [layers, seconds] pairs, positive."""
    pairs = []
    for pair in value:
        if (not isinstance(pair, list) or len(pair) != 2 or not isinstance(pair[0], int)
                or not isinstance(pair[1], (int, float)) or isinstance(pair[1], bool) or not pair[1] > 0):
            raise ProfileFieldError(f"hardware profile {path}: {name} holds {pair!r}, not a [layers, seconds] pair "
                                    f"of a positive step time")
        pairs.append((pair[0], float(pair[1])))
    return tuple(pairs)


def _data_parallel(d: dict, i: int, path: str) -> MeasuredDataParallel:
    w = f"data_parallel[{i}]."
    return MeasuredDataParallel(
        signature=_get(d, "signature", str, w, path), nodes=_get(d, "nodes", int, w, path),
        params=_get(d, "params", int, w, path),
        **{k: _positive(_get(d, k, float, w, path), f"{w}{k}", path)
           for k in ("sync_seconds", "optimizer_seconds", "distopt_seconds")})


def _pipeline(d: dict, i: int, path: str) -> MeasuredPipeline:
    w = f"pipeline[{i}]."
    return MeasuredPipeline(
        signature=_get(d, "signature", str, w, path), nodes=_get(d, "nodes", int, w, path),
        micro_batch=_get(d, "micro_batch", int, w, path),
        **{k: _positive(_get(d, k, float, w, path), f"{w}{k}", path)
           for k in ("one_f_one_b_seconds", "interleaved_seconds", "zb_h1_seconds", "zbv_seconds")})


def profile_from_json(data: Any, path: str = "<json>") -> HardwareProfile:
    """The profile in ``data`` (a parsed JSON file), every field checked."""
    if not isinstance(data, dict) or VERSION_KEY not in data:
        raise ProfileVersionError(f"{path} is not an autopar hardware profile (no {VERSION_KEY!r} field); "
                                  f"write one with `autopar tune --out {path}`")
    version = data[VERSION_KEY]
    if version != PROFILE_VERSION:
        raise ProfileVersionError(f"hardware profile {path} is version {version!r}; this autopar reads version "
                                  f"{PROFILE_VERSION}: measure again with `autopar tune "
                                  f"{data.get('tune_flags') or '--model <the model>'}` (as launched before: "
                                  f"`autopar tune --nproc N ...` or torchrun)")
    dev = _get(data, "device", dict, "", path)
    gemm = tuple(_gemm(g, i, path) for i, g in enumerate(_get(data, "gemm", list, "", path)))
    if not gemm:
        raise ProfileFieldError(f"hardware profile {path}: gemm is empty; `autopar tune` measures at least one shape")
    compiled = data.get("compiled_call_s")
    runtime = _runtime(data.get("runtime"), path)
    return HardwareProfile(
        device_kind=_get(dev, "kind", str, "device.", path), device_name=_get(dev, "name", str, "device.", path),
        devices_per_node=_get(dev, "per_node", int, "device.", path), nodes=_get(dev, "nodes", int, "device.", path),
        memory_bytes=_positive(_get(dev, "memory_bytes", float, "device.", path), "device.memory_bytes", path),
        sm_count=int(dev.get("sm_count", 1)),
        gemm=gemm,
        memory_bw=_positive(_get(data, "memory_bw_bytes_per_s", float, "", path), "memory_bw_bytes_per_s", path),
        eager_op_s=float(_get(data, "eager_op_s", float, "", path)),
        compiled_call_s=None if compiled is None else float(compiled), runtime=runtime,
        layers=tuple(_layer(x, i, path) for i, x in enumerate(_get(data, "layers", list, "", path))),
        data_parallel=tuple(_data_parallel(x, i, path)
                            for i, x in enumerate(_get(data, "data_parallel", list, "", path))),
        pipeline=tuple(_pipeline(x, i, path) for i, x in enumerate(_get(data, "pipeline", list, "", path))),
        collectives=tuple(_link(c, i, path) for i, c in enumerate(_get(data, "collectives", list, "", path))),
        sources=dict(data.get("sources", {})), tune_flags=data.get("tune_flags", ""),
        created=data.get("created", ""), torch=data.get("torch", ""),
    )


def load_profile(path: str | Path) -> HardwareProfile:
    """The profile in the JSON file ``path``."""
    try:
        data = json.loads(Path(path).read_text())
    except FileNotFoundError:
        raise ProfileFieldError(f"no hardware profile at {path}: write one with `autopar tune --out {path}`") from None
    except json.JSONDecodeError as e:
        raise ProfileVersionError(f"{path} is not JSON ({e}); `autopar tune --out {path}` writes a profile") from e
    return profile_from_json(data, str(path))


def write_profile(profile: HardwareProfile, path: str | Path) -> None:
    Path(path).write_text(json.dumps(profile.as_json(), indent=1) + "\n")


# ------------------------------------------------------------------------------------- as Hardware


def _default_dtype(profile: HardwareProfile) -> str:
    """bf16 on a GPU that measured it (the planner prices mixed precision), else the first dtype measured."""
    dtypes = profile.dtypes()
    return "bf16" if profile.device_kind == "cuda" and "bf16" in dtypes else dtypes[0]


def _bus_bw(links: tuple[MeasuredLink, ...], placement: str) -> float:
    """The bus bandwidth of the largest group's all-reduce of ``placement`` (a point-to-point message's
    bandwidth when none), 0 when neither was measured."""
    reduces = [x for x in links if x.placement == placement and x.op == "all_reduce"]
    if reduces:
        big = max(reduces, key=lambda x: x.ranks)
        return wire_factor(ALL_REDUCE, big.ranks) * big.beta
    p2p = [x for x in links if x.placement == placement and x.op == "p2p"]
    return p2p[0].beta if p2p else 0.0


def _latency(links: tuple[MeasuredLink, ...], placement: str) -> float:
    p2p = [x.alpha for x in links if x.placement == placement and x.op == "p2p"]
    return p2p[0] if p2p else 0.0


def to_hardware(profile: HardwareProfile, name: str = "tuned", dtype: str | None = None) -> Hardware:
    """``profile`` as the planner's ``Hardware``, its GEMMs priced in ``dtype`` (default: bf16 on a
    GPU that measured it, else the dtype measured first); see the module's note on fp32."""
    dtype = dtype or _default_dtype(profile)
    gemms = tuple(MeasuredGemm(g.batch, g.m, g.n, g.k, g.flops_per_s) for g in profile.gemm if g.dtype == dtype)
    if not gemms:
        raise ProfileFieldError(f"hardware profile {name}: no GEMM measured in {dtype} (it has "
                                f"{', '.join(profile.dtypes())}); measure it with `autopar tune --dtypes {dtype} "
                                f"{profile.tune_flags}`")
    scale = 2 / DTYPE_BYTES[dtype]  # the model's 2-byte counts, priced at this dtype's bytes
    links = tuple(MeasuredLink(c.op, c.ranks, c.placement, c.alpha_s, c.beta_bytes_per_s * scale)
                  for c in profile.collectives)
    intra, inter = _bus_bw(links, "intra"), _bus_bw(links, "inter")
    return Hardware(
        name=name, gpu=profile.device_name, gpus_per_node=profile.devices_per_node,
        peak_flops=max(g.flops for g in gemms), hbm_bytes=profile.memory_bytes, hbm_bw=profile.memory_bw * scale,
        sm_count=profile.sm_count, nvlink_bw=intra or inter or 1.0, ib_bw=inter or intra or 1.0,
        nvlink_latency=_latency(links, "intra"), ib_latency=_latency(links, "inter"),
        nvlink_efficiency=1.0, ib_efficiency=1.0,
        eff=Efficiency(gemm=1.0, hbm=1.0, gemm_k_overhead=0.0, kernel_overhead=profile.eager_op_s),
        gemms=gemms, links=links, tuned=True,
        runtime=None if profile.runtime is None else RuntimeOverheads(
            **{k: (int(v) if k.endswith("nodes") else float(v)) for k, v in profile.runtime.items()}),
        layers=profile.layers, data_parallel=profile.data_parallel, pipeline=profile.pipeline, byte_scale=scale,
        links_measured_at=(intra or inter or 1.0, inter or intra or 1.0),
        tune_command=profile.tune_flags or f"--model <the model> --out {name}",
    )


def load_hardware(path: str | Path, dtype: str | None = None) -> Hardware:
    """The tuned profile in the JSON file ``path`` as the planner's ``Hardware``, named by its path."""
    return to_hardware(load_profile(path), name=str(path), dtype=dtype)


def resolve_hardware(hardware: str | Hardware) -> Hardware:
    """``hardware`` itself, the preset it names, or the tuned profile in the JSON file it names."""
    if isinstance(hardware, Hardware):
        return hardware
    if hardware not in PROFILES and (hardware.endswith(".json") or os.path.isfile(hardware)):
        return load_hardware(hardware)
    return get_hardware(hardware)


def nearest_preset(hw: Hardware) -> str:
    """The preset whose achieved GEMM rate, memory bandwidth and in-node bus bandwidth are closest to
    ``hw``'s (the sum of the absolute log ratios)."""

    def figures(h: Hardware) -> tuple[float, float, float]:
        return h.peak_flops * h.eff.gemm, h.hbm_bw * h.eff.hbm, h.nvlink_bw * h.nvlink_efficiency

    mine = figures(hw)
    return min(PROFILES, key=lambda k: sum(abs(math.log(a / b)) for a, b in zip(mine, figures(PROFILES[k]))))
