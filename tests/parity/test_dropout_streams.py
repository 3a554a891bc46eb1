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
- layer recomputation replays the forward's masks: each mask is tagged with
  the action (F or B, chunk, microbatch) and the checkpointed layer it was
  drawn in, and every mask a backward replays equals the one its own layer
  drew in that microbatch's forward; with the same seed, gradients with and
  without recomputation are equal (the masks are 0.5 dropout, so a single
  differing mask would change them by O(1)).
"""

import pytest
import torch
from helpers import assert_same_grads, parallelize_on, seeded, spawn_ranks, token_batches
from torch.utils._python_dispatch import TorchDispatchMode

from autopar.core.activation_recompute import Checkpointed
from autopar.reference.models import build

pytestmark = pytest.mark.multiprocess
VOCAB, SEQ, LAYERS, M, MB, DP = 320, 16, 4, 2, 2, 2


class _Masks(TorchDispatchMode):
    """Records every dropout mask drawn, tagged with the pipeline action (F or B, chunk, microbatch)
    and the checkpointed layer (its label, or None outside any) it was drawn in."""

    def __init__(self):
        super().__init__()
        self.records: list[tuple[str, int, int, str | None, torch.Tensor]] = []
        self.action: tuple[str, int, int] | None = None
        self.layer: str | None = None

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func is torch.ops.aten.native_dropout.default:  # the fused kernel (CUDA)
            self.records.append((*self.action, self.layer, out[1].detach().clone()))
        elif func is torch.ops.aten.bernoulli_.float:  # CPU: dropout draws its noise tensor in place
            self.records.append((*self.action, self.layer, out.detach().clone()))
        return out

    def watch(self, engine):
        """Tag what ``engine`` draws: the action it runs, and the checkpointed layer (hooks on the
        module each checkpoint runs, called in the forward and again in the backward's replay)."""
        for name in ("forward", "backward"):
            run = getattr(engine.compute, name)

            def tagged(a, *rest, run=run):
                # a replay may stop once it has what the backward needs, before its layer's post-hook
                self.action, self.layer = (a.kind.value, a.chunk, a.microbatch), None
                try:
                    return run(a, *rest)
                finally:
                    self.action, self.layer = None, None

            setattr(engine.compute, name, tagged)
        for module in engine.runnables.values():
            for m in module.modules():
                if isinstance(m, Checkpointed):
                    m.inner.register_forward_pre_hook(lambda _m, _a, label=m.label: setattr(self, "layer", label))
                    m.inner.register_forward_hook(lambda *_: setattr(self, "layer", None))


def _batch():
    return token_batches(VOCAB, steps=1, rows=M * MB * DP, seed=5, seq=SEQ)[0]


def _dropout_program(recompute):
    model = seeded(build, "gpt", vocab_size=VOCAB, seq_len=SEQ, n_layer=LAYERS, n_head=4, d_model=64, dropout=0.5)
    model.train()
    # the residual stream replicated on the tp ranks (sequence parallelism would split it, each rank
    # drawing for its own tokens)
    return parallelize_on(model, [_batch()], MB, tp=2, pp=2, dp=DP, world_size=8, microbatches=M,
                          recompute=recompute, sequence_parallel=False)


def _step(recompute):
    import torch.distributed as dist

    (x,), (y,) = _batch()
    program = _dropout_program(recompute)  # inherited from the test process
    engine = program.materialize()
    before = torch.get_rng_state()
    rec = _Masks()
    rec.watch(engine)
    with rec:
        loss = engine.train_step(x, y)
    grads = {n: p.grad.detach().clone() for n, p in engine.named_local_parameters() if p.grad is not None}
    return {"coords": engine.mesh.shape.coords(dist.get_rank()), "loss": loss, "grads": grads,
            "masks": [r[-1] for r in rec.records], "records": rec.records,
            "rng_untouched": torch.equal(before, torch.get_rng_state()), "seed": engine.random_seed,
            "layers": {c: len(ch.layers) for c, ch in engine.chunks.items()}}


RECOMPUTE = ("none", "layer")


def _dropout_step_per_recompute():
    return {rc: _step(rc) for rc in RECOMPUTE}


@pytest.fixture(scope="module")
def dropout_steps():
    for rc in RECOMPUTE:  # compile once here: the ranks inherit the programs
        _dropout_program(rc)
    return spawn_ranks(_dropout_step_per_recompute, 8, timeout_s=600)


def _by_coords(dropout_steps, rc="none"):
    return {r[rc]["coords"]: r[rc] for r in dropout_steps}


def _residual(masks):
    """Masks of (b, s, h) activations: replicated on the t ranks of a stage."""
    return [m for m in masks if m.dim() == 3]


def test_masks_drawn_on_every_stage(dropout_steps):
    layers = {}
    for r in dropout_steps:
        stage = r["none"]["coords"][0]
        layers[stage] = sum(r["none"]["layers"].values())
        # per microbatch, each layer's MLP output dropout and, on stage 0, the embedding's
        # (attention's dropout, inside the fused kernel, draws (b, heads, s, s) masks)
        assert len(_residual(r["none"]["masks"])) == M * (layers[stage] + (stage == 0)), r["none"]["coords"]
    assert sum(layers.values()) == LAYERS


def test_tensor_parallel_peers_draw_the_same_replicated_masks(dropout_steps):
    by = _by_coords(dropout_steps)
    for pp in range(2):
        for dp in range(DP):
            a, b = _residual(by[(pp, dp, 0)]["masks"]), _residual(by[(pp, dp, 1)]["masks"])
            assert len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b))
            assert by[(pp, dp, 0)]["seed"] == by[(pp, dp, 1)]["seed"]


