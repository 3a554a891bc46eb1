"""Dropout's random streams on 8 gloo ranks (tp=2 x pp=2 x dp=2).

Every dropout mask each rank draws is recorded (a dispatch mode on
``aten.native_dropout`` and ``aten.bernoulli_``) during one training step of a GPT with dropout 0.5:

- the two tensor-parallel ranks of a stage draw identical masks for the values
  they both hold (the residual stream), or their replicated activations would
  diverge;
- the two pipeline stages draw different masks (the same stream on both would
  repeat stage 0's masks on stage 1's layers);
- the two data-parallel replicas draw different masks for their different
  samples, as one device drawing for the whole batch would;
- the process's default generator is left as it was;
- layer recomputation replays the forward's masks: with the same seed,
  gradients with and without recomputation are equal (the masks are 0.5
  dropout, so a single differing mask would change them by O(1)).
"""

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import autopar
from autopar.reference.models import build

pytestmark = pytest.mark.multiprocess
VOCAB, SEQ, LAYERS, M, MB, DP = 320, 16, 4, 2, 2, 2


class _Masks(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.masks: list[torch.Tensor] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func is torch.ops.aten.native_dropout.default:  # the fused kernel (CUDA)
            self.masks.append(out[1].detach().clone())
        elif func is torch.ops.aten.bernoulli_.float:  # CPU: dropout draws its noise tensor in place
            self.masks.append(out.detach().clone())
        return out


def _step(recompute):
    import torch.distributed as dist

    torch.manual_seed(0)
    model = build("gpt", vocab_size=VOCAB, seq_len=SEQ, n_layer=LAYERS, n_head=4, d_model=64, dropout=0.5)
    model.train()
    g = torch.Generator().manual_seed(5)
    x = torch.randint(0, VOCAB, (M * MB * DP, SEQ), generator=g)
    y = torch.randint(0, VOCAB, (M * MB * DP, SEQ), generator=g)
    program = autopar.parallelize(model, tp=2, pp=2, dp=DP, microbatches=M, recompute=recompute,
                                  example_inputs=(x[:MB],), example_targets=y[:MB])
    engine = program.materialize()
    before = torch.get_rng_state()
    rec = _Masks()
    with rec:
        loss = engine.train_step(x, y)
    grads = {n: p.grad.detach().clone() for n, p in engine.named_local_parameters() if p.grad is not None}
    return {"coords": engine.mesh.shape.coords(dist.get_rank()), "loss": loss, "grads": grads,
            "masks": rec.masks, "rng_untouched": torch.equal(before, torch.get_rng_state()),
            "seed": engine.random_seed}


def _worker():
    return {rc: _step(rc) for rc in ("none", "layer")}


@pytest.fixture(scope="module")
def results():
    return autopar.spawn(_worker, 8, timeout_s=600)


def _by_coords(results, rc="none"):
    return {r[rc]["coords"]: r[rc] for r in results}


def _residual(masks):
    """Masks of (b, s, h) activations: replicated on the t ranks of a stage."""
    return [m for m in masks if m.dim() == 3]


def test_masks_drawn_on_every_stage(results):
    for r in results:
        assert len(_residual(r["none"]["masks"])) >= 2 * M  # two residual dropouts per layer per microbatch


def test_tensor_parallel_peers_draw_the_same_replicated_masks(results):
    by = _by_coords(results)
    for pp in range(2):
        for dp in range(DP):
            a, b = _residual(by[(pp, dp, 0)]["masks"]), _residual(by[(pp, dp, 1)]["masks"])
            assert len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b))
            assert by[(pp, dp, 0)]["seed"] == by[(pp, dp, 1)]["seed"]


def test_stages_and_replicas_draw_different_masks(results):
    by = _by_coords(results)
    for tp in range(2):
        s0, s1 = _residual(by[(0, 0, tp)]["masks"]), _residual(by[(1, 0, tp)]["masks"])
        pairs = [(x, y) for x, y in zip(s0, s1) if x.shape == y.shape]
        assert pairs and not any(torch.equal(x, y) for x, y in pairs)
        r0, r1 = _residual(by[(0, 0, tp)]["masks"]), _residual(by[(0, 1, tp)]["masks"])
        assert len(r0) == len(r1) and not any(torch.equal(x, y) for x, y in zip(r0, r1))
    assert len({r["none"]["seed"] for r in results}) == 4  # one stream per (stage, replica)


def test_default_generator_untouched(results):
    assert all(r[rc]["rng_untouched"] for r in results for rc in ("none", "layer"))


def test_recompute_replays_the_same_masks(results):
    for r in results:
        a, b = r["none"], r["layer"]
        # every layer's forward runs twice with recomputation (the embedding's dropout, outside the
        # layers, once); each replay draws a mask of the plain run
        plain, replayed = _residual(a["masks"]), _residual(b["masks"])
        assert len(plain) < len(replayed) <= 2 * len(plain)
        assert all(any(torch.equal(x, y) for y in plain) for x in replayed)
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-6)
        assert a["grads"].keys() == b["grads"].keys()
        for n in a["grads"]:
            # fp32, same ops in the same order: equal up to rounding
            torch.testing.assert_close(b["grads"][n], a["grads"][n], rtol=1e-5, atol=1e-6, msg=n)
