"""The engine: one rank's step loop over its schedule's actions.

``RankEngine`` (``engine.py``) runs a step: it splits the batch into
micro-batches (``micro_batches``), makes the step's state (``step_state``),
runs each action through its handler (forward, backward, weight backward:
``compute``; sends and receives: ``p2p``), reduces the loss and syncs the
gradients. Around it: the rank's shards and buffers (``holdings``), its random
stream (``random_streams``), the batch's checks (``batch_checks``), the loss
weights of the micro-batches (``loss_weights``), the outputs an evaluation
returns (``eval_outputs``), whether a step's numbers were finite and the skip
policy (``step_health``), failing together (``step_failures``: a failed
action as one error on every rank, published on the store by ``failure_board``), the errors (``errors``), the step's timeline (``timeline``), devices a
chunk may not touch (``device_graphs``), and the making of a rank's engine from
a compiled program (``materialize``).
"""

from autopar.runtime.engine.batch_checks import BatchError
from autopar.runtime.engine.engine import RankEngine
from autopar.runtime.engine.errors import ActionError, EngineRuntimeError, EngineUsageError, NonFiniteError
from autopar.runtime.engine.failure_board import EngineFailedError
from autopar.runtime.engine.holdings import rank_device
from autopar.runtime.engine.step_health import StepHealth
from autopar.runtime.engine.step_state import StepState

__all__ = ["RankEngine", "StepState", "ActionError", "EngineFailedError", "EngineUsageError", "EngineRuntimeError",
           "BatchError", "NonFiniteError", "StepHealth", "rank_device"]
