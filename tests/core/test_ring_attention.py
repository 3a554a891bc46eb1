"""Ring attention and the context-parallel layout, against single-device attention.

Three tiers:

(a) no process group: each rank's positions and chunks as numbers (cp=2, 4),
    ``cp_shard``/``cp_unshard`` round trips, the refusals' messages, the block
    plans of the load-balanced layout (which pairs are skipped, and equal work
    on every rank), the traffic formula as numbers.
(b) simulation: the block math (``block_attention`` + ``merge_partial`` over a
    partition of the keys, ``block_attention_backward``) against softmax
    attention, and the whole ring (``ring_forward``/``ring_backward``) run by cp
    threads passing messages through queues: output and dq, dk, dv unsharded
    against ``F.scaled_dot_product_attention`` and its autograd, and the bytes
    passed against ``ring_attention_bytes``. fp64 (blocks compute in fp64 for
    fp64 inputs): the ring only reorders sums, so 1e-10 is rounding alone.
    And the order of one rank's forward: each exchange posted before the
    block it holds is computed, awaited after.
(c) real gloo ranks (cp=2 and cp=4, one spawn each, several cases per spawn):
    ``ring_attention`` over a process group with autograd, against
    single-process sdpa. fp32: rtol/atol 1e-5, the merges and accumulators
    reorder fp32 sums of O(1) values (largest difference measured 1.1e-6).
    bf16: the ring upcasts each block to fp32 and rounds output and gradients
    to bf16 once, so it is compared with fp32 sdpa of the same bf16 values
    within rtol/atol 1e-2 (bf16 keeps 8 bits: one rounding of a value near 2 is
    up to 2^-7, plus the bf16-rounded output the backward reads in
    sum(dO * O); largest difference measured 7.3e-3).
"""

from __future__ import annotations

import math
import queue
from collections import defaultdict
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from helpers import spawn_ranks

from autopar.core.comm.cp_layout import ContextParallelError, cp_chunks, cp_positions, cp_shard, cp_unshard
from autopar.core.comm.group import TPGroup
from autopar.core.comm.ring_attention import (block_attention, block_attention_backward, block_plan, merge_partial,
                                              ring_attention, ring_attention_bytes, ring_backward, ring_forward)
from autopar.core.errors import AutoparError

SEQ_DIM = 2  # (B, H, S, D)


# ------------------------------------------------------------------ (a) layout, plans, traffic


def test_load_balanced_chunks_and_positions_as_numbers():
    assert [cp_chunks(r, 2, balanced=True) for r in range(2)] == [(0, 3), (1, 2)]
    assert [cp_chunks(r, 4, balanced=True) for r in range(4)] == [(0, 7), (1, 6), (2, 5), (3, 4)]
    assert [cp_positions(r, 2, 8, balanced=True).tolist() for r in range(2)] == [[0, 1, 6, 7], [2, 3, 4, 5]]
    assert [cp_positions(r, 4, 16, balanced=True).tolist() for r in range(4)] == [
        [0, 1, 14, 15], [2, 3, 12, 13], [4, 5, 10, 11], [6, 7, 8, 9]]
    assert cp_positions(0, 4, 16, balanced=True).dtype == torch.long


def test_contiguous_positions_as_numbers():
    assert [cp_chunks(r, 4, balanced=False) for r in range(4)] == [(0,), (1,), (2,), (3,)]
    assert [cp_positions(r, 4, 8, balanced=False).tolist() for r in range(4)] == [[0, 1], [2, 3], [4, 5], [6, 7]]


@pytest.mark.parametrize("balanced", [True, False])
@pytest.mark.parametrize("cp", [1, 2, 3, 4])
def test_shard_unshard_round_trip(cp, balanced):
    seq = 2 * cp * 3
    x = torch.randn(2, seq, 5)
    pieces = [cp_shard(x, 1, r, cp, balanced) for r in range(cp)]
    for r, piece in enumerate(pieces):  # each piece holds exactly the rank's positions
        assert torch.equal(piece, x.index_select(1, cp_positions(r, cp, seq, balanced)))
    assert torch.equal(cp_unshard(pieces, 1, cp, balanced), x)
    every = torch.cat([cp_positions(r, cp, seq, balanced) for r in range(cp)])
    assert sorted(every.tolist()) == list(range(seq))  # every token on exactly one rank


