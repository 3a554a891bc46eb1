"""The engine: one rank's step loop over its schedule's actions.

``RankEngine`` (``engine.py``) runs a step: it splits the batch into
micro-batches, runs each action (forward, backward, weight backward, sends
and receives) through its handler, reduces the loss and syncs the gradients.
Around it: the batch's checks (``batch_checks``), the loss weights of the
micro-batches (``loss_weights``), the outputs an evaluation returns
(``eval_outputs``), failing together (``failures``), the step's timeline
(``timeline``), devices a chunk may not touch (``device_graphs``), and the
making of a rank's engine from a compiled program (``materialize``).
"""

from autopar.runtime.engine.batch_checks import BatchError
from autopar.runtime.engine.engine import ActionError, RankEngine, StepState, rank_device
from autopar.runtime.engine.failures import EngineFailedError

__all__ = ["RankEngine", "StepState", "ActionError", "EngineFailedError", "BatchError", "rank_device"]
