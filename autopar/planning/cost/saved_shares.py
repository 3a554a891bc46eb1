"""What a model keeps for its backward per token, as read from its graph (``compiler/saved_census.py``):
the shares of one layer, the embedding and the head, by how a tensor-parallel layout divides them.

A ``ModelSpec`` read from a traced model carries one (``ModelSpec.saved``); the activation formulas
(``activations.py``) then price these counts instead of the paper's GPT layer. A spec given by its
dimensions alone (the paper's presets) has none.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["SavedShare", "SavedCensus"]


@dataclass(frozen=True)
class SavedShare:
    """What one part of the model saves per token, by how a tensor-parallel layout divides it."""

    split: float = 0.0
    """Floating-point elements divided over t (column-parallel regions, vocabulary-parallel logits)."""
    seq: float = 0.0
    """Floating-point elements of the hidden stream: whole at t, 1/t with sequence parallelism."""
    whole: float = 0.0
    """Floating-point elements never divided (rotary cos and sin)."""
    fixed: tuple[float, float, float] = (0.0, 0.0, 0.0)
    """Bytes of integer and boolean storages (ids, dropout masks), whose size is the same at any
    precision: (split, seq, whole) as for the elements."""

    def bytes(self, activation: int, t: int, sequence_parallel: bool) -> float:
        """Bytes per token on one of t ranks with ``activation`` bytes per floating-point element."""
        r = t if sequence_parallel else 1
        split, seq, whole = self.fixed
        return activation * (self.split / t + self.seq / r + self.whole) + split / t + seq / r + whole


@dataclass(frozen=True)
class SavedCensus:
    """Per-token saves of one layer (layer 0), of the embedding and of the head, read from the graph."""

    layer: SavedShare
    embedding: SavedShare
    head: SavedShare
