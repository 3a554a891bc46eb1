"""3D parity on 8 gloo ranks: every layout of (tp, pp, dp), AdamW with gradient clipping.

One spawn of 8 ranks runs all layouts. Each layout trains 3 steps on the same
16-sequence global batches as the single-device run; the losses and every
(clipped) gradient must match, data-parallel replicas must hold identical
parameters, and a parameter held by two stages (the tied embedding / LM head)
must be identical on both. The data-parallel gradient reduction runs in exactly
the buckets its rule gives for the gradients each rank holds (none with dp=1).
Tolerances as in test_tp_parity.
"""

import pytest
import torch
from families import SEQ, train_steps
from helpers import assert_ranks_match, parallelize_on, reference_run, seeded, spawn_ranks, token_batches

from autopar.reference.models import build

pytestmark = pytest.mark.multiprocess
LR, CLIP, ROWS, VOCAB, LAYERS = 1e-3, 0.5, 16, 320, 8
# (tp, pp, dp); interleaved (v=2) where pp > 1 and 8 layers allow p*v chunks
LAYOUTS = [(8, 1, 1), (1, 8, 1), (1, 1, 8), (2, 2, 2), (2, 4, 1), (4, 2, 1), (2, 1, 4), (1, 2, 4)]
BUCKET = 2**16
"""Data-parallel bucket size in these runs (the engine's default is 25 MiB): small, so that the
gradients a rank holds fill several buckets and the count depends on the bucket size."""


def _parity_gpt():
    return seeded(build, "gpt", vocab_size=VOCAB, seq_len=SEQ, n_layer=LAYERS, n_head=8, d_model=64)


def _parity_batches():
    return token_batches(VOCAB, steps=3, rows=ROWS, seed=3)


def _shape(tp, pp, dp):
    v = 2 if pp > 1 and 2 * pp <= LAYERS else 1
    m = max(pp, 2)
    return v, m, ROWS // (dp * m)


def _expected_buckets(program, engine) -> int:
    """The data-parallel all-reduces of one step on this rank, by the rule of runtime/optim/gradient_sync.py.

    A parameter's gradient is final after the last backward of the lowest local chunk that reads
    it (B(c, i) waits for B(c + p, i), on the same stage): there the gradients that became final
    are averaged, filling buckets in parameter order, each launched as soon as it holds >= the
    bucket size in bytes and the rest in one last bucket. A parameter held by several stages (the
    tied embedding and head) is summed across them apart, in no bucket. Nothing with dp = 1.
    """
    if program.config.data_parallel == 1:
        return 0
    held = {n: t.numel() * t.element_size() for n, t in engine.named_local_parameters()}
    local = [c for c in program.split.chunks if c.index % program.pp == engine.stage]
    final_after: dict[int, list[int]] = {}
    for name in program.param_names:
        if name in held and name not in program.tied_params:
            readers = [c.index for c in local if name in {program.traced.param_of[ph] for ph in c.params}]
            final_after.setdefault(min(readers), []).append(held[name])
    buckets = 0
    for sizes in final_after.values():
        filled = 0
        for size in sizes:
            filled += size
            if filled >= BUCKET:
                buckets, filled = buckets + 1, 0
        buckets += filled > 0
    return buckets


def _3d_program(layout):
    tp, pp, dp = layout
    v, m, mb = _shape(*layout)
    return parallelize_on(_parity_gpt(), _parity_batches(), mb, tp=tp, pp=pp, dp=dp, virtual_stages=v,
                          microbatches=m)


def _train_3d_layout(layout):
    import torch.distributed as dist

    data = _parity_batches()
    program = _3d_program(layout)
    engine = program.materialize()
    engine.grads.bucket_bytes = BUCKET
    losses, grads = train_steps(engine, data, LR, clip=CLIP)
    local = {n: p.detach().clone() for n, p in engine.named_local_parameters()}
    buckets = (engine.stats.get("dp_buckets", 0), _expected_buckets(program, engine), len(engine.chunks))
    return losses, grads, local, engine.mesh.shape.coords(dist.get_rank()), program.tied_params, buckets


def _train_every_layout():
    return {layout: _train_3d_layout(layout) for layout in LAYOUTS}


def test_every_8_rank_layout_matches_single_device():
    for layout in LAYOUTS:  # compile once here: the ranks inherit the programs
        _3d_program(layout)
    results = spawn_ranks(_train_every_layout, 8, timeout_s=1200)
    ref = reference_run(_parity_gpt(), _parity_batches(), lr=LR, clip_grad_norm=CLIP)
    for layout in LAYOUTS:
        assert_ranks_match(ref, [res[layout][:2] for res in results], label=f"(tp, pp, dp)={layout}")
        for rank, res in enumerate(results):
            # the data-parallel reduction ran in exactly the buckets the rule gives for this rank's
            # gradients; with dp > 1 more of them than local chunks (the bucket size splits them)
            ran, expected, chunks = res[layout][5]
            assert ran == expected, f"{layout} rank {rank}: {ran} data-parallel buckets, expected {expected}"
            if layout[2] > 1:
                assert expected > chunks, (layout, rank, expected, chunks)
            else:
                assert expected == 0, (layout, rank, expected)
        # after the steps: replicas equal, and a parameter on two stages equal on both
        by_coords = {res[layout][3]: res[layout][2] for res in results}
        tied = results[0][layout][4]
        for (s, d, j), local in by_coords.items():
            twin = by_coords[(s, 0, j)]
            for name, value in local.items():
                torch.testing.assert_close(value, twin[name], rtol=0, atol=0,
                                           msg=f"{layout}: replica {d} differs from replica 0 on {name}")
            for name, stages in tied.items():
                if s in stages:
                    other = by_coords[(stages[0], d, j)][name]
                    torch.testing.assert_close(local[name], other, rtol=0, atol=0,
                                               msg=f"{layout}: {name} differs between stages {stages}")
