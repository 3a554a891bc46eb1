"""A small text corpus that ships with autopar, and batches of it.

The corpus is the project's own source and documentation (a few hundred KB of
text), read byte by byte: a 256-token vocabulary, no download, no tokenizer.
"""

from __future__ import annotations

from pathlib import Path

import torch

__all__ = ["corpus", "CorpusBatches"]

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
