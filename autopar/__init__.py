"""autopar: compile any PyTorch model into Megatron-style parallel training programs.

The package is light to import: each public name below is loaded on first use
(``autopar.parallelize`` brings in the compiler, ``autopar.plan`` the planner
and sympy), so ``import autopar`` or ``import passes.<any>`` costs little.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__all__ = [
    "parallelize",
    "plan",
    "ParallelProgram",
    "ParallelConfig",
    "ShardingError",
    "PipelineError",
    "RecomputeError",
    "TraceError",
    "RankError",
    "spawn",
    "restart_count",
    "lm_cross_entropy",
    "init_weights",
    "InitError",
    "CheckpointError",
    "BatchError",
    "ActionError",
    "EngineFailedError",
    "AutoparError",
    "ConfigError",
    "MeshError",
    "ArgumentError",
    "ProgramError",
    "ModelStateError",
    "RuleError",
    "ReplayError",
    "ScheduleError",
    "PlanError",
    "CheckpointNotFoundError",
    "ExportError",
    "WeightsError",
    "OptimizerError",
    "EngineUsageError",
    "EngineRuntimeError",
    "NonFiniteError",
]

_WHERE = {
    "parallelize": "autopar.api",
    "plan": "autopar.api",
    "ParallelProgram": "autopar.api",
    "ParallelConfig": "autopar.core.config",
    "ShardingError": "passes.sharding",
    "PipelineError": "passes.pipeline_split",
    "RecomputeError": "passes.recompute",
    "TraceError": "autopar.compiler.trace",
    "lm_cross_entropy": "autopar.compiler.trace",
    "RankError": "autopar.runtime.launch",
    "spawn": "autopar.runtime.launch",
    "restart_count": "autopar.runtime.launch",
    "init_weights": "autopar.runtime.weights.initialize",
    "InitError": "autopar.runtime.weights.module_init",
    "CheckpointError": "autopar.runtime.checkpoint.errors",
    "BatchError": "autopar.runtime.engine.batch_checks",
    "ActionError": "autopar.runtime.engine.errors",
    "EngineFailedError": "autopar.runtime.engine.failure_board",
    "AutoparError": "autopar.core.errors",
    "ConfigError": "autopar.core.errors",
    "MeshError": "autopar.core.mesh",
    "ArgumentError": "autopar.api",
    "ProgramError": "autopar.compiler.program",
    "ModelStateError": "autopar.compiler.state_keys",
    "RuleError": "passes.rules.registry",
    "ReplayError": "autopar.core.saved_tensors",
    "ScheduleError": "autopar.schedules.errors",
    "PlanError": "autopar.planning.errors",
    "CheckpointNotFoundError": "autopar.runtime.checkpoint.errors",
    "ExportError": "autopar.runtime.hf.errors",
    "WeightsError": "autopar.runtime.weights.weight_plan",
    "OptimizerError": "autopar.runtime.optim.errors",
    "EngineUsageError": "autopar.runtime.engine.errors",
    "EngineRuntimeError": "autopar.runtime.engine.errors",
    "NonFiniteError": "autopar.runtime.engine.errors",
}

if TYPE_CHECKING:
    from autopar.api import ArgumentError, ParallelProgram, parallelize, plan
    from autopar.compiler.program import ProgramError
    from autopar.compiler.state_keys import ModelStateError
    from autopar.compiler.trace import TraceError, lm_cross_entropy
    from autopar.core.config import ParallelConfig
    from autopar.core.errors import AutoparError, ConfigError
    from autopar.core.mesh import MeshError
    from autopar.core.saved_tensors import ReplayError
    from autopar.planning.errors import PlanError
    from autopar.runtime.checkpoint.errors import CheckpointError, CheckpointNotFoundError
    from autopar.runtime.engine.batch_checks import BatchError
    from autopar.runtime.engine.errors import ActionError, EngineRuntimeError, EngineUsageError, NonFiniteError
    from autopar.runtime.engine.failure_board import EngineFailedError
    from autopar.runtime.hf.errors import ExportError
    from autopar.runtime.launch import RankError, restart_count, spawn
    from autopar.runtime.optim.errors import OptimizerError
    from autopar.runtime.weights.initialize import init_weights
    from autopar.runtime.weights.module_init import InitError
    from autopar.runtime.weights.weight_plan import WeightsError
    from autopar.schedules.errors import ScheduleError
    from passes.pipeline_split import PipelineError
    from passes.recompute import RecomputeError
    from passes.rules.registry import RuleError
    from passes.sharding import ShardingError


def __getattr__(name: str) -> Any:
    if name not in _WHERE:
        raise AttributeError(f"module 'autopar' has no attribute {name!r}")
    value = getattr(importlib.import_module(_WHERE[name]), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(list(globals()) + __all__)
