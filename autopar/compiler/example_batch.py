"""The example microbatch a program was compiled with, as its traced graph holds it: the summary's
memory (its sequence) and the cost model's layout (its sequences per microbatch) read it."""

from __future__ import annotations

from typing import Any

__all__ = ["example_shape", "example_seq_len", "example_micro_batch"]


def example_shape(program: Any) -> tuple[int, ...]:
    """The shape of ``program``'s first input (a ``Program``), () when it has none."""
    phs = [n for n in program.traced.gm.graph.nodes if n.op == "placeholder" and n.name in program.traced.input_names]
    val = phs[0].meta.get("val") if phs else None
    return tuple(val.shape) if val is not None else ()


def example_seq_len(program: Any) -> int:
    """The example microbatch's sequence length (the first input's last dim), 0 without one."""
    shape = example_shape(program)
    return int(shape[-1]) if len(shape) >= 2 else 0


def example_micro_batch(program: Any) -> int:
    """Sequences per microbatch: the first input's rows (``parallelize``'s example is one microbatch)."""
    shape = example_shape(program)
    return int(shape[0]) if shape else 1
