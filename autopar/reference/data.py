"""A small text corpus that ships with autopar, and batches of it.

The corpus is the project's own source and documentation (a few hundred KB of
text), read byte by byte: a 256-token vocabulary, no download, no tokenizer.
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch.utils.data import Dataset

from autopar.core.errors import AutoparError

__all__ = ["corpus", "CorpusBatches", "CorpusWindows", "CorpusError"]


class CorpusError(AutoparError, ValueError):
    """A part of the corpus that does not exist (a split other than 'train' or 'heldout')."""

_ROOT = Path(__file__).resolve().parents[2]
"""The repository root (autopar/reference/data.py is two packages down)."""


def corpus(max_bytes: int = 1 << 20) -> torch.Tensor:
    """The repository's Markdown and Python files as one tensor of byte ids."""
    files = sorted(_ROOT.glob("*.md")) + sorted((_ROOT / "docs").glob("*.md")) + sorted((_ROOT / "autopar").rglob("*.py"))
    data = b"\n".join(f.read_bytes() for f in files if f.is_file())[:max_bytes]
    if len(data) < 4096:
        raise FileNotFoundError(f"the corpus under {_ROOT} has only {len(data)} bytes")
    return torch.frombuffer(bytearray(data), dtype=torch.uint8).long()


class CorpusBatches:
    """Deterministic (inputs, next-token targets) batches of shape (batch, seq)."""

    def __init__(self, batch: int, seq: int, seed: int = 0):
        self.data = corpus()
        self.batch, self.seq = batch, seq
        self.gen = torch.Generator().manual_seed(seed)

    def next(self) -> tuple[torch.Tensor, torch.Tensor]:
        starts = torch.randint(0, len(self.data) - self.seq - 1, (self.batch,), generator=self.gen)
        x = torch.stack([self.data[s : s + self.seq] for s in starts])
        y = torch.stack([self.data[s + 1 : s + self.seq + 1] for s in starts])
        return x, y


class CorpusWindows(Dataset):
    """The corpus cut into windows of ``seq + 1`` bytes: item i is (inputs, next-token targets).

    ``split='train'`` holds the first ``1 - heldout`` of the corpus, ``'heldout'``
    the rest, so evaluation reads text training never saw. A map-style dataset:
    give it a ``DistributedSampler`` per data-parallel replica.
    """

    def __init__(self, seq: int, split: str = "train", heldout: float = 0.1):
        if split not in ("train", "heldout"):
            raise CorpusError(f"split must be 'train' or 'heldout', got {split!r}")
        data = corpus()
        cut = int(len(data) * (1 - heldout))
        self.data = data[:cut] if split == "train" else data[cut:]
        self.seq = seq

    def __len__(self) -> int:
        return (len(self.data) - 1) // self.seq

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        window = self.data[i * self.seq: (i + 1) * self.seq + 1]
        return window[:-1], window[1:]
