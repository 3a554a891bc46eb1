"""``Checkpointed``: a module run under activation recomputation, and what it keeps.

The recompute pass wraps chunks or layers in it at compile time; the runtime
runs them. Under ``torch.utils.checkpoint`` (non-reentrant) only the wrapped
module's inputs stay alive between the forward and the backward; the
recomputed forward replays the same ops, collectives included, under the same
RNG and autocast state. What it keeps is counted where autograd saves it (the
engine's saved-tensor hooks).

Traced by ``torch.compile`` (compiled chunks) the region is a checkpoint
inside the compiled graph: its backward recomputes it, and the bytes kept are
those the compiled function saves, counted like any other saved tensor.

Inside a ``SavedTensorStore`` recording (``core/saved_tensors.py``: a backward
split into input and weight gradients) the region is the store's instead: the
same inputs kept, the same replay, but replayed once for both halves.
"""

from __future__ import annotations

import torch
import torch.nn as nn
from torch.utils.checkpoint import checkpoint

from autopar.core.saved_tensors import recording_store

__all__ = ["Checkpointed"]


class Checkpointed(nn.Module):
    """Runs ``inner`` under a non-reentrant checkpoint; ``label`` says what it is (``layer 3``)."""

    def __init__(self, inner: nn.Module, label: str = ""):
        super().__init__()
        self.inner = inner
        self.label = label

    def forward(self, *args):
        if torch.compiler.is_compiling():  # traced whole: the compiled backward recomputes the region
            return checkpoint(self.inner, *args, use_reentrant=False)
        store = recording_store()
        if store is not None and torch.is_grad_enabled():
            return store.checkpoint(self.inner, *args)
        return checkpoint(self.inner, *args, use_reentrant=False)
