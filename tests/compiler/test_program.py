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
    # (``sequence`` is None only where sequence parallelism is off, ``async_tp`` where overlap has no
    # 'tp', ``context`` and ``context_plan`` where cp = 1: the plans of passes that did not run)
    did_not_run = {"sequence": program.config.sequence_parallel is False,
                   "async_tp": "tp" not in program.config.overlap,
                   "context": program.config.cp == 1, "context_plan": program.config.cp == 1}
    for f in dataclasses.fields(program):
        if not did_not_run.get(f.name, False):
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


def test_an_equal_model_reuses_the_trace_and_a_changed_one_traces_again(monkeypatch):
    """A second compile of an equal model (built apart, same config) on the same examples reuses the
    kept trace and gives the same code; a changed attribute, tying, example or loss traces again."""
    import autopar.compiler.trace_reuse as reuse
    from autopar.compiler.trace import lm_cross_entropy

    calls = []
    real = reuse.trace
    monkeypatch.setattr(reuse, "trace", lambda *a, **k: calls.append(1) or real(*a, **k))
    monkeypatch.setattr(reuse, "_KEPT", type(reuse._KEPT)())

    def gpt():
        torch.manual_seed(0)
        return build("gpt", vocab_size=64, seq_len=8, n_layer=2, n_head=2, d_model=16)

    x = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(0))
    first = autopar.parallelize(gpt(), tp=2, pp=2, microbatches=2, example_inputs=(x,), example_targets=x)
    again = autopar.parallelize(gpt(), tp=2, pp=2, microbatches=2, example_inputs=(x,), example_targets=x)
    other_layout = autopar.parallelize(gpt(), tp=1, pp=2, microbatches=2, example_inputs=(x,), example_targets=x)
    assert len(calls) == 1
    assert [again.code(r) for r in range(4)] == [first.code(r) for r in range(4)]
    assert other_layout.traced.gm is not first.traced.gm  # each compile rewrites its own copy

    untied = gpt()
    untied.lm_head.weight = torch.nn.Parameter(untied.lm_head.weight.detach().clone())
    autopar.parallelize(untied, example_inputs=(x,), example_targets=x)
    assert len(calls) == 2
    evaluating = gpt().eval()
    autopar.parallelize(evaluating, example_inputs=(x,), example_targets=x)
    assert len(calls) == 3
    autopar.parallelize(gpt(), example_inputs=(x[:1],), example_targets=x[:1])
    assert len(calls) == 4
    autopar.parallelize(gpt(), example_inputs=(x,), example_targets=x,
                        loss_fn=lambda logits, y: lm_cross_entropy(logits, y))
    assert len(calls) == 5
