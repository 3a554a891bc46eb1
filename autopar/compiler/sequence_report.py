"""The summary's sequence-parallel section: what runs split along the tokens, what gathers them.

One line per op kind run on 1/t of the tokens (with counts), where the split
region starts (each all-reduce turned reduce-scatter, flattened tokens split
sequence by sequence) and ends (each f turned
all-gather; each gather sequence parallelism had to add before an op that needs
the whole sequence, named with its module path and why), and the parameters
whose gradients are summed over the tensor-parallel group once per step.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

__all__ = ["sequence_parallel_lines"]

Program = Any
"""A ``autopar.compiler.program.Program`` (named, not imported: it imports the summary)."""


def sequence_parallel_lines(program: Program) -> list[str]:
    """The section as lines of text ('off' and why, when it is off)."""
    sp, cfg = program.sequence, program.config
    if sp is None:
        if program.tp == 1 or cfg.sequence_parallel is False:
            why = "tp=1" if program.tp == 1 else "sequence_parallel=False"
        else:
            why = (f"tp={program.tp} does not divide the token dim of every all-reduce's value, or no op after "
                   f"them keeps the tokens split (sequence_parallel=True says which)")
        return [f"Sequence parallelism: off ({why})"]
    dims = Counter(f"dim {sp.token_dims[s]} of {sp.shapes[s]}{_sequences(sp.split[s])}" for s in sp.seeds)
    lines = [f"Sequence parallelism: on, tp={sp.tp}: {len(sp.seeds)} all-reduce(s) (g, the embedding's) -> "
             f"reduce-scatters along the tokens ({', '.join(f'{k} x{n}' for k, n in dims.items())}); "
             f"{len(sp.f_gathers)} f -> gather_from_sp (all-gather; backward reduce-scatter, and an all-gather of "
             f"the slice the linears after it kept)"]
    lines.append("  runs on 1/t of the tokens: " + ", ".join(f"{op} x{n}" for op, n in sorted(sp.op_kinds.items())))
    if sp.partial_params:
        lines.append(f"  gradients summed over tp once per step: {len(sp.partial_params)} parameter(s) "
                     f"read only by split tokens ({_some(sp.partial_params)})")
    if sp.copies:
        lines.append(f"  f kept (gradient summed per microbatch): {_some(sp.copies)}")
    if sp.gathers:
        lines.append(f"  gathered before ops that need the whole sequence ({len(sp.gathers)}; forward all-gather, "
                     f"backward local slice):")
        lines += [f"    {g.value} -> {g.consumer} in {g.module}: {g.reason}" for g in sp.gathers]
    else:
        lines.append("  no gather added: every split region ends at an f")
    return lines


def _sequences(placement) -> str:
    segments = getattr(placement, "segments", None)
    return f" as {len(segments)} sequences of {segments[0]}, each split t ways" if segments else ""


def _some(names, n: int = 4) -> str:
    names = list(names)
    return ", ".join(names[:n]) + (f", ... ({len(names) - n} more)" if len(names) > n else "")
