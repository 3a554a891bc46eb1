"""Loss functions users write, on 2 gloo ranks (tp=2), against one process.

The loss is part of the traced graph, so whatever the user writes is split or
reported. A vocabulary of 257 (prime) makes the split pad one column, so the
padding must not leak into any of these:

- label smoothing (``F.cross_entropy(label_smoothing=0.1)``): vocabulary
  parallel, the smoothing term's sum of logits riding in the same all-reduce;
- targets with ``ignore_index`` and ``reduction='sum'``: vocabulary parallel;
- a z-loss (``logsumexp(logits)**2``): the logsumexp has no vocabulary-parallel
  rule, so it runs on gathered logits, correct and listed as a fallback.

Tolerances as in test_tp_parity (fp32; the split only reorders sums).
"""

import pytest
import torch
import torch.nn.functional as F

import autopar
from autopar.models import build
from autopar.parity import FP32_TOLERANCE, assert_parity, single_device_run

pytestmark = pytest.mark.multiprocess
VOCAB, SEQ, ROWS = 257, 16, 4


def _smooth(logits, y):
    return F.cross_entropy(logits.flatten(0, -2), y.flatten(), label_smoothing=0.1)


def _ignore_sum(logits, y):
    y = torch.where(y % 3 == 0, -100, y)
    return F.cross_entropy(logits.flatten(0, -2), y.flatten(), reduction="sum") / 64


def _zloss(logits, y):
    ce = F.cross_entropy(logits.flatten(0, -2), y.flatten())
    return ce + 1e-2 * torch.logsumexp(logits, dim=-1).pow(2).mean()


LOSSES = {"label_smoothing": _smooth, "ignore_index_sum": _ignore_sum, "z_loss": _zloss}


def _model():
    torch.manual_seed(0)
    return build("gpt", vocab_size=VOCAB, seq_len=SEQ, n_layer=2, n_head=4, d_model=64)


def _data():
    g = torch.Generator().manual_seed(2)
    return [((torch.randint(0, VOCAB, (ROWS, SEQ), generator=g),), (torch.randint(0, VOCAB, (ROWS, SEQ), generator=g),))]


def _worker():
    out = {}
    for name, loss_fn in LOSSES.items():
        data = _data()
        program = autopar.parallelize(_model(), tp=2, loss_fn=loss_fn, example_inputs=data[0][0],
                                      example_targets=data[0][1])
        engine = program.materialize()
        loss = engine.train_step(*data[0][0], *data[0][1])
        kinds = {d.kind for d in program.plan.decisions.values()}
        out[name] = (loss, engine.full_grads(), program.fallbacks(), program.plan.rejected, kinds)
    return out


@pytest.fixture(scope="module")
def results():
    return autopar.spawn(_worker, 2, timeout_s=600)


@pytest.mark.parametrize("name", list(LOSSES))
def test_loss_matches_one_process(results, name):
    ref_losses, ref_grads = single_device_run(_model(), _data(), LOSSES[name])
    for rank, res in enumerate(results):
        loss, grads, _, _, _ = res[name]
        assert_parity(ref_losses, ref_grads[0], [loss], grads, label=f"{name} rank {rank}", **FP32_TOLERANCE)


@pytest.mark.parametrize("name", ["label_smoothing", "ignore_index_sum"])
def test_cross_entropy_variants_stay_vocabulary_parallel(results, name):
    _, _, fallbacks, rejected, kinds = results[0][name]
    assert "vocab_cross_entropy" in kinds and fallbacks == [] and rejected == []


def test_z_loss_runs_on_gathered_logits_and_says_so(results):
    _, _, fallbacks, _, kinds = results[0]["z_loss"]
    assert "vocab_cross_entropy" in kinds
    assert [f[0] for f in fallbacks] == ["logsumexp"] and "sharded dim" in fallbacks[0][1]
