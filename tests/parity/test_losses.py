"""Loss functions users write, on 2 gloo ranks (tp=2), against one process.

The loss is part of the traced graph, so whatever the user writes is split or
reported. With a vocabulary of 257 (prime) the split pads one column, and the
padding must not leak into:

- label smoothing (``F.cross_entropy(label_smoothing=0.1)``), the smoothing
  term's sum of logits riding in the same all-reduce;
- targets with ``ignore_index`` and ``reduction='sum'``;
- a z-loss (``logsumexp(logits)**2``): vocabulary-parallel logsumexp, padding
  masked to -inf.

With a vocabulary of 256 (no padding), losses written from the parts:

- ``nll_loss(log_softmax(logits))``;
- the log-probability of the labels by ``torch.gather`` (as preference losses
  take it): each rank picks what falls in its columns, one all-reduce sums;
- an entropy bonus, ``sum(softmax * log_softmax)`` over the vocabulary: the sum
  over the split dim is a local sum and one all-reduce;
- cross-entropy against class probabilities (distillation): the probabilities
  are sliced like the logits.

Every one of them stays vocabulary-parallel (no fallback, no linear left
whole). A log_softmax over a *padded* vocabulary has no such rule (its padded
columns would enter later sums), nor cross-entropy against class probabilities
(the probabilities have no padded columns to slice): the LM head and the
embedding stay whole, and the plan says why.

Tolerances as in test_tp_parity (fp32; the split only reorders sums).
"""

import pytest
import torch
import torch.nn.functional as F
from helpers import assert_ranks_match, compiled, reference_run, seeded, spawn_ranks, token_batches

from autopar.reference.models import build

pytestmark = pytest.mark.multiprocess
SEQ, ROWS = 16, 4


def _smooth(logits, y):
    return F.cross_entropy(logits.flatten(0, -2), y.flatten(), label_smoothing=0.1)


def _ignore_sum(logits, y):
    y = torch.where(y % 3 == 0, -100, y)
    return F.cross_entropy(logits.flatten(0, -2), y.flatten(), reduction="sum") / 64


def _zloss(logits, y):
    ce = F.cross_entropy(logits.flatten(0, -2), y.flatten())
    return ce + 1e-2 * torch.logsumexp(logits, dim=-1).pow(2).mean()


def _nll(logits, y):
    return F.nll_loss(F.log_softmax(logits, dim=-1).flatten(0, -2), y.flatten())


def _gather_logp(logits, y):
    return -torch.gather(F.log_softmax(logits, dim=-1), -1, y.unsqueeze(-1)).mean()


def _entropy_bonus(logits, y):
    entropy = -(F.softmax(logits, -1) * F.log_softmax(logits, -1)).sum(-1).mean()
    return F.cross_entropy(logits.flatten(0, -2), y.flatten()) - 0.01 * entropy


def _soft_targets(logits, y):
    probs = F.one_hot(y.flatten(), logits.shape[-1]).float() * 0.9 + 0.1 / logits.shape[-1]
    return F.cross_entropy(logits.flatten(0, -2), probs)


# name -> (loss, vocabulary)
LOSSES = {"label_smoothing": (_smooth, 257), "ignore_index_sum": (_ignore_sum, 257), "z_loss": (_zloss, 257),
          "nll_of_log_softmax": (_nll, 256), "gather_log_prob": (_gather_logp, 256),
          "entropy_bonus": (_entropy_bonus, 256), "padded_log_softmax": (_nll, 257),
          "soft_targets": (_soft_targets, 256), "padded_soft_targets": (_soft_targets, 257)}


def _loss_gpt(vocab):
    return seeded(build, "gpt", vocab_size=vocab, seq_len=SEQ, n_layer=2, n_head=4, d_model=64)


def _loss_batches(vocab):
    return token_batches(vocab, steps=1, rows=ROWS, seed=2, seq=SEQ)


def _loss_program(name):
    loss_fn, vocab = LOSSES[name]
    data = _loss_batches(vocab)
    return compiled(_loss_gpt(vocab), tp=2, loss_fn=loss_fn, example_inputs=data[0][0], example_targets=data[0][1],
                    world_size=2)


def _train_one_step_per_loss():
    out = {}
    for name, (loss_fn, vocab) in LOSSES.items():
        data = _loss_batches(vocab)
        program = _loss_program(name)  # inherited from the test process
        engine = program.materialize()
        loss = engine.train_step(*data[0][0], *data[0][1])
        kinds = {d.kind for d in program.plan.decisions.values()}
        out[name] = (loss, engine.full_grads(), program.fallbacks(), program.plan.rejected, kinds)
    return out


@pytest.fixture(scope="module")
def loss_runs():
    for name in LOSSES:  # compile once here: the ranks inherit the programs
        _loss_program(name)
    return spawn_ranks(_train_one_step_per_loss, 2, timeout_s=600)


@pytest.mark.parametrize("name", list(LOSSES))
def test_loss_matches_one_process(loss_runs, name):
    loss_fn, vocab = LOSSES[name]
    per_rank = [([res[name][0]], [res[name][1]]) for res in loss_runs]  # one step: (losses, gradients)
    assert_ranks_match(reference_run(_loss_gpt(vocab), _loss_batches(vocab), loss_fn=loss_fn), per_rank, label=name)


VOCAB_KINDS = {"label_smoothing": {"vocab_cross_entropy"}, "ignore_index_sum": {"vocab_cross_entropy"},
               "z_loss": {"vocab_cross_entropy", "vocab_softmax"}, "nll_of_log_softmax": {"vocab_softmax", "vocab_nll"},
               "gather_log_prob": {"vocab_softmax", "vocab_gather"},
               "entropy_bonus": {"vocab_cross_entropy", "vocab_softmax"}, "soft_targets": {"vocab_cross_entropy"}}


@pytest.mark.parametrize("name", list(VOCAB_KINDS))
def test_losses_stay_vocabulary_parallel(loss_runs, name):
    _, _, fallbacks, rejected, kinds = loss_runs[0][name]
    assert fallbacks == [] and rejected == [], (fallbacks, rejected)
    assert VOCAB_KINDS[name] <= kinds, kinds


def test_log_softmax_over_a_padded_vocabulary_keeps_the_vocabulary_whole_and_says_so(loss_runs):
    _, _, fallbacks, rejected, kinds = loss_runs[0]["padded_log_softmax"]
    assert not any(k.startswith("vocab_") for k in kinds) and fallbacks == []
    assert any(r.module == "lm_head" and "softmax over the sharded dim" in r.reason for r in rejected), rejected


def test_soft_targets_over_a_padded_vocabulary_keep_it_whole_and_say_so(loss_runs):
    _, _, fallbacks, rejected, kinds = loss_runs[0]["padded_soft_targets"]
    assert not any(k.startswith("vocab_") for k in kinds) and fallbacks == []
    assert any(r.module == "lm_head" and "class probabilities" in r.reason for r in rejected), rejected
