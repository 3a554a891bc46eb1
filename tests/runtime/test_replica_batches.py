"""Per-replica batches: each data-parallel replica passes its own rows (a data loader per replica).

On 4 gloo ranks (``eval_ranks.py``'s spawn, pp=2 x virtual_stages=2 x dp=2):
``train_step`` on this replica's rows gives the loss and gradients of the
global batch bit for bit (a fresh engine each time, so the same dropout masks),
and ``eval_step`` the same loss; a ``DistributedSampler`` set up from
``engine.dp_rank`` / ``engine.dp_size`` hands the replicas disjoint rows whose
evaluation averages to the single-device ``eval()`` loss. A batch of neither
size, or mixing the two, is refused naming both accepted shapes. On one rank
the two forms are the same and the message names one shape.
"""

import pytest
import torch
import torch.nn.functional as F
from eval_ranks import LAYOUTS, MB, SEQ, M, batch, model, results

import autopar


@pytest.fixture(scope="module")
def replicas():
    return [r["replica"] for r in results()]


@pytest.mark.multiprocess
def test_engine_names_its_replica(replicas):
    # ranks (pp, dp, tp) with tp = 1: rank = pp * dp_size + dp
    assert [r["dp"] for r in replicas] == [(0, 2), (1, 2), (0, 2), (1, 2)]


@pytest.mark.multiprocess
def test_replica_batch_gives_the_global_step(replicas):
    """Bit for bit: the replica's rows are the ones it slices out of the global batch."""
    for rank, r in enumerate(replicas):
        assert r["loss_replica"] == r["loss_global"], rank
        assert r["eval_replica"] == r["eval_global"], rank
        assert r["grads_replica"].keys() == r["grads_global"].keys()
        for name, g in r["grads_global"].items():
            assert torch.equal(r["grads_replica"][name], g), (rank, name)
    assert len({r["loss_global"] for r in replicas}) == 1  # averaged over the replicas: the same everywhere


@pytest.mark.multiprocess
def test_distributed_sampler_from_the_engine(replicas):
    """The sampler splits the rows between the replicas (strided, not the global batch's halves); the
    mean of the replicas' evaluations is the single-device eval() loss of all the rows."""
    rows = LAYOUTS["pp2v2"]["dp"] * M * MB
    by_replica = {r["dp"][0]: r["sampler_rows"] for r in replicas}
    assert sorted(by_replica[0] + by_replica[1]) == list(range(rows)) and by_replica[0] == [0, 2, 4, 6]
    x, y = batch(LAYOUTS["pp2v2"]["dp"])
    with torch.no_grad():
        want = float(autopar.lm_cross_entropy(model().eval()(x), y))
    for rank, r in enumerate(replicas):
        # fp32 on both sides; the parallel run only reorders sums (microbatch and replica means
        # of equal-size parts): within 1e-5 relative of a loss of about 6
        torch.testing.assert_close(r["eval_loader"], want, rtol=1e-5, atol=1e-6, msg=lambda m, rank=rank: f"rank {rank}: {m}")


@pytest.mark.multiprocess
def test_wrong_batch_size_names_both_shapes(replicas):
    for r in replicas:
        size, mixed = r["errors"]["size"], r["errors"]["mixed"]
        assert f"has shape (3, {SEQ})" in size
        assert f"({2 * M * MB}, {SEQ}), the global batch (2 data-parallel replicas x {M} microbatch(es)" in size
        assert f"or ({M * MB}, {SEQ}), this replica's own batch ({M} microbatch(es)" in size
        assert f"replica {r['dp'][0]} of 2" in size
        assert "mixes the global batch and this replica's" in mixed and "global" in mixed


def test_one_replica_names_one_shape():
    """dp = 1: the global batch is the replica's, and the message names that one shape."""
    torch.manual_seed(0)
    net = torch.nn.Linear(4, 2)
    x, y = torch.randn(6, 4), torch.randn(6, 2)
    program = autopar.parallelize(net, microbatches=3, example_inputs=(x[:2],), example_targets=y[:2],
                                  loss_fn=F.mse_loss)
    engine = program.materialize()
    assert (engine.dp_rank, engine.dp_size) == (0, 1)
    with pytest.raises(ValueError, match=r"'input_' has shape \(4, 4\), but the program expects \(6, 4\): "
                                         r"3 microbatch\(es\) of \(2, 4\) \(the example microbatch's shape\)$"):
        engine.eval_step(x[:4], y[:4])