def test_a_sequence_the_layout_cannot_cut_is_refused_with_the_numbers():
    with pytest.raises(ContextParallelError, match=r"2\*cp = 8 equal chunks.*length is 30 \(30 % 8 = 6\).*32 tokens"):
        cp_shard(torch.zeros(1, 30), 1, 0, 4, balanced=True)
    with pytest.raises(ContextParallelError, match=r"cp = 4 equal chunks.*length is 10.*12 tokens"):
        cp_positions(0, 4, 10, balanced=False)
    with pytest.raises(ValueError):  # still the built-in kind
        cp_positions(0, 4, 10, balanced=False)
    assert issubclass(ContextParallelError, AutoparError)
    with pytest.raises(ContextParallelError, match="one piece per context-parallel rank: got 3 pieces for cp=4"):
        cp_unshard([torch.zeros(4)] * 3, 0, 4, balanced=True)


def test_dropout_and_bad_shapes_are_refused():
    q, k = torch.zeros(1, 4, 8, 2), torch.zeros(1, 2, 8, 2)
    with pytest.raises(ContextParallelError, match=r"does not implement attention dropout \(dropout_p=0.1\)"):
        ring_attention(q, k, k, TPGroup(), causal=True, balanced=True, dropout_p=0.1)
    with pytest.raises(ContextParallelError, match="Hq a multiple of Hkv"):
        ring_attention(torch.zeros(1, 3, 8, 2), k, k, TPGroup(), causal=True, balanced=True)
    with pytest.raises(ContextParallelError, match="local sequence has 7 tokens"):
        ring_attention(torch.zeros(1, 4, 7, 2), torch.zeros(1, 2, 7, 2), torch.zeros(1, 2, 7, 2), TPGroup(),
                       causal=True, balanced=True)


def _plans(cp: int, local: int, causal: bool, balanced: bool):
    pos = [cp_positions(r, cp, local * cp, balanced) for r in range(cp)]
    return {(r, o): block_plan(pos[r], pos[o], causal) for r in range(cp) for o in range(cp)}


def test_load_balanced_causal_plans_skip_masked_work_and_even_it_out():
    plans = _plans(4, 4, causal=True, balanced=True)  # 2 tokens a chunk, 4 a rank
    for (r, o), plan in plans.items():
        if o == r:  # the diagonal: both chunks, causal within
            assert (plan.kind, plan.rows, plan.cols) == ("diagonal", (0, 4), (0, 4))
        elif o < r:  # every query sees the owner's early chunk, none its late one
            assert (plan.kind, plan.rows, plan.cols) == ("full", (0, 4), (0, 2))
        else:  # only the late query chunk sees the owner's keys, all of them
            assert (plan.kind, plan.rows, plan.cols) == ("full", (2, 4), (0, 4))
    entries = [sum((p.rows[1] - p.rows[0]) * (p.cols[1] - p.cols[0]) for (r, _), p in plans.items() if r == rank)
               for rank in range(4)]
    assert entries == [40, 40, 40, 40]  # 16 diagonal + 3 * 8: the same work on every rank


def test_contiguous_causal_plans_skip_the_future_and_bidirectional_sees_all():
    plans = _plans(4, 4, causal=True, balanced=False)
    assert {(r, o): p.kind for (r, o), p in plans.items() if r == 2} == {
        (2, 0): "full", (2, 1): "full", (2, 2): "diagonal", (2, 3): "skip"}
    entries = [sum((p.rows[1] - p.rows[0]) * (p.cols[1] - p.cols[0]) for (r, _), p in plans.items() if r == rank)
               for rank in range(4)]
    assert entries == [16, 32, 48, 64]  # why causal attention wants the load-balanced layout
    assert {p.kind for p in _plans(4, 4, causal=False, balanced=True).values()} == {"full"}


