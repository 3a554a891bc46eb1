"""The tensor- and sequence-parallel collectives trace into one graph under torch.compile.

Traced by dynamo, ``all_reduce``, ``all_gather_dim`` and ``reduce_scatter_dim``
become PyTorch's functional collectives (in eager they keep their own path,
pairwise exchanges included), so a chunk with f and g in every layer, the
vocabulary-parallel embedding and loss, and with sequence parallelism its
gathers and reduce-scatters, is one graph with no break. Compiled with
``aot_eager`` (AOTAutograd's forward and backward graphs run op by op: the same
kernels as eager, so the same bits), a training step's loss and every
gradient equal eager's exactly.
"""

import pytest
import torch
from helpers import parallelize_on, spawn_ranks, token_batches

from autopar.reference.models import build

pytestmark = pytest.mark.multiprocess
VOCAB, SEQ = 64, 16


def _traceable_program(sequence_parallel: bool):
    torch.manual_seed(0)
    model = build("gpt", vocab_size=VOCAB, seq_len=SEQ, n_layer=2, n_head=2, d_model=32)
    data = token_batches(VOCAB, steps=1, rows=2, seq=SEQ, seed=3)
    # overlap=False: the chunk is compiled here directly, and the fused ops' point-to-point ring cannot be
    # traced (under compile= the async TP pass leaves the collectives whole)
    return parallelize_on(model, data, 2, tp=2, sequence_parallel=sequence_parallel, overlap=False), data


def _eager_then_compiled(sequence_parallel: bool):
    import torch._dynamo as dynamo

    program, data = _traceable_program(sequence_parallel)
    (inputs, targets), = data
    engine = program.materialize()
    eager_loss = engine.train_step(*inputs, *targets)
    eager_grads = engine.full_grads()
    compute = engine.compute
    graphs = {}
    for c, run in compute.runnables.items():
        explained = dynamo.explain(run)(*compute.chunk_args(compute.chunks[c], [*inputs, *targets], []))
        graphs[c] = (explained.graph_count, explained.graph_break_count, [str(r.reason) for r in explained.break_reasons])
    dynamo.reset()
    compute.runnables = {c: torch.compile(run, backend="aot_eager") for c, run in compute.runnables.items()}
    for p in engine.parameters():
        p.grad = None
    loss = engine.train_step(*inputs, *targets)
    return graphs, (eager_loss, eager_grads), (loss, engine.full_grads())


@pytest.mark.parametrize("sequence_parallel", [False, True], ids=["tp2", "tp2-sp"])
def test_a_tensor_parallel_chunk_is_one_graph_and_compiles_to_eagers_bits(sequence_parallel):
    _traceable_program(sequence_parallel)  # compiled here, inherited by the ranks
    for rank, (graphs, (eager_loss, eager_grads), (loss, grads)) in enumerate(
            spawn_ranks(_eager_then_compiled, 2, sequence_parallel)):
        assert graphs == {0: (1, 0, [])}, (rank, graphs)  # one chunk, one graph, no break
        assert loss == eager_loss, (rank, loss, eager_loss)
        assert grads.keys() == eager_grads.keys()
        for name in grads:
            torch.testing.assert_close(grads[name], eager_grads[name], rtol=0, atol=0, msg=f"rank {rank} {name}")
