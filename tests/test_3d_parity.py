"""3D parity on 8 gloo ranks: every layout of (tp, pp, dp), AdamW with gradient clipping.

One spawn of 8 ranks runs all layouts. Each layout trains 3 steps on the same
16-sequence global batches as the single-device run; the losses and every
(clipped) gradient must match, data-parallel replicas must hold identical
parameters, and a parameter held by two stages (the tied embedding / LM head)
must be identical on both. Tolerances as in test_tp_parity.
"""

import pytest
import torch
from families import SEQ, assert_steps_match, train_steps

import autopar
from autopar.reference.models import build
from autopar.reference.parity import single_device_run

pytestmark = pytest.mark.multiprocess
LR, CLIP, ROWS, VOCAB, LAYERS = 1e-3, 0.5, 16, 320, 8
# (tp, pp, dp); interleaved (v=2) where pp > 1 and 8 layers allow p*v chunks
LAYOUTS = [(8, 1, 1), (1, 8, 1), (1, 1, 8), (2, 2, 2), (2, 4, 1), (4, 2, 1), (2, 1, 4), (1, 2, 4)]


def _model():
    torch.manual_seed(0)
    return build("gpt", vocab_size=VOCAB, seq_len=SEQ, n_layer=LAYERS, n_head=8, d_model=64)


def _data():
    g = torch.Generator().manual_seed(3)
    return [((torch.randint(0, VOCAB, (ROWS, SEQ), generator=g),), (torch.randint(0, VOCAB, (ROWS, SEQ), generator=g),))
            for _ in range(3)]


def _shape(tp, pp, dp):
    v = 2 if pp > 1 and 2 * pp <= LAYERS else 1
    m = max(pp, 2)
    return v, m, ROWS // (dp * m)


def _run(layout):
    import torch.distributed as dist

    tp, pp, dp = layout
    v, m, mb = _shape(*layout)
    data = _data()
    program = autopar.parallelize(_model(), tp=tp, pp=pp, dp=dp, virtual_stages=v, microbatches=m,
                                  example_inputs=(data[0][0][0][:mb],), example_targets=data[0][1][0][:mb])
    engine = program.materialize()
    losses, grads = train_steps(engine, data, LR, clip=CLIP)
    local = {n: p.detach().clone() for n, p in engine.named_local_parameters()}
    assert engine.stats.get("dp_buckets", 0) > 0 or dp == 1  # data-parallel reduction ran in buckets
    return losses, grads, local, engine.mesh.shape.coords(dist.get_rank()), program.tied_params


def _worker():
    return {layout: _run(layout) for layout in LAYOUTS}


def test_every_8_rank_layout_matches_single_device():
    results = autopar.spawn(_worker, 8, (), timeout_s=1200)
    ref_losses, ref_grads = single_device_run(_model(), _data(), autopar.lm_cross_entropy, clip_grad_norm=CLIP,
                                              optimizer=lambda ps: torch.optim.AdamW(ps, lr=LR))
    for layout in LAYOUTS:
        for rank, res in enumerate(results):
            losses, grads, _, _, _ = res[layout]
            assert_steps_match(ref_losses, ref_grads, losses, grads, label=f"(tp, pp, dp)={layout} rank {rank}")
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