def test_traffic_per_rank_as_numbers():
    # Llama-8B-like layer: 8 kv heads of 128, 4096 tokens over cp=4 (1024 a rank), bf16
    traffic = ring_attention_bytes(1, 8, 1024, 128, torch.bfloat16, cp=4)
    block = 2 * 8 * 1024 * 128  # K and V elements of one rank's block: 2,097,152
    assert traffic.forward == 3 * block * 2 == 12_582_912
    assert traffic.backward == 3 * block * 2 + 3 * block * 4 == 37_748_736  # K, V again + fp32 dK, dV
    assert traffic.total == 50_331_648
    fp32 = ring_attention_bytes(2, 2, 8, 4, torch.float32, cp=2)
    assert (fp32.forward, fp32.backward) == (1024, 2048)
    assert ring_attention_bytes(2, 2, 8, 4, torch.float32, cp=1).total == 0


# ------------------------------------------------------------------ (b) simulation: block math and the ring in threads


def _attention_inputs(hq: int, hkv: int, seq: int, dtype=torch.float64, head_dim: int = 8, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    q, dout = (torch.randn(2, hq, seq, head_dim, generator=g, dtype=dtype) for _ in range(2))
    k, v = (torch.randn(2, hkv, seq, head_dim, generator=g, dtype=dtype) for _ in range(2))
    return q, k, v, dout


def _sdpa_with_grads(q, k, v, dout, causal: bool):
    """The single-device reference: output and (dq, dk, dv) of sdpa over the whole sequence."""
    q, k, v = (x.detach().requires_grad_() for x in (q, k, v))
    out = F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=True)
    out.backward(dout)
    return out.detach(), q.grad, k.grad, v.grad


def test_merged_blocks_equal_softmax_attention():
    q, k, v, _ = _attention_inputs(4, 2, 12)
    scale = 8 ** -0.5
    want = F.scaled_dot_product_attention(q, k, v, enable_gqa=True)
    bounds = [0, 5, 6, 12]  # blocks of unequal sizes, one of a single key
    out, lse = block_attention(q, k[:, :, 0:5], v[:, :, 0:5], scale)
    for start, stop in zip(bounds[1:-1], bounds[2:]):
        out, lse = merge_partial(out, lse, *block_attention(q, k[:, :, start:stop], v[:, :, start:stop], scale))
    torch.testing.assert_close(out, want, rtol=1e-12, atol=1e-12)
    scores = torch.matmul(q, k.repeat_interleave(2, dim=1).transpose(-1, -2)) * scale
    torch.testing.assert_close(lse, torch.logsumexp(scores, dim=-1), rtol=1e-12, atol=1e-12)


def test_merge_takes_rows_a_block_leaves_empty():
    out, lse = torch.ones(1, 1, 2, 3), torch.tensor([[[0.0, float("-inf")]]])
    got, merged = merge_partial(out, lse, torch.full((1, 1, 2, 3), 2.0), torch.tensor([[[float("-inf"), 1.0]]]))
    assert torch.equal(got, torch.tensor([[[[1.0] * 3, [2.0] * 3]]]))  # row 0 from the first side, row 1 the second
    assert torch.equal(merged, torch.tensor([[[0.0, 1.0]]]))


def test_block_backward_equals_autograd_of_softmax_attention():
    q, k, v, dout = _attention_inputs(4, 2, 6)
    out, dq, dk, dv = _sdpa_with_grads(q, k, v, dout, causal=True)
    mask = torch.ones(6, 6, dtype=torch.bool).tril()
    _, lse = block_attention(q, k, v, 8 ** -0.5, mask)
    got = block_attention_backward(dout, q, k, v, lse, (dout * out).sum(-1), 8 ** -0.5, mask)
    for name, g, w in zip(("dq", "dk", "dv"), got, (dq, dk, dv)):
        torch.testing.assert_close(g, w, rtol=1e-12, atol=1e-12, msg=lambda m, name=name: f"{name}: {m}")


