"""autopar: compile any PyTorch model into Megatron-style parallel training programs."""

from autopar.api import ParallelConfig, ParallelProgram, ShardingError, lm_cross_entropy, parallelize
from autopar.launch import RankError, spawn
from autopar.planner import plan
from autopar.trace import TraceError

__all__ = [
    "parallelize",
    "plan",
    "ParallelProgram",
    "ParallelConfig",
    "ShardingError",
    "TraceError",
    "RankError",
    "spawn",
    "lm_cross_entropy",
]
