"""The sharding-rule registry: a rule added from outside is used, and the registry's structure.

(a) A custom op (``torch.library``, defined here) has no rule: on a split value
    it runs replicated and the plan lists it as a fallback. A rule registered
    from this file alone takes over: the plan's decision for the node is the
    rule's, the fallback is gone, and the rank program's local shapes are split.
(b) Every op the registry claims resolves to exactly one rule; the matmul
    family's einsum equations place a column and a row split as Megatron does.
"""

from __future__ import annotations

import pytest
import torch
import torch.fx as fx
import torch.nn as nn
import torch.nn.functional as F

import autopar
from autopar.core import comm
from autopar.core.collectives import ALL_GATHER, ALL_REDUCE, collective_named, registered, wire_factor
from autopar.core.tensor_placement import Replicate, Shard
from passes.rules import RULES, Ctx, Decision, register_rule, unregister_rule
from passes.rules.einsum import BADDBMM, EINSUM, MATMUL, contract, equation_of

aten = torch.ops.aten
V, E, HIDDEN, B, S = 48, 16, 64, 2, 8


@torch.library.custom_op("autopar_test::softsign", mutates_args=())
def softsign(x: torch.Tensor) -> torch.Tensor:
    return x / (1 + x.abs())


@softsign.register_fake
def _(x):
    return torch.empty_like(x)


class RegistryBlock(nn.Module):
    """An MLP whose hidden value also feeds a custom op, summed over the hidden dim."""

    def __init__(self):
        super().__init__()
        self.fc, self.proj = nn.Linear(E, HIDDEN), nn.Linear(HIDDEN, E)

    def forward(self, x):
        h = F.gelu(self.fc(x))
        return x + self.proj(h) + softsign(h).sum(-1, keepdim=True)


class RegistryLM(nn.Module):
    def __init__(self):
        super().__init__()
        self.wte, self.ln, self.head = nn.Embedding(V, E), nn.LayerNorm(E), nn.Linear(E, V, bias=False)
        self.layers = nn.ModuleList(RegistryBlock() for _ in range(2))

    def forward(self, ids):
        x = self.wte(ids)
        for layer in self.layers:
            x = layer(x)
        return self.head(self.ln(x))


def _compile_lm_tp2():
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(1)
    x, y = torch.randint(0, V, (B, S), generator=g), torch.randint(0, V, (B, S), generator=g)
    return autopar.parallelize(RegistryLM(), tp=2, example_inputs=(x,), example_targets=y, sequence_parallel=False)


def _custom_nodes(program) -> list[str]:
    return [n.name for n in program.traced.gm.graph.nodes if n.target == torch.ops.autopar_test.softsign.default]