class QueueRing:
    """``RingLinks`` between threads of one process: a queue per (receiving rank, tag); counts bytes sent."""

    def __init__(self, rank: int, cp: int, boxes: defaultdict, sent: list[int]):
        self.rank, self.cp, self.boxes, self.sent = rank, cp, boxes, sent

    def pass_right(self, x: torch.Tensor, tag: int) -> int:
        self.sent.append(x.numel() * x.element_size())
        self.boxes[((self.rank + 1) % self.cp, tag)].put(x.clone())
        return tag

    def arrived(self, tag: int) -> torch.Tensor:
        return self.boxes[(self.rank, tag)].get(timeout=30)


def _ring_in_threads(q, k, v, dout, cp: int, causal: bool, balanced: bool):
    """Every rank's ring_forward, then ring_backward, on cp threads; the results unsharded, and each rank's
    bytes sent (forward, backward)."""
    scale = 1 / math.sqrt(q.shape[-1])
    boxes: defaultdict = defaultdict(queue.Queue)
    sent_fwd, sent_bwd = [[] for _ in range(cp)], [[] for _ in range(cp)]

    def shard(x, r):
        return cp_shard(x, SEQ_DIM, r, cp, balanced)

    def forward(r):
        return ring_forward(shard(q, r), shard(k, r), shard(v, r), QueueRing(r, cp, boxes, sent_fwd[r]), r, cp,
                            causal=causal, balanced=balanced, scale=scale)

    with ThreadPoolExecutor(cp) as pool:
        outs = list(pool.map(forward, range(cp)))

    def backward(r):
        return ring_backward(shard(dout, r), shard(q, r), shard(k, r), shard(v, r), *outs[r],
                             QueueRing(r, cp, boxes, sent_bwd[r]), r, cp, causal=causal, balanced=balanced,
                             scale=scale)

    with ThreadPoolExecutor(cp) as pool:
        grads = list(pool.map(backward, range(cp)))
    def unshard(pieces):
        return cp_unshard(pieces, SEQ_DIM, cp, balanced)

    results = (unshard([o for o, _ in outs]), *(unshard([g[i] for g in grads]) for i in range(3)))
    return results, [(sum(f), sum(b)) for f, b in zip(sent_fwd, sent_bwd)]


