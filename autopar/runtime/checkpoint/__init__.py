"""Training state saved and restored in any layout.

``Checkpointer`` (``checkpointer.py``) saves and loads one step: the model's
state (``model_state``), the optimizer's, plain (``optimizer_state``) or
sharded by the distributed optimizer (``sharded_optimizer_state``), through
torch.distributed.checkpoint with pieces of shards (``dcp``). The step
directory and its description, ``autopar.json``, are written and read by
``description`` alone; ``checks`` compares a checkpoint with the program
before anything is loaded.

``Checkpointer`` and ``SaveHandle`` load on first use: a module that needs only
the errors (the HuggingFace reader and export) does not bring in
torch.distributed.checkpoint and DTensor, a second of start-up in a fresh process.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from autopar.runtime.checkpoint.errors import CheckpointError

if TYPE_CHECKING:
    from autopar.runtime.checkpoint.checkpointer import Checkpointer, SaveHandle

__all__ = ["Checkpointer", "SaveHandle", "CheckpointError"]


def __getattr__(name: str) -> Any:
    if name in ("Checkpointer", "SaveHandle"):
        from autopar.runtime.checkpoint import checkpointer

        return getattr(checkpointer, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
