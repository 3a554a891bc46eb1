"""Tensor-parallel communication: Megatron's collectives as autograd functions, one module per concern.

- ``group``           ``TPGroup`` (this rank's place in its group) and the primitives the
                      rest are built from: all-reduce, all-gather, reduce-scatter, local slices
- ``tp_mappings``     f and g of tensor parallelism (``copy_to_tp``, ``reduce_from_tp``) and
                      the fallback gather and scatter (``gather_from_tp``, ``scatter_to_tp``)
- ``sp_mappings``     f and g of sequence parallelism (``gather_from_sp``, ``reduce_scatter_to_sp``)
- ``async_tp``        those collectives decomposed in tp ring steps under the GEMMs next to them
                      (``all_gather_matmul``, ``matmul_reduce_scatter``)
- ``kept_slices``     ``keeping_gathered_slices``: the consumers of a value ``gather_from_sp``
                      made save this rank's slice and gather it again in the backward
- ``vocab_parallel``  the vocabulary-parallel embedding, losses and softmax family
- ``random_streams``  ``tp_rng_call``: a random op on a shard draws this rank's own stream

Each communicating function short-circuits when the group has one rank and is registered
once with ``@collective`` where it is defined (its label, direction, kinds and bytes per
call: ``autopar.core.collectives``, which the plan summary and the cost figures read).
They take the group as an explicit argument (a ``TPGroup``), which the rewritten graphs
receive as their first placeholder ``tp``: ``print(program.code(rank=1))`` shows every
collective by name. The passes insert them as ``comm.<name>``, from this package.
"""

from __future__ import annotations

from autopar.core.comm.group import TPGroup, all_gather, in_buckets, local_slice, whole_from_shards, wholes_from_shards
from autopar.core.comm.kept_slices import keeping_gathered_slices, release_regathered
from autopar.core.comm.random_streams import seed_forked, tp_rng_call
from autopar.core.comm.sp_mappings import gather_from_sp, reduce_scatter_to_sp
from autopar.core.comm.async_tp import all_gather_matmul, matmul_reduce_scatter
from autopar.core.comm.tp_mappings import copy_to_tp, gather_from_tp, reduce_from_tp, scatter_to_tp
import autopar.core.comm.vocab_parallel as vocab_parallel
from autopar.core.comm.vocab_parallel import (vocab_parallel_cross_entropy, vocab_parallel_embedding,
                                              vocab_parallel_embedding_sp, vocab_parallel_gather,
                                              vocab_parallel_log_softmax, vocab_parallel_logsumexp,
                                              vocab_parallel_nll_loss, vocab_parallel_soft_cross_entropy,
                                              vocab_parallel_softmax)

__all__ = ["TPGroup", "all_gather", "local_slice", "whole_from_shards", "wholes_from_shards", "in_buckets",
           "copy_to_tp", "reduce_from_tp", "gather_from_tp", "scatter_to_tp", "reduce_scatter_to_sp", "gather_from_sp",
           "all_gather_matmul", "matmul_reduce_scatter", "keeping_gathered_slices",
           "release_regathered", *vocab_parallel.__all__, "seed_forked", "tp_rng_call"]