@pytest.mark.parametrize("cp", [2, 3, 4])
@pytest.mark.parametrize("causal,balanced", [(True, True), (False, False), (True, False)])
def test_the_ring_in_threads_equals_sdpa(cp, causal, balanced):
    seq = 4 * cp
    q, k, v, dout = _attention_inputs(4, 2, seq)
    got, sent = _ring_in_threads(q, k, v, dout, cp, causal, balanced)
    for name, g, w in zip(("out", "dq", "dk", "dv"), got, _sdpa_with_grads(q, k, v, dout, causal)):
        torch.testing.assert_close(g, w, rtol=1e-10, atol=1e-10, msg=lambda m, name=name: f"{name}: {m}")
    traffic = ring_attention_bytes(2, 2, seq // cp, 8, torch.float64, cp)
    assert sent == [(traffic.forward, traffic.backward)] * cp


class LoggedRing(QueueRing):
    """A ``QueueRing`` that logs when each message is posted and awaited."""

    def __init__(self, *args, log: list[str]):
        super().__init__(*args)
        self.log = log

    def pass_right(self, x: torch.Tensor, tag: int) -> int:
        self.log.append("post")
        return super().pass_right(x, tag)

    def arrived(self, tag: int) -> torch.Tensor:
        self.log.append("wait")
        return super().arrived(tag)


def test_each_transfer_is_in_flight_while_the_block_before_it_is_computed(monkeypatch):
    """One rank of cp=3 alone, its neighbours' messages queued in advance: the forward posts each exchange
    before computing the block it holds and waits for it after."""
    import autopar.core.comm.ring_attention as ring

    log: list[str] = []

    def logged_block(*args):
        log.append("compute")
        return block_attention(*args)

    monkeypatch.setattr(ring, "block_attention", logged_block)
    q, k, v, _ = _attention_inputs(2, 2, 12)
    boxes: defaultdict = defaultdict(queue.Queue)
    for _ in range(2):
        boxes[(0, ring._KV_TAG)].put(torch.stack((k[:, :, :4], v[:, :, :4])))  # what rank 2 would pass to rank 0
    links = LoggedRing(0, 3, boxes, [], log=log)
    ring_forward(q[:, :, :4], k[:, :, :4], v[:, :, :4], links, 0, 3, causal=False, balanced=False, scale=0.5)
    assert log == ["post", "compute", "wait"] * 2 + ["compute"]


def test_one_rank_and_the_inspection_group_compute_locally():
    q, k, v, _ = _attention_inputs(4, 2, 8, dtype=torch.float32)
    want = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    assert torch.equal(ring_attention(q, k, v, TPGroup(), causal=True, balanced=True), want)
    inspected = ring_attention(q.requires_grad_(), k, v, TPGroup(rank=1, size=4), causal=True, balanced=True)
    assert inspected.shape == q.shape  # shapes only, no messages
    inspected.sum().backward()
    assert q.grad.shape == q.shape


# ------------------------------------------------------------------ (c) real gloo ranks

GLOO_CASES = {  # label -> (Hq, Hkv, tokens per rank, causal, balanced, dtype)
    "causal balanced GQA fp32": (4, 2, 4, True, True, torch.float32),
    "bidirectional contiguous GQA fp32": (4, 2, 4, False, False, torch.float32),
    "causal balanced MHA bf16": (2, 2, 4, True, True, torch.bfloat16),
}


def _global_inputs(label: str, cp: int):
    hq, hkv, local, causal, balanced, dtype = GLOO_CASES[label]
    q, k, v, dout = _attention_inputs(hq, hkv, local * cp, dtype=torch.float32, seed=cp)
    return tuple(x.to(dtype) for x in (q, k, v, dout)), causal, balanced


def _ring_worker(cp: int):
    """One rank: every case's ring attention with autograd on this rank's shards; (out, dq, dk, dv) per case,
    and the bytes this rank sent per case."""
    torch.set_num_threads(1)
    rank = dist.get_rank()
    group = TPGroup(rank, cp, dist.group.WORLD, tuple(range(cp)))
    sent: list[int] = []
    exchange = dist.batch_isend_irecv

    def counted(ops):
        sent.extend(op.tensor.numel() * op.tensor.element_size() for op in ops if op.op is dist.isend)
        return exchange(ops)

    dist.batch_isend_irecv = counted  # this rank's process only
    results = {}
    for label in GLOO_CASES:
        (q, k, v, dout), causal, balanced = _global_inputs(label, cp)
        q, k, v = (cp_shard(x, SEQ_DIM, rank, cp, balanced).requires_grad_() for x in (q, k, v))
        del sent[:]
        out = ring_attention(q, k, v, group, causal=causal, balanced=balanced)
        forward_bytes = sum(sent)
        out.backward(cp_shard(dout, SEQ_DIM, rank, cp, balanced))
        results[label] = ((out.detach(), q.grad, k.grad, v.grad), (forward_bytes, sum(sent) - forward_bytes))
    return results


@pytest.mark.multiprocess
@pytest.mark.parametrize("cp", [2, 4])
def test_ring_attention_on_gloo_ranks_equals_sdpa(cp):
    per_rank = spawn_ranks(_ring_worker, cp, cp, timeout_s=120)
    for label, (hq, hkv, local, _, _, dtype) in GLOO_CASES.items():
        (q, k, v, dout), causal, balanced = _global_inputs(label, cp)
        wide = [x.float() for x in (q, k, v, dout)]  # the reference in fp32, from the same (bf16) values
        want = _sdpa_with_grads(*wide, causal)
        tol = 1e-5 if dtype == torch.float32 else 1e-2
        for i, name in enumerate(("out", "dq", "dk", "dv")):
            got = cp_unshard([results[label][0][i] for results in per_rank], SEQ_DIM, cp, balanced)
            assert got.dtype == dtype, (label, name, got.dtype)
            torch.testing.assert_close(got.float(), want[i], rtol=tol, atol=tol,
                                       msg=lambda m, name=name, label=label: f"cp={cp} {label} {name}: {m}")
        traffic = ring_attention_bytes(2, hkv, local, 8, dtype, cp)
        assert [results[label][1] for results in per_rank] == [(traffic.forward, traffic.backward)] * cp, label
