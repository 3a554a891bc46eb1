"""How a step's microbatch losses make its loss: the weights of the loss and of the backward's seed.

One device computes a mean-reduced cross-entropy over every target of the
global batch that is not the ``ignore_index``: sum over the counted tokens / N.
A pipeline computes it per microbatch (the mean over its n_i counted tokens),
so the one-device loss is sum_i n_i / N * loss_i over every microbatch of every
data-parallel replica. With ``loss_reduction='tokens'`` (the default) and a
token loss found in the graph (``BatchRoles.loss``), microbatch i's loss gets
weight n_i / N; N sums the replicas' counts (exchanged before the step, with
the id checks: ``batch_checks.agree``). Every other case weights microbatches
equally, 1 / (m d): exact whenever they count the same tokens, as a loss with
no ignore_index does (all microbatches have one shape).

The weights ``w_i`` multiply the reported loss (summed over the replicas). The
backward is seeded with ``d * w_i``, since the data-parallel reduction averages
gradients over the d replicas (``runtime/optim/gradient_sync.py``): the averaged
gradient is then sum over every replica's microbatches of w_i * grad loss_i.

With context parallelism (c > 1) each of the c ranks of a replica holds 1/c of
every microbatch's tokens and its graph's loss is the mean over its own counted
targets: n_i counts that rank's targets, N sums over all d x c ranks, the
gradients are averaged over the d x c ranks ('dp_cp'), so the seed is
``d c n_i / N``, and the reported loss is summed over the d x c ranks. Summed
over the c ranks, the n_i / N weighted means are the microbatch's own share of
the one-device mean: sum over its counted tokens / N.

An empty microbatch (n_i = 0, its mean 0/0 = NaN) gets weight 0 and no
backward at all (its gradients are zero), so it adds nothing instead of
poisoning the step; the engine skips its loss and backward. When the whole
global batch is empty (N = 0) the loss is NaN and the gradients zero, as
``F.cross_entropy`` gives on one device.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from autopar.compiler.batch_roles import TokenLoss

__all__ = ["StepWeights", "token_counts", "step_weights", "equal_weights"]


@dataclass(frozen=True)
class StepWeights:
    """The weights of one step's microbatches on this replica."""

    loss: tuple[float, ...]
    """Microbatch i's loss is multiplied by ``loss[i]`` in the reported loss (summed over replicas);
    NaN when the global batch counts no target; 0: nothing added (an empty microbatch)."""
    seed: tuple[float, ...]
    """The gradient the backward starts from for microbatch i's loss; 0: no backward."""
    counts: tuple[int, ...] | None = None
    """This replica's counted targets per microbatch (None: microbatches weighted equally)."""
    total: int | None = None
    """N: counted targets of the global batch, every replica's (every cp rank's)."""


def token_counts(loss: "TokenLoss", targets, micro: list[dict[str, torch.Tensor]]) -> list[int]:
    """The targets not equal to the ignore_index in each microbatch: the loss's own targets, computed
    from the batch tensors by ``targets`` (``loss.targets`` on the engine's device)."""
    counts = [(targets(*(tensors[name] for name in loss.reads)) != loss.ignore_index).sum() for tensors in micro]
    return [int(n) for n in torch.stack(counts).tolist()]  # one transfer from the device


def equal_weights(m: int, d: int) -> StepWeights:
    """Every microbatch of every replica alike: the mean of the microbatch means."""
    return StepWeights(loss=(1.0 / (m * d),) * m, seed=(1.0 / m,) * m)


def step_weights(counts: list[int], total: int, d: int) -> StepWeights:
    """n_i / N for the loss, d n_i / N for the seed; NaN loss and no backward when N = 0. ``d``: the
    ranks the gradients are averaged over (d x c with context parallelism)."""
    if total == 0:
        return StepWeights(loss=(float("nan"),) * len(counts), seed=(0.0,) * len(counts), counts=tuple(counts),
                           total=0)
    return StepWeights(loss=tuple(n / total for n in counts), seed=tuple(d * n / total for n in counts),
                       counts=tuple(counts), total=total)
