"""Gradients and the optimizer's step across ranks.

``gradient_sync`` reduces gradients over the data-parallel group in buckets
(``flat_buffers``), summing the sequence-parallel partial gradients
(``sequence_grads``); ``distributed_optimizer`` shards the optimizer's state
over the replicas and gathers the updated parameters back (``param_gathers``);
``split_backward`` splits a chunk's backward into input and weight gradients
for the zero-bubble schedules. Their refusals are ``errors``' classes.
"""

from autopar.runtime.optim.distributed_optimizer import DistributedOptimizer
from autopar.runtime.optim.gradient_sync import GradientSync
from autopar.runtime.optim.split_backward import SplitBackward

__all__ = ["DistributedOptimizer", "GradientSync", "SplitBackward"]