def test_stages_and_replicas_draw_different_masks(dropout_steps):
    by = _by_coords(dropout_steps)
    for tp in range(2):
        s0, s1 = _residual(by[(0, 0, tp)]["masks"]), _residual(by[(1, 0, tp)]["masks"])
        pairs = [(x, y) for x, y in zip(s0, s1) if x.shape == y.shape]
        assert pairs and not any(torch.equal(x, y) for x, y in pairs)
        r0, r1 = _residual(by[(0, 0, tp)]["masks"]), _residual(by[(0, 1, tp)]["masks"])
        assert len(r0) == len(r1) and not any(torch.equal(x, y) for x, y in zip(r0, r1))
    assert len({r["none"]["seed"] for r in dropout_steps}) == 4  # one stream per (stage, replica)


def test_default_generator_untouched(dropout_steps):
    assert all(r[rc]["rng_untouched"] for r in dropout_steps for rc in ("none", "layer"))


def _by_action(records, kind):
    """(chunk, microbatch) -> the (layer, mask) pairs drawn in that action's F or B, in order."""
    out: dict[tuple[int, int], list] = {}
    for k, chunk, micro, layer, mask in records:
        if k == kind:
            out.setdefault((chunk, micro), []).append((layer, mask))
    return out


def _per_layer(drawn):
    """layer -> its masks in order (the draws outside any checkpointed layer left out)."""
    out: dict[str, list] = {}
    for layer, mask in drawn:
        if layer is not None:
            out.setdefault(layer, []).append(mask)
    return out


def test_recompute_replays_the_same_masks(dropout_steps):
    for r in dropout_steps:
        plain, rec = r["none"], r["layer"]
        where = f"(pp, dp, tp)={plain['coords']}"
        # without recomputation the backward draws nothing; with it, the forward draws exactly the
        # plain run's masks, action by action and in order
        plain_f, rec_f = _by_action(plain["records"], "F"), _by_action(rec["records"], "F")
        assert _by_action(plain["records"], "B") == {}, where
        assert plain_f.keys() == rec_f.keys() == {(c, i) for c in r["none"]["layers"] for i in range(M)}, where
        for key, drawn in plain_f.items():
            assert len(rec_f[key]) == len(drawn), (where, key)
            assert all(torch.equal(a, b) for (_, a), (_, b) in zip(drawn, rec_f[key])), (where, key)
        # each backward replays its own microbatch's layers: layer by layer, every mask equal to the one
        # the same layer drew in that microbatch's forward (the embedding's dropout, outside the layers,
        # is not replayed)
        rec_b = _by_action(rec["records"], "B")
        assert rec_b.keys() == rec_f.keys(), where
        for key, replayed in rec_b.items():
            original, again = _per_layer(rec_f[key]), _per_layer(replayed)
            assert len(again) == r["none"]["layers"][key[0]] and again.keys() == original.keys(), (where, key)
            assert all(layer is not None for layer, _ in replayed), (where, key)
            for layer, masks in again.items():
                assert len(masks) == len(original[layer]), (where, key, layer)
                for n, (a, b) in enumerate(zip(masks, original[layer])):
                    assert torch.equal(a, b), f"{where} {key} {layer}: replayed mask {n} differs from its forward's"
        # and the pairing matters: the two microbatches of a chunk draw different masks
        for c in r["none"]["layers"]:
            assert not any(torch.equal(a, b) for (_, a), (_, b) in zip(plain_f[(c, 0)], plain_f[(c, 1)])), (where, c)
        assert plain["loss"] == pytest.approx(rec["loss"], rel=1e-6)
        # fp32, same ops in the same order: equal up to rounding
        assert_same_grads(rec["grads"], plain["grads"], label=f"{where} recompute=layer", rtol=1e-5, atol=1e-6)
