"""The compiled program is built whole by the compile pipeline and then frozen.

No process group: these compile small reference models and look at the result.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

import autopar
from autopar.compiler.compile import PASSES
from autopar.core.activation_recompute import Checkpointed
from autopar.reference.models import build

LAYERS, TP, PP = 4, 2, 2


def _compile_gpt(recompute: str = "none"):
    torch.manual_seed(0)
    model = build("gpt", n_layer=LAYERS)
    x = torch.randint(0, 256, (2, 32))
    y = torch.randint(0, 256, (2, 32))
    return autopar.parallelize(model, tp=TP, pp=PP, microbatches=PP, example_inputs=(x,), example_targets=y,
                               recompute=recompute, world_size=TP * PP)


def test_the_program_is_frozen():
    program = _compile_gpt()
    with pytest.raises(dataclasses.FrozenInstanceError):
        program.schedule = None
    # every field was given at construction: none is left empty for a later step to fill in
    # (``sequence`` is None only where sequence parallelism is off: the plan of a pass that did not run)
    for f in dataclasses.fields(program):
        if f.name != "sequence" or program.config.sequence_parallel is not False:
            assert getattr(program, f.name) is not None, f.name
    assert PASSES.index("annotate_local_shapes") < PASSES.index("split_pipeline") < PASSES.index("recompute")


def test_local_shapes_have_their_own_metadata_key():
    program = _compile_gpt()
    traced = {n.name: n for n in program.traced.gm.graph.nodes}
    sharded = 0
    for node in program.rank_module.graph.nodes:
        local = node.meta.get("local_val")
        if node.op == "output" or node.name == "tp":
            continue
        assert isinstance(local, torch.Tensor), node.name
        glob = node.meta.get("val")
        if node.name in traced and isinstance(glob, torch.Tensor):
            # the global value is never overwritten: it still equals the traced graph's
            assert tuple(glob.shape) == tuple(traced[node.name].meta["val"].shape), node.name
            if tuple(local.shape) != tuple(glob.shape):
                sharded += 1
                # a sharded value is 1/tp of the global one along one dim
                assert local.numel() * TP == glob.numel(), node.name
    assert sharded > 0
    # local_shapes(rank) is a query: the graph's metadata is the same after it
    before = {n.name: n.meta.get("local_val") for n in program.rank_module.graph.nodes}
    shapes = program.local_shapes(rank=1)
    after = {n.name: n.meta.get("local_val") for n in program.rank_module.graph.nodes}
    assert before == after
    assert all(shapes[name] == tuple(v.shape) for name, v in before.items() if isinstance(v, torch.Tensor))


@pytest.mark.parametrize("recompute, regions", [("none", 0), ("layer", LAYERS), ("chunk", PP)])
def test_recomputation_is_applied_at_compile_time_and_shown(recompute, regions):
    program = _compile_gpt(recompute)
    found = [m for c in program.split.chunks for m in c.module.modules() if isinstance(m, Checkpointed)]
    assert len(found) == regions
    shown = sum(program.code(rank=r).count("# checkpointed (") for r in range(0, TP * PP, TP))
    assert shown == regions
    if recompute == "layer":
        assert sorted(m.label for m in found) == [f"layer {i}" for i in range(LAYERS)]


def test_the_shipped_corpus_is_found():
    """The main example trains on the repository's own text: it must be found wherever the module lives."""
    from autopar.reference.data import CorpusBatches, corpus

    data = corpus()
    assert data.numel() > 100_000 and int(data.max()) < 256
    x, y = CorpusBatches(2, 16).next()
    assert x.shape == y.shape == (2, 16)
    assert torch.equal(x[:, 1:], y[:, :-1])
