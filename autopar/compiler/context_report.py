"""The summary's context-parallel section: how the sequence is split, what attention became, the ring's traffic.

With cp > 1: the layout (load-balanced when any attention is causal) and each
rank's share of the tokens, the batch tensors cut along their sequence, the
attention layers turned into ring attention (causal or not), the bytes each
rank sends around the ring per microbatch (keys and values forward; again,
with the fp32 key/value gradients, backward: ``ring_attention_bytes``), and
the values held whole along the sequence that are cut to the rank's positions
(position tables, rotary tables).
"""

from __future__ import annotations

from typing import Any

from autopar.core.comm.cp_layout import cp_chunks
from autopar.core.comm.ring_attention import ring_attention_bytes

__all__ = ["context_lines", "ring_bytes"]

Program = Any
"""A ``autopar.compiler.program.Program`` (named, not imported: it imports the summary)."""


def ring_bytes(program: Program) -> dict[str, int]:
    """Bytes one rank sends around the ring per microbatch over every attention of the model, forward
    and backward (what it receives is the same)."""
    plan = program.context_plan
    if plan is None:
        return {"forward": 0, "backward": 0}
    fwd = bwd = 0
    for (batch, heads, local, dim), dtype in zip(plan.kv_shapes, plan.kv_dtypes, strict=True):
        traffic = ring_attention_bytes(batch, heads, local, dim, dtype, plan.split.cp)
        fwd, bwd = fwd + traffic.forward, bwd + traffic.backward
    return {"forward": fwd, "backward": bwd}


def context_lines(program: Program) -> list[str]:
    """The section as lines of text ([] without context parallelism)."""
    plan = program.context_plan
    if plan is None:
        return []
    split, cp = plan.split, plan.split.cp
    per = split.seq_len // cp
    if split.balanced:
        n = split.seq_len // (2 * cp)
        layout = (f"load-balanced (causal attention): {2 * cp} chunks of {n} tokens, rank r holds chunks r and "
                  f"{2 * cp - 1}-r (" + ", ".join(f"rank {r}: {'+'.join(map(str, cp_chunks(r, cp, True)))}"
                                                  for r in range(min(cp, 4))) + (", ..." if cp > 4 else "") + ")")
    else:
        layout = f"contiguous (attention over every token): rank r holds tokens [{per}r, {per}(r+1))"
    causal = sum(plan.causal)
    moved = ring_bytes(program)
    lines = [f"Context parallelism cp={cp}: the sequence of {split.seq_len} tokens split {cp} ways, {per} per rank; "
             f"{layout}",
             "  split along their sequence: " + ", ".join(f"{name} (dim {d})" for name, d in split.seq_dims.items()),
             f"  attention: {len(plan.attention)} layer(s) as ring attention ({causal} causal, "
             f"{len(plan.attention) - causal} over every token), exact online-softmax merging",
             f"  ring traffic per microbatch and rank: {_mib(moved['forward'])} forward + {_mib(moved['backward'])} "
             f"backward (keys and values, cp-1 hops each way; the backward adds their fp32 gradients)"]
    if plan.narrowed:
        lines.append(f"  held whole along the sequence, cut to each rank's positions: {len(plan.narrowed)} value(s) "
                     f"({', '.join(plan.narrowed[:4])}{', ...' if len(plan.narrowed) > 4 else ''}): position and "
                     f"rotary tables follow the rank's tokens")
    mesh = program.config.mesh
    if mesh.cp > 1:
        groups = mesh.cp_groups()
        shown = " ".join("[" + ",".join(map(str, g)) + "]" for g in groups[:6])
        lines.append(f"  context-parallel groups: {shown}" + (f" ... ({len(groups)} groups)" if len(groups) > 6 else ""))
    return lines


def _mib(n: float) -> str:
    return f"{n / 2**20:.1f} MiB" if n >= 2**20 else f"{n / 2**10:.1f} KiB"
