"""Which tokens of a sequence each context-parallel rank holds, and the cuts and joins between the two views.

Context parallelism (cp) splits the sequence dimension of every activation over
cp ranks. Two layouts:

- ``contiguous`` (bidirectional attention): the sequence of length S is cut into
  cp chunks of S/cp tokens; rank r holds chunk r.
- ``load_balanced`` (causal attention): the sequence is cut into 2*cp chunks of
  S/(2cp) tokens; rank r holds chunks r and 2cp-1-r, concatenated in that order.
  Under a causal mask, token i attends to i+1 keys, so the work of a chunk grows
  with its index; pairing an early chunk with its mirror image gives every rank
  the same number of (query, key) pairs.

For S = 8, cp = 2 (load-balanced)::

    chunk      0     1     2     3
    tokens   0 1   2 3   4 5   6 7
    rank 0: chunks 0, 3 -> positions [0, 1, 6, 7]
    rank 1: chunks 1, 2 -> positions [2, 3, 4, 5]

In both layouts a rank's positions are sorted ascending, which the ring
attention's block plans rely on (``ring_attention.block_plan``).

``cp_positions`` names a rank's global positions (for rotary embeddings and
masks), ``cp_shard`` cuts a global tensor into one rank's tokens, ``cp_unshard``
puts every rank's tokens back in global order (tests, checkpoints, evaluation).
A sequence that does not divide into the layout's chunks is refused with a
``ContextParallelError`` that names the numbers and the fix.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from autopar.core.errors import AutoparError

__all__ = ["ContextParallelError", "ContextSplit", "cp_chunks", "cp_positions", "cp_shard", "cp_unshard",
           "check_cp_divisible"]


class ContextParallelError(AutoparError, ValueError):
    """A sequence, tensor or option that context parallelism cannot split or run: the message names the
    numbers and the fix."""


@dataclass(frozen=True)
class ContextSplit:
    """How a program splits the sequence over context-parallel ranks (``program.context``): what the
    compiler decided and the runtime follows."""

    cp: int
    """Context-parallel ranks the sequence is split over."""
    balanced: bool
    """The load-balanced layout (causal attention: chunks r and 2cp-1-r) or the contiguous one."""
    seq_len: int
    """Tokens of a whole sequence (the example microbatch's)."""
    seq_dims: dict[str, int] = field(default_factory=dict)
    """Batch tensor (a graph input or target placeholder name) -> its sequence dim. The runtime hands
    each rank its tokens of these (``cp_shard``); a batch tensor not named here has no sequence dim
    and reaches every cp rank whole."""

    def positions(self, rank: int, device=None) -> torch.Tensor:
        """The global positions rank ``rank`` holds (``cp_positions``)."""
        return cp_positions(rank, self.cp, self.seq_len, self.balanced, device)

    def shard(self, x: torch.Tensor, dim: int, rank: int) -> torch.Tensor:
        """Rank ``rank``'s tokens of ``x`` along ``dim`` (``cp_shard``)."""
        return cp_shard(x, dim, rank, self.cp, self.balanced)


def _layout_name(balanced: bool) -> str:
    return "load-balanced (causal)" if balanced else "contiguous (bidirectional)"


def check_cp_divisible(seq_len: int, cp: int, balanced: bool) -> None:
    """Refuse a sequence of ``seq_len`` tokens that the layout cannot cut into equal chunks: ``cp`` chunks
    (contiguous) or ``2 * cp`` chunks (load-balanced)."""
    if cp < 1:
        raise ContextParallelError(f"context parallelism needs cp >= 1, got cp={cp}")
    chunks = 2 * cp if balanced else cp
    if seq_len % chunks:
        padded = -(-seq_len // chunks) * chunks
        how = f"2*cp = {chunks}" if balanced else f"cp = {chunks}"
        raise ContextParallelError(
            f"context parallelism cp={cp} with the {_layout_name(balanced)} layout cuts the sequence into "
            f"{how} equal chunks, but the sequence length is {seq_len} ({seq_len} % {chunks} = {seq_len % chunks}): "
            f"pad the sequences to a multiple of {chunks} (here {padded} tokens), or choose a cp for which "
            f"{'2*cp' if balanced else 'cp'} divides {seq_len}")


def cp_chunks(rank: int, cp: int, balanced: bool) -> tuple[int, ...]:
    """The chunk indices rank ``rank`` holds, in its local order: (rank, 2cp-1-rank) load-balanced, (rank,)
    contiguous."""
    if not 0 <= rank < cp:
        raise ContextParallelError(f"context-parallel rank {rank} is outside 0..{cp - 1} (cp={cp})")
    return (rank, 2 * cp - 1 - rank) if balanced else (rank,)


def cp_positions(rank: int, cp: int, seq_len: int, balanced: bool, device: torch.device | str | None = None
                 ) -> torch.Tensor:
    """The global token positions rank ``rank`` holds, in its local order: a LongTensor of ``seq_len / cp``
    positions, sorted ascending."""
    check_cp_divisible(seq_len, cp, balanced)
    n = seq_len // (2 * cp if balanced else cp)
    return torch.cat([torch.arange(c * n, (c + 1) * n, device=device) for c in cp_chunks(rank, cp, balanced)])


def cp_shard(x: torch.Tensor, dim: int, rank: int, cp: int, balanced: bool) -> torch.Tensor:
    """Rank ``rank``'s tokens of the global tensor ``x`` along its sequence dim ``dim`` (contiguous)."""
    seq_len = x.shape[dim]
    check_cp_divisible(seq_len, cp, balanced)
    n = seq_len // (2 * cp if balanced else cp)
    pieces = [x.narrow(dim, c * n, n) for c in cp_chunks(rank, cp, balanced)]
    return torch.cat(pieces, dim=dim).contiguous()


def cp_unshard(pieces: list[torch.Tensor] | tuple[torch.Tensor, ...], dim: int, cp: int, balanced: bool
               ) -> torch.Tensor:
    """The inverse of ``cp_shard``: every rank's tokens (``pieces[r]`` from rank r) put back in global order."""
    if len(pieces) != cp:
        raise ContextParallelError(f"cp_unshard needs one piece per context-parallel rank: got {len(pieces)} "
                                   f"pieces for cp={cp}")
    if not balanced:
        return torch.cat(list(pieces), dim=dim)
    local = pieces[0].shape[dim]
    if local % 2:
        raise ContextParallelError(f"a load-balanced piece holds two equal chunks, but its sequence dim {dim} has "
                                   f"{local} tokens (odd): were the pieces cut with balanced=False?")
    halves = [p.split(local // 2, dim=dim) for p in pieces]  # [rank] -> (chunk rank, chunk 2cp-1-rank)
    ordered = [halves[c][0] for c in range(cp)] + [halves[2 * cp - 1 - c][1] for c in range(cp, 2 * cp)]
    return torch.cat(ordered, dim=dim)
