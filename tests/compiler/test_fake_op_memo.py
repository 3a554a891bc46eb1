"""Rebuilt fake results (``compiler/fake_op_memo.py``) are what running every op gives.

The rank graphs of repeated layers are run on fake tensors twice, with and
without the memo: every node's value must have the same geometry, dtype,
device, view-ness and base, and share storage with the same other values.
"""

import pytest
import torch
import torch.utils._pytree as pytree
from torch.multiprocessing.reductions import StorageWeakRef

import autopar
from autopar.compiler.compile import _param_local_shapes
from autopar.compiler.fake_op_memo import FakeOpMemo, _meta
from autopar.compiler.local_shapes import propagate_local_shapes
from autopar.reference.models import build


def _program(family: str, **layout):
    torch.manual_seed(0)
    model = build(family, vocab_size=64, seq_len=8, n_layer=3, n_head=4, d_model=32, dropout=0.1)
    x = torch.randint(0, 64, (2, 8))
    return autopar.parallelize(model, example_inputs=(x,), example_targets=x.clone(), **layout)


def _described(values: dict) -> dict:
    """Each node's value: per tensor leaf its metadata, its base's, and the first earlier leaf (over all
    nodes, in order) whose storage it shares."""
    first_of: dict = {}
    out = {}
    for name, value in values.items():
        leaves = []
        for leaf in pytree.tree_leaves(value):
            if isinstance(leaf, torch.Tensor):
                storage = first_of.setdefault(StorageWeakRef(leaf.untyped_storage()), (name, len(leaves)))
                base = _meta(leaf._base) if leaf._is_view() else None
                leaves.append((_meta(leaf)[2:], base and base[2:], storage))
            else:
                leaves.append(leaf)
        out[name] = (type(value), leaves)
    return out


@pytest.mark.parametrize("family, layout", [("gpt", dict(tp=2)), ("llama", dict(tp=2, sequence_parallel=True))])
def test_rebuilt_values_equal_those_of_running_every_op(family, layout, monkeypatch):
    program = _program(family, **layout)
    local_shape = _param_local_shapes(program.traced, program.plan, program.config.tp).__getitem__
    memos, calls = [], []
    call = FakeOpMemo.call

    def counted(self, target, args, kwargs, run):
        memos.append(self)
        calls.append(target)
        return call(self, target, args, kwargs, run)

    monkeypatch.setattr(FakeOpMemo, "call", counted)
    reused = propagate_local_shapes(program.rank_module, 1, 2, program.traced.param_of, local_shape)
    monkeypatch.setattr(FakeOpMemo, "call", lambda self, target, args, kwargs, run: run())
    ran = propagate_local_shapes(program.rank_module, 1, 2, program.traced.param_of, local_shape)
    recipes = [r for r in memos[0].recipes.values() if r is not None]
    assert recipes and len(calls) > 2 * len(memos[0].recipes)  # the layers' ops were rebuilt, not run
    assert _described(reused) == _described(ran)