def test_a_rule_registered_from_outside_replaces_the_fallback():
    before = _compile_lm_tp2()
    nodes = _custom_nodes(before)
    assert len(nodes) == 2
    reasons = {name: reason for name, reason, _ in before.fallbacks()}
    assert set(reasons) == set(nodes)
    assert all(r == "no sharding rule for autopar_test.softsign.default" for r in reasons.values())

    calls = []

    @register_rule(torch.ops.autopar_test.softsign.default)
    def softsign_rule(ctx: Ctx, node: fx.Node, pl) -> Decision:  # element-wise: placed like its input
        calls.append(node.name)
        return Decision(pl[node.args[0]], kind="sharded")

    try:
        assert RULES.lookup(torch.ops.autopar_test.softsign.default).rule is softsign_rule
        after = _compile_lm_tp2()
    finally:
        unregister_rule(torch.ops.autopar_test.softsign.default)
    assert RULES.lookup(torch.ops.autopar_test.softsign.default) is None

    assert set(calls) == set(nodes)
    for name in nodes:
        dec = after.plan.decisions[name]
        assert dec.kind == "sharded" and dec.out == Shard(2) and dec.gather_in == ()
    assert after.fallbacks() == []
    shapes = after.local_shapes(rank=1)
    assert all(shapes[name] == (B, S, HIDDEN // 2) for name in nodes)
    # the sum over the split hidden dim is now a local sum and g: one more forward all-reduce a layer
    per_layer = after.collectives(by_layer=True)
    assert [per_layer[(layer, "reduce_from_tp")] for layer in range(2)] == [2, 2]
    assert "gather_from_tp" not in after.collectives()


def _claims(key) -> set:
    """The op overloads a registry key stands for."""
    if isinstance(key, torch._ops.OpOverload):
        return {key}
    if isinstance(key, torch._ops.OpOverloadPacket):
        return {getattr(key, o) for o in key.overloads()}
    if isinstance(key, str):
        ns, name = key.split("::")
        packet = getattr(getattr(torch.ops, ns), name, None) if hasattr(torch.ops, ns) else None
        return _claims(packet) if packet is not None else set()
    return {key}  # a plain callable (operator.getitem)


def test_every_claimed_op_resolves_to_exactly_one_rule():
    keys = RULES.keys()
    assert len(keys) >= 80
    owners: dict = {}
    for key in keys:
        for op in _claims(key):
            owners.setdefault(op, []).append(key)
    shared = {str(op): ks for op, ks in owners.items() if len(ks) > 1}
    assert shared == {}, f"ops claimed by several keys: {shared}"
    for op, (key,) in owners.items():
        assert RULES.lookup(op) is RULES.entry(key), op
    # an explicit rule wins over the pointwise tag (clone is tagged pointwise)
    assert torch.Tag.pointwise in aten.clone.default.tags
    assert RULES.lookup(aten.clone.default).rule.__name__ == "same_as_input"
    assert RULES.lookup(aten.add.Tensor).key == torch.Tag.pointwise
    assert RULES.lookup(aten.sort.default) is None
    # a key is registered once
    with pytest.raises(ValueError, match="already have a sharding rule"):
        register_rule(aten.mm.default)(lambda ctx, node, pl: Decision(Replicate()))


def test_every_collective_is_registered_once_with_its_bytes_and_direction():
    names = {c.name for c in registered()}
    assert names == {"copy_to_tp", "reduce_from_tp", "gather_from_tp", "scatter_to_tp", "vocab_parallel_embedding",
                     "vocab_parallel_embedding_sp", "vocab_parallel_cross_entropy", "vocab_parallel_logsumexp", "vocab_parallel_softmax",
                     "vocab_parallel_log_softmax", "vocab_parallel_nll_loss", "vocab_parallel_soft_cross_entropy",
                     "reduce_scatter_to_sp", "gather_from_sp", "all_gather_matmul", "matmul_reduce_scatter"}
    assert collective_named("copy_to_tp").fn is comm.copy_to_tp
    assert collective_named("copy_to_tp").direction == "bwd all-reduce"
    assert collective_named("scatter_to_tp").kinds == (ALL_GATHER,)
    assert wire_factor(ALL_REDUCE, 4) == 1.5 and wire_factor(ALL_GATHER, 4) == 0.75 and wire_factor(ALL_REDUCE, 1) == 0


def _node(graph: fx.Graph, target, args, shape, kwargs=None) -> fx.Node:
    node = graph.call_function(target, args, kwargs or {})
    node.meta["val"] = torch.empty(shape, device="meta")
    return node


def _inputs(graph: fx.Graph, **shapes) -> dict[str, fx.Node]:
    out = {}
    for name, shape in shapes.items():
        out[name] = graph.placeholder(name)
        out[name].meta["val"] = torch.empty(shape, device="meta")
    return out


CTX = Ctx(tp=2, param_of={}, requires_grad={"x", "w", "bias", "a", "b", "inp"}, vocab_embeddings=set())


def _decide(node, family=MATMUL, **placements):
    pl = {a: placements.get(a.name, Replicate()) for a in node.all_input_nodes}
    return contract(CTX, node, pl, equation_of(node), family)


def test_matmul_family_equations_split_columns_and_rows():
    g = fx.Graph()
    v = _inputs(g, x=(B, S, E), w=(HIDDEN, E), bias=(HIDDEN,), a=(B * S, E), b=(E, HIDDEN), inp=(HIDDEN,),
                q=(B, 4, S, 8), k=(B, 4, 8, S), b1=(4, S, 8), b2=(4, 8, S), alibi=(4, 1, S))
    mm = _node(g, aten.mm.default, (v["a"], v["b"]), (B * S, HIDDEN))
    linear = _node(g, aten.linear.default, (v["x"], v["w"], v["bias"]), (B, S, HIDDEN))
    addmm = _node(g, aten.addmm.default, (v["inp"], v["a"], v["b"]), (B * S, HIDDEN))
    matmul = _node(g, aten.matmul.default, (v["q"], v["k"]), (B, 4, S, S))
    baddbmm = _node(g, aten.baddbmm.default, (v["alibi"], v["b1"], v["b2"]), (4, S, S))
    einsum = _node(g, aten.einsum.default, ("bhqd,bhdk->bhqk", [v["q"], v["k"]]), (B, 4, S, S))
    assert [str(equation_of(n)) for n in (mm, linear, addmm, matmul, baddbmm, einsum)] == [
        "mk,kn->mn", "abk,nk->abn + n", "ak,kn->an + n", "abmk,abkn->abmn", "bmk,bkn->bmn + bmn", "bhqd,bhdk->bhqk"]

    # column: the weight split on its output features; the replicated input read whole (f)
    col = _decide(mm, b=Shard(1))
    assert (col.out, col.copy_in, col.reduce_out) == (Shard(1), (("a", 0),), False)
    col = _decide(linear, w=Shard(0), bias=Shard(0))
    assert (col.out, col.copy_in, col.scatter_in) == (Shard(2), (("a", 0),), ())
    col = _decide(addmm, b=Shard(1))  # a replicated bias is sliced like the output
    assert (col.out, col.scatter_in) == (Shard(1), ((("a", 0), Shard(0)),))
    # row: input and weight split on the contraction: a partial sum, g after it, the bias added after g
    row = _decide(mm, a=Shard(1), b=Shard(0))
    assert (row.out, row.kind, row.reduce_out, row.add_after_reduce) == (Replicate(), "row", True, None)
    row = _decide(linear, x=Shard(2), w=Shard(1))
    assert (row.out, row.kind, row.reduce_out, row.add_after_reduce, row.copy_in) == (
        Replicate(), "row", True, ("a", 2), ())
    assert row.rewrite.fn == aten.linear.default and len(row.rewrite.args) == 2
    row = _decide(addmm, a=Shard(1), b=Shard(0))
    assert row.rewrite.fn == aten.mm.default and row.add_after_reduce == ("a", 0)
    # heads: split alike on a batch dim
    heads = _decide(matmul, q=Shard(1), k=Shard(1))
    assert (heads.out, heads.reduce_out) == (Shard(1), False)
    assert _decide(einsum, EINSUM, q=Shard(1)).scatter_in == ((("a", 1, 1), Shard(1)),)
    # baddbmm splits on its batch only (the input sliced alike); a column split runs gathered
    batch = _decide(baddbmm, BADDBMM, b1=Shard(0), b2=Shard(0))
    assert (batch.out, batch.scatter_in) == (Shard(0), ((("a", 0), Shard(0)),))
    cols = _decide(baddbmm, BADDBMM, b2=Shard(2))
    assert cols.kind == "fallback" and cols.reason == "baddbmm with its product split on rows, columns or the contraction"
    # split on the contraction on one side only: no rule
    assert _decide(mm, a=Shard(1)).reason == "contraction dim sharded on one operand only"
