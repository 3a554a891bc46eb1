"""The reference GPT's size flags, shared by the benchmarks that build one."""

from __future__ import annotations

import argparse


def add_gpt_flags(p: argparse.ArgumentParser, *, d_model: int, layers: int, heads: int, seq: int,
                  vocab: int) -> None:
    """``--d-model --layers --heads --seq --vocab`` with this benchmark's defaults."""
    p.add_argument("--d-model", type=int, default=d_model, help="hidden size")
    p.add_argument("--layers", type=int, default=layers, help="transformer layers")
    p.add_argument("--heads", type=int, default=heads, help="attention heads")
    p.add_argument("--seq", type=int, default=seq, help="tokens per sequence")
    p.add_argument("--vocab", type=int, default=vocab, help="vocabulary size")
