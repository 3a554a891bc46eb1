"""The performance model's public names in one place (``from autopar.planning.cost import ...``).

The model lives in one file per job; this module only re-exports them:

- ``models.py``: ``ModelSpec``, the paper's presets, parameter counts;
- ``op_costs.py``: one kernel's FLOPs and HBM bytes from its shapes (``Op``);
- ``transformer.py``: a layer, the embedding and the LM head as lists of Ops; FLOPs of an iteration;
- ``op_times.py``: seconds of an Op (roofline) and of a layer's phases;
- ``network.py``: all-reduce, all-gather and point-to-point times, and which link a group uses;
- ``layout.py``: ``Cluster``, ``Layout`` and the rules a layout must keep;
- ``memory.py``: memory per GPU on the fullest stage;
- ``estimate.py``: ``estimate``, one iteration's time, throughput and memory;
- ``simulate.py``: a layout's costs as inputs of the schedule simulator;
- ``calibration.py``: the paper's runs and the fit of the two free constants;
- ``formulas.py``: the paper's closed forms in sympy, and ``explain`` (the only user of sympy).

Importing this module loads all of them, sympy included; import from the files
themselves to load less.
"""

from __future__ import annotations

from autopar.planning.calibration import PAPER_RUNS, PaperRun, fit_efficiency
from autopar.planning.estimate import (
    DDP_BUCKET_BYTES,
    OPTIMIZER_STEP_TRAFFIC_PER_PARAM,
    SIMULATION_LIMIT,
    Estimate,
    estimate,
    simulate_estimate,
)
from autopar.planning.formulas import FORMULAS, Explained, explain
from autopar.planning.layout import Cluster, Layout, layout_errors
from autopar.planning.memory import Memory, activation_bytes_per_layer, layer_backward_transient, memory_per_gpu
from autopar.planning.models import PRESETS, ModelSpec, get_model, param_count, params_per_stage
from autopar.planning.network import allgather_time, allreduce_time, p2p_time
from autopar.planning.op_costs import (
    Op,
    attention_bytes,
    attention_flops,
    cross_entropy_bytes,
    cross_entropy_flops,
    elementwise_bytes,
    layernorm_bytes,
    layernorm_flops,
    linear_bytes,
    linear_flops,
    matmul_bytes,
    matmul_flops,
    softmax_bytes,
    softmax_flops,
)
from autopar.planning.op_times import gemm_efficiency, op_time
from autopar.planning.transformer import (
    PhaseOps,
    embedding_ops,
    graph_flops,
    head_ops,
    iteration_flops,
    layer_ops,
    paper_flops,
)
from autopar.schedules import in_flight_bound as inflight_units

__all__ = [
    "ModelSpec", "PRESETS", "get_model", "Op", "Layout", "Cluster", "Estimate", "Memory",
    "PaperRun", "PAPER_RUNS", "fit_efficiency", "iteration_flops",
    "linear_flops", "linear_bytes", "matmul_flops", "matmul_bytes", "attention_flops",
    "attention_bytes", "elementwise_bytes", "layernorm_flops", "layernorm_bytes",
    "softmax_flops", "softmax_bytes", "cross_entropy_flops", "cross_entropy_bytes",
    "gemm_efficiency", "op_time", "allreduce_time", "allgather_time", "p2p_time",
    "PhaseOps", "layer_ops", "embedding_ops", "head_ops", "graph_flops", "paper_flops", "param_count",
    "SIMULATION_LIMIT", "Explained", "params_per_stage", "layout_errors", "estimate", "memory_per_gpu",
    "activation_bytes_per_layer", "layer_backward_transient",
    "inflight_units", "FORMULAS", "explain", "simulate_estimate", "OPTIMIZER_STEP_TRAFFIC_PER_PARAM",
    "DDP_BUCKET_BYTES",
]
