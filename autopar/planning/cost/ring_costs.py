"""Context parallelism's ring attention, priced: how many score entries a rank computes, the bytes of
one hop, and how much of the hops the block computations hide.

Under context parallelism each of cp ranks holds s_l = s/cp tokens (``core.comm.cp_layout``) and
attention runs as a ring (``core.comm.ring_attention``): at step i = 0 .. cp-1 a rank computes its
queries against the key/value block it holds while the next block is in flight, so cp-1 hops
overlap the blocks of steps 0 .. cp-2.

What a rank computes: the ring skips fully masked blocks (``ring_attention.block_plan``): under the
causal load-balanced layout step 0 (a rank's own block, masked on its diagonal) is s_l x s_l and
every other step half of that (all queries x the first half of the keys, or the second half of
the queries x all keys), the same on every rank; bidirectional, every step is s_l x s_l. The
performance model prices attention at cp = 1 as the whole s x s score matrix (the paper's
attention, masked, not skipped), so for a like comparison it prices a rank's attention at cp > 1
as 1/cp of that (an exact even split): b a_l s_l s entries, causal or not. ``ring_block_shares``
only splits that work over the ring's steps (to know what each hop hides behind).
"""

from __future__ import annotations

import torch

from autopar.core.comm.ring_attention import RingTraffic, ring_attention_bytes

__all__ = ["ring_block_shares", "ring_traffic", "ring_exposed_time"]


def ring_block_shares(cp: int, causal: bool) -> list[float]:
    """Each ring step's share of a rank's attention work, step 0 (its own block) first: 1 and
    cp-1 halves, normalised (causal, load-balanced), or cp equal shares (bidirectional)."""
    weights = [1.0] + [0.5 if causal else 1.0] * (cp - 1)
    total = sum(weights)
    return [w / total for w in weights]


def ring_traffic(b: int, kv_heads: int, local_seq: int, head_dim: int, cp: int,
                 activation_bytes: int = 2) -> RingTraffic:
    """What one rank sends for one layer's ring attention, one microbatch of b sequences, k and v of
    (b, kv_heads, s_l, head_dim) in 16-bit (or fp32 with ``activation_bytes`` 4): the runtime's own
    count, ``ring_attention_bytes``."""
    dtype = {2: torch.bfloat16, 4: torch.float32}[activation_bytes]
    return ring_attention_bytes(b, kv_heads, local_seq, head_dim, dtype, cp)


def ring_exposed_time(kv_hop: float, attention_seconds: float, cp: int, causal: bool,
                      accumulator_hop: float = 0.0) -> float:
    """Seconds of one ring's transfers that its block computations do not hide (0 at cp = 1).

    Forward (``ring_forward``): the hop fetching step i+1's key/value block is in flight while step
    i's block is computed, i = 0 .. cp-2: sum of max(0, kv_hop - attention x share_i)
    (``ring_block_shares``). Backward (``ring_backward``, ``accumulator_hop`` > 0): the blocks travel
    again, and the dK/dV accumulator a rank passes on after computing step i >= 1 is in flight during
    step i+1's block, beside that step's key/value hop; the last one (sent after step cp-1) arrives
    after every block, wholly exposed:
    sum over i of max(0, kv_hop [i <= cp-2] + accumulator_hop [i >= 2] - attention x share_i)
    + accumulator_hop.
    """
    if cp <= 1:
        return 0.0
    shares = ring_block_shares(cp, causal)
    exposed = 0.0
    for step, share in enumerate(shares):
        in_flight = (kv_hop if step <= cp - 2 else 0.0) + (accumulator_hop if step >= 2 else 0.0)
        if in_flight:
            exposed += max(0.0, in_flight - attention_seconds * share)
    return exposed + accumulator_hop
