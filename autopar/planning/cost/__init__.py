"""The cost model: what one training step of a layout costs, in time and memory, before it runs.

One file per job:

- ``models.py``: ``ModelSpec``, the paper's presets, parameter counts;
- ``hardware.py``: node profiles (data-sheet facts) and the two fitted efficiencies;
- ``precision.py``: the bytes of a weight, a gradient, an activation (``Precision``);
- ``op_costs.py``: one kernel's FLOPs and HBM bytes from its shapes (``Op``);
- ``transformer.py``: a layer, the embedding and the LM head as lists of Ops; FLOPs of an iteration;
- ``op_times.py``: seconds of an Op (roofline) and of a layer's phases;
- ``network.py``: all-reduce, all-gather and point-to-point times, and which link a group uses;
- ``ring_costs.py``: context parallelism's ring attention: bytes per hop, the blocks' shares, what they hide;
- ``layout.py``: ``Cluster``, ``Layout`` and the rules a layout must keep;
- ``activations.py`` and ``memory.py``: activation bytes, and memory per GPU on the fullest stage;
- ``zero_bubble_costs.py``: the zero-bubble schedules' B/W split, idle time and held memory;
- ``pipeline_timeline.py``: a layout's per-chunk costs run through the schedule simulator;
- ``step_estimate.py``: ``estimate``, one iteration's time, throughput and memory;
- ``data_parallel_cost.py``: the gradient reduction over the replicas, the part the backward leaves exposed,
  and the optimizer step;
- ``step_timelines.py``: one layout's step as the planner's and as the runtime's timeline;
- ``calibration.py``: the paper's runs and the fit of the two free constants;
- ``formulas.py``: the paper's closed forms in sympy, and ``explain`` (the only user of sympy).

The public names of the model are importable from here (``from autopar.planning.cost import
estimate``), each loaded from its file on first use, so importing one file of the model (as the
compiler imports ``models.py``) loads neither the rest nor sympy.
"""

from __future__ import annotations

import importlib
from typing import Any

_HOMES: dict[str, tuple[str, ...]] = {
    "calibration": ("PAPER_RUNS", "PaperRun", "fit_efficiency"),
    "step_estimate": ("SIMULATION_LIMIT", "Estimate", "estimate"),
    "data_parallel_cost": ("DDP_BUCKET_BYTES", "OPTIMIZER_STEP_TRAFFIC_PER_PARAM"),
    "step_timelines": ("estimate_with_timeline",),
    "formulas": ("FORMULAS", "Explained", "explain"),
    "layout": ("Cluster", "Layout", "layout_errors"),
    "memory": ("Memory", "activation_bytes_per_layer", "layer_backward_transient", "memory_per_gpu"),
    "models": ("PRESETS", "MOE_PRESETS", "ModelSpec", "get_model", "param_count", "params_per_stage",
               "expert_params_per_rank", "expert_params_per_stage"),
    "network": ("allgather_time", "allreduce_time", "alltoall_time", "p2p_time"),
    "op_costs": ("Op", "attention_bytes", "attention_flops", "cross_entropy_bytes", "cross_entropy_flops",
                 "elementwise_bytes", "layernorm_bytes", "layernorm_flops", "linear_bytes", "linear_flops",
                 "matmul_bytes", "matmul_flops", "softmax_bytes", "softmax_flops"),
    "op_times": ("gemm_efficiency", "op_time"),
    "ring_costs": ("ring_traffic", "ring_exposed_time"),
    "transformer": ("PhaseOps", "embedding_ops", "graph_flops", "head_ops", "iteration_flops", "layer_ops",
                    "paper_flops"),
}
"""File of the cost model -> the public names it defines that this package offers."""

_WHERE = {name: f"autopar.planning.cost.{home}" for home, names in _HOMES.items() for name in names}
_ALIASES = {"inflight_units": ("autopar.schedules", "in_flight_bound")}
"""Names offered here under another name: the schedules' bound of microbatches in flight."""

__all__ = [*_WHERE, *_ALIASES]


def __getattr__(name: str) -> Any:
    if name in _WHERE:
        value = getattr(importlib.import_module(_WHERE[name]), name)
    elif name in _ALIASES:
        module, attr = _ALIASES[name]
        value = getattr(importlib.import_module(module), attr)
    else:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(list(globals()) + __all__)
