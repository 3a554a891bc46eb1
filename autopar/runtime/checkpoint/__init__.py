"""Training state saved and restored in any layout.

``Checkpointer`` (``checkpointer.py``) saves and loads one step: the model's
state (``model_state``), the optimizer's, plain (``optimizer_state``) or
sharded by the distributed optimizer (``sharded_optimizer_state``), through
torch.distributed.checkpoint with pieces of shards (``dcp``). The step
directory and its description, ``autopar.json``, are written and read by
``description`` alone; ``checks`` compares a checkpoint with the program
before anything is loaded.
"""

from autopar.runtime.checkpoint.checkpointer import Checkpointer, SaveHandle
from autopar.runtime.checkpoint.errors import CheckpointError

__all__ = ["Checkpointer", "SaveHandle", "CheckpointError"]
