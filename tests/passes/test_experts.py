"""Mixture-of-experts layers found from the graph, and the expert-parallel rewrite (no process group).

``find_experts`` recognises a layer by its structure alone (a router's top-k,
stacked 3-D weights read by grouped matmuls over the same offsets), so an HF
Mixtral and a model written here are found alike. With ep > 1 the rank graph
gets one route, one offsets, one dispatch per row input and one combine per
layer; each stacked weight is held as E/ep experts. The dispatch plan (which rows go where) is checked on a routing
worked out by hand. Bad input (ep not dividing E or dp, a model without
experts or with experts written as a list of modules, a region that fixes its
row count) fails before any work with the module, the numbers and the fix.
"""

from collections import Counter

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import autopar
from families import tiny_mixtral
from autopar.core.comm import TPGroup
from autopar.core.comm import expert_dispatch as xd
from autopar.core.errors import ConfigError
from passes.experts import ExpertError

H, E, FF, VOCAB, LAYERS = 16, 4, 32, 64, 2


def _mixtral(experts=E, layers=LAYERS):
    return tiny_mixtral(vocab_size=VOCAB, hidden_size=H, num_hidden_layers=layers, num_local_experts=experts)


def _batch():
    x = torch.randint(0, VOCAB, (2, 8), generator=torch.Generator().manual_seed(0))
    return (x,), (x,)


def _program(model, **layout):
    inputs, targets = _batch()
    return autopar.parallelize(model, example_inputs=inputs, example_targets=targets, **layout)


class Top2Experts(nn.Module):
    """A router, tokens sorted by expert, stacked weights applied by grouped matmuls, written here."""

    def __init__(self, fixed_rows: bool = False):
        super().__init__()
        self.router = nn.Linear(H, E, bias=False)
        self.w_up = nn.Parameter(torch.randn(E, H, FF) / H**0.5)
        self.w_down = nn.Parameter(torch.randn(E, FF, H) / FF**0.5)
        self.fixed_rows = fixed_rows

    def forward(self, x):
        b, s, _ = x.shape
        h = x.reshape(-1, H)
        top_w, top_i = self.router(h).softmax(-1).topk(2, dim=-1)
        ids = top_i.reshape(-1)
        order = torch.argsort(ids, stable=True)
        offs = torch.cumsum(torch.histc(ids.float(), bins=E, min=0, max=E - 1), 0).to(torch.int32)
        up = F.gelu(torch._grouped_mm(h[order // 2], self.w_up, offs=offs))
        if self.fixed_rows:  # reads the row count: cannot run on another rank's rows
            up = up.view(b * s * 2, FF)
        out = torch._grouped_mm(up, self.w_down, offs=offs)
        y = torch.zeros_like(out).index_copy(0, order, out) * top_w.reshape(-1, 1)
        return x + y.view(b * s, 2, H).sum(1).view(b, s, H)


class TinyMoE(nn.Module):
    def __init__(self, block=Top2Experts, **kw):
        super().__init__()
        self.emb = nn.Embedding(VOCAB, H)
        self.blocks = nn.ModuleList([block(**kw) for _ in range(LAYERS)])
        self.head = nn.Linear(H, VOCAB, bias=False)

    def forward(self, x):
        h = self.emb(x)
        for blk in self.blocks:
            h = blk(h)
        return self.head(h)


def _bf16(model):  # torch._grouped_mm's shape function takes bf16 only
    torch.manual_seed(0)
    return model.to(torch.bfloat16)


def test_mixtral_experts_found_from_the_graph():
    layers = _program(_mixtral()).experts
    assert len(layers) == LAYERS
    for i, layer in enumerate(layers):
        assert (layer.experts, layer.top_k, layer.refusal) == (E, 2, None)
        assert layer.module == f"model.layers.{i}.mlp.experts" and layer.router == f"model.layers.{i}.mlp.gate"
        assert len(layer.params) == 2 and len(layer.grouped) == 2 and len(layer.rows_in) == 1
        assert layer.rows == 2 * 8 * 2  # tokens x k


def test_experts_written_by_hand_found_alike():
    layers = _program(_bf16(TinyMoE())).experts
    assert [(x.module, x.experts, x.top_k, x.router) for x in layers] == \
        [(f"blocks.{i}", E, 2, f"blocks.{i}") for i in range(LAYERS)]


@pytest.mark.parametrize("dispatcher", ["allgather", "alltoall"])
def test_expert_parallel_rewrite_per_layer(dispatcher):
    program = _program(_mixtral(), dp=4, world_size=4, ep=2, expert_dispatch=dispatcher)
    per_layer: Counter = Counter()
    for node in program.rank_module.graph.nodes:
        if node.op == "call_function" and getattr(node.target, "__module__", "") == xd.__name__:
            per_layer[node.target.__name__] += 1
    assert per_layer == {"expert_route": LAYERS, "expert_offsets": LAYERS, "expert_dispatch": LAYERS,
                         "expert_combine": LAYERS}
    assert set(program.expert_params) == {f"model.layers.{i}.mlp.experts.{w}" for i in range(LAYERS)
                                          for w in ("gate_up_proj", "down_proj")}
    assert program.local_shape("model.layers.0.mlp.experts.gate_up_proj") == (E // 2, 48, H)
    assert program.expert_range("model.layers.0.mlp.experts.down_proj", 1) == (2, 2)
    assert program.expert_range("model.layers.0.mlp.gate.weight", 1) is None
    # the allgather dispatcher holds ep x S rows (static), the alltoall one S on average
    rows = {n.target.__name__: tuple(n.meta["local_val"].shape) for n in program.rank_module.graph.nodes
            if n.op == "call_function" and n.target is xd.expert_dispatch}
    assert rows["expert_dispatch"][0] == 32 * (2 if dispatcher == "allgather" else 1)


def test_ep_with_tp_splits_experts_both_ways_and_the_summary_shows_the_groups():
    program = _program(_mixtral(), tp=2, dp=4, world_size=8, ep=2)
    assert program.local_shape("model.layers.0.mlp.experts.gate_up_proj") == (E // 2, 24, H)  # E/ep, then tp
    assert program.local_shape("model.layers.0.mlp.experts.down_proj") == (E // 2, H, 12)
    text = program.summary()
    assert "mesh: tp=2 x pp=1 x dp=4 (ep=2 inside dp) = 8 ranks" in text
    assert "expert groups (exchange tokens): [0,2] [4,6] [1,3] [5,7]" in text
    assert "expert replicas (average expert gradients, 2 ranks): [0,4] [2,6] [1,5] [3,7]" in text
    assert "experts held: ep rank 0: 0-1, ep rank 1: 2-3" in text
    assert "experts: E/ep = 2 of 4 per rank" in text


def test_whole_experts_under_tp_share_the_rows_and_group_over_tp():
    """expert_tp=1: the sharding analysis leaves the experts whole (E/ep of them, every other dim the
    model's), each tp rank cuts its block of the sorted rows before the exchange and gathers the
    results back over tp; the expert groups run over tp x dp in rank order."""
    program = _program(_mixtral(), tp=2, dp=2, world_size=4, ep=2, expert_tp=1)
    assert program.local_shape("model.layers.0.mlp.experts.gate_up_proj") == (E // 2, 48, H)  # E/ep, no tp split
    assert program.local_shape("model.layers.0.mlp.experts.down_proj") == (E // 2, H, 24)
    assert program.local_shape("model.layers.0.mlp.gate.weight") == (E, H)  # the router whole, as ever
    targets = Counter(getattr(n.target, "__name__", "") for n in program.rank_module.graph.nodes
                      if n.op == "call_function")
    rows_in = len(program.experts[0].rows_in)
    assert targets["expert_tp_offsets"] == LAYERS and targets["expert_dispatch"] == LAYERS * rows_in
    assert targets["scatter_to_tp"] >= LAYERS * rows_in and targets["gather_from_tp"] >= LAYERS
    rows = {tuple(n.meta["local_val"].shape)[0] for n in program.rank_module.graph.nodes
            if n.op == "call_function" and n.target is xd.expert_dispatch}
    assert rows == {32 // 2}  # alltoall: this tp rank's half of the 32 sorted rows
    text = program.summary()
    assert "mesh: tp=2 x pp=1 x dp=2 (ep=2 over tp x dp, whole experts) = 4 ranks" in text
    assert "expert groups (exchange tokens): [0,1] [2,3]" in text  # the tp groups
    assert "expert replicas (average expert gradients, 2 ranks): [0,2] [1,3]" in text
    assert "whole (expert_tp=1)" in text
    shape = autopar.core.mesh.MeshShape(tp=4, pp=2, dp=2, ep=2, expert_tp=1)
    assert shape.ep_groups()[:3] == [[0, 1], [2, 3], [4, 5]] and shape.edp == 4
    assert shape.expert_dp_groups()[:2] == [[0, 2, 4, 6], [1, 3, 5, 7]]
    assert shape.replicas_with_every_expert == 1
    assert autopar.core.mesh.MeshShape(tp=2, dp=3, ep=3, expert_tp=1).replicas_with_every_expert == 3


def test_whole_experts_refused_without_ep_or_when_ep_does_not_divide_tp_x_dp():
    with pytest.raises(ConfigError, match=r"expert_tp=1 keeps each expert whole.*Fix: ep > 1 \(a divisor of tp x dp = 4\)"):
        _program(_mixtral(), tp=2, dp=2, world_size=4, expert_tp=1)
    with pytest.raises(ConfigError, match=r"ep=3 must divide tp x dp=4: with whole experts.*Fix: ep in \[1, 2, 4\]"):
        _program(_mixtral(), tp=2, dp=2, world_size=4, ep=3, expert_tp=1)
    with pytest.raises(ConfigError, match=r"expert_tp=3: each expert is split by tensor parallelism tp=2 ways"):
        _program(_mixtral(), tp=2, dp=2, world_size=4, ep=2, expert_tp=3)
    with pytest.raises(ConfigError, match=r"ep=4 must divide dp=2.*or expert_tp=1 \(whole experts"):
        _program(_mixtral(), tp=2, dp=2, world_size=4, ep=4)


def test_mesh_expert_groups():
    shape = autopar.core.mesh.MeshShape(tp=2, pp=2, dp=4, ep=2)
    assert shape.ep_groups()[:2] == [[0, 2], [4, 6]]  # dp replicas 0,1 and 2,3 at tp 0 of stage 0
    assert sorted(r for g in shape.ep_groups() for r in g) == list(range(16))
    assert sorted(r for g in shape.expert_dp_groups() for r in g) == list(range(16))
    assert shape.expert_dp_groups()[0] == [0, 4]


def _route(offsets):
    return torch.tensor(offsets, dtype=torch.int64)


def test_dispatch_plan_worked_by_hand():
    # 2 ranks, 4 experts (rank 0 holds 0-1, rank 1 holds 2-3), 5 sorted rows each
    route = _route([[2, 3, 3, 5],   # rank 0: experts 0,0,1,3,3
                    [0, 1, 4, 5]])  # rank 1: experts 1,2,2,2,3
    group = TPGroup(1, 2, None)
    ag = xd._plan(route, group, 5, "allgather")
    # rank 1's experts: expert 2 (rank 1's rows 1-3), expert 3 (rank 0's rows 3-4, rank 1's row 4)
    assert ag.order.tolist() == [5 + 1, 5 + 2, 5 + 3, 3, 4, 5 + 4]
    assert ag.local_offsets.tolist() == [3, 6] and ag.held == 6
    a2a = xd._plan(route, group, 5, "alltoall")
    assert (a2a.send, a2a.recv) == ([1, 4], [2, 4])  # rank 1 sends its expert-1 row to rank 0; gets 2 rows from it
    # arriving: rank 0's rows of experts 2-3 (two rows of 3), then rank 1's (2,2,2,3); grouped by expert
    assert a2a.order.tolist() == [2, 3, 4, 0, 1, 5]
    assert a2a.local_offsets.tolist() == [3, 6]
    rank0 = xd._plan(route, TPGroup(0, 2, None), 5, "alltoall")
    assert (rank0.send, rank0.recv, rank0.local_offsets.tolist()) == ([3, 2], [3, 1], [2, 4])


def test_ep_that_does_not_divide_the_experts():
    with pytest.raises(ExpertError, match=r"ep=4 does not divide the 6 experts at model.layers.0.mlp.experts "
                                          r"\(modeling_mixtral.py:\d+ .*\).*Fix: ep in \[1, 2, 3, 6\]"):
        _program(_mixtral(experts=6), dp=4, world_size=4, ep=4)


def test_ep_that_does_not_divide_dp():
    with pytest.raises(ConfigError, match=r"ep=3 must divide dp=4.*Fix: ep in \[1, 2, 4\]"):
        _program(_mixtral(), dp=4, world_size=4, ep=3)


def test_ep_on_a_model_without_experts():
    from autopar.reference.models import build

    torch.manual_seed(0)
    gpt = build("gpt", vocab_size=VOCAB, seq_len=8, n_layer=2, n_head=2, d_model=16)
    with pytest.raises(ExpertError, match=r"ep=2 asks for expert parallelism, but GPT has no mixture-of-experts "
                                          r"layer.*Looked for grouped matmuls.*use ep=1"):
        _program(gpt, dp=2, world_size=2, ep=2)


class ListOfExperts(nn.Module):
    """Experts as a list of MLPs, every one applied to every token and weighted (dense routing)."""

    def __init__(self):
        super().__init__()
        self.router = nn.Linear(H, E, bias=False)
        self.experts = nn.ModuleList([nn.Sequential(nn.Linear(H, FF), nn.GELU(), nn.Linear(FF, H)) for _ in range(E)])

    def forward(self, x):
        probs = self.router(x).softmax(-1)
        top_w, top_i = probs.topk(2, dim=-1)
        gate = torch.zeros_like(probs).scatter(-1, top_i, top_w)
        return x + sum(gate[..., e:e + 1] * expert(x) for e, expert in enumerate(self.experts))


def test_experts_as_a_list_of_modules_are_stacked_into_one_layer():
    """The list's items become one grouped computation over stacked weights: found like a layer
    written with stacked weights, split by ep, its parameters named after the list."""
    torch.manual_seed(0)
    program = _program(TinyMoE(ListOfExperts), dp=2, world_size=2, ep=2)
    assert [(x.module, x.experts, x.refusal) for x in program.experts] == [(f"blocks.{i}.experts", E, None)
                                                                          for i in range(LAYERS)]
    assert program.expert_params == {f"blocks.{i}.experts.*.{j}.weight": E for i in range(LAYERS) for j in (0, 2)}
    assert program.traced.stacked["blocks.1.experts.*.2.bias"] == tuple(f"blocks.1.experts.{e}.2.bias"
                                                                       for e in range(E))


class TokenMixingExpert(nn.Module):
    """An expert that mixes tokens (a running mean over the sequence): not row by row."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(H, H)

    def forward(self, x):
        return self.fc(x.cumsum(1))


class ListOfTokenMixers(ListOfExperts):
    def __init__(self):
        super().__init__()
        self.experts = nn.ModuleList([TokenMixingExpert() for _ in range(E)])


def test_a_list_whose_items_are_not_row_wise_is_named_in_the_error_and_trains_without_ep():
    torch.manual_seed(0)
    model = TinyMoE(ListOfTokenMixers)
    with pytest.raises(ExpertError, match=r"a list of 4 expert modules at blocks.0.experts, left as written: "
                                          r"cumsum .*test_experts.py:\d+ return self.fc\(x.cumsum\(1\)\)\) is "
                                          r"aten.cumsum.default, not a linear"):
        _program(model, dp=2, world_size=2, ep=2)
    program = _program(model, tp=2)  # without ep: split like any MLP
    assert program.experts == () and not program.traced.stacked


def test_a_region_that_fixes_its_row_count_is_refused_with_its_line():
    model = _bf16(TinyMoE(fixed_rows=True))
    layers = _program(model).experts
    assert layers and all("fixes the row count 32" in x.refusal for x in layers)
    with pytest.raises(ExpertError, match=r"the experts at blocks.0 \(test_experts.py:\d+ .*\) cannot be split "
                                          r"across ranks: view.* fixes the row count 32.*Use ep=1"):
        _program(model, dp=2, world_size=2, ep=2)


def test_a_moe_traced_on_the_meta_device_counts_its_rows_on_cpu():
    """Built on the meta device, transformers' experts count rows per expert with an integer ``histc``
    (its branch for GPUs), which CPU lacks: normalisation counts their float values instead, and the
    program's loss is the CPU-built model's."""
    cpu = _mixtral(layers=1)
    with torch.device("meta"):
        meta = _mixtral(layers=1)
    program = _program(meta)
    histc = [n for n in program.rank_module.graph.nodes if n.op == "call_function"
             and n.target == torch.ops.aten.histc.default]
    assert histc and all(n.args[0].meta["val"].dtype == torch.float32 for n in histc)
    (x,), (y,) = _batch()
    engine = program.materialize(state_dict=cpu.state_dict())
    want = F.cross_entropy(cpu(x).logits.flatten(0, 1), y.flatten()).item()
    assert engine.train_step(x, y) == pytest.approx(want, rel=1e-6)


def test_a_router_stays_whole_under_tp_even_beside_a_z_loss():
    """The reference MoE's router feeds a top-k and a z-loss's logsumexp (which could end a vocabulary-
    parallel region): it is found as a router and kept whole, so nothing falls back to gathers."""
    from autopar.reference.models import build, moe_outputs

    torch.manual_seed(0)
    model = build("gpt-moe", vocab_size=VOCAB, seq_len=8, n_layer=2, n_head=2, d_model=H, n_experts=E, top_k=2,
                  d_expert=FF, z_loss_coef=0.01)
    program = _program(model, tp=2, loss_fn=model.loss, output_fn=moe_outputs)
    assert program.fallbacks() == []
    routers = [r for r in program.plan.rejected if "a router" in r.reason]
    assert [r.module for r in routers] == [f"h.{i}.mlp.router" for i in range(LAYERS)]
    assert all(f"its {E} output features" in r.reason and "topk" in r.reason for r in routers)


class SharedExperts(TinyMoE):
    """Two blocks calling one mixture-of-experts block: its stacked weights are read by both."""

    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList([self.blocks[0], self.blocks[0]])


def test_expert_weights_shared_across_stages_are_refused():
    """Each stage would sum the shared expert weight's gradient with the other's and average it over every
    replica, mixing the different experts of an expert group: refused, naming the weight and the stages."""
    model = _bf16(SharedExperts())
    with pytest.raises(ExpertError, match=r"the stacked expert weight blocks.0.w_up is read by chunks on pipeline "
                                          r"stages \[0, 1\].*Fix: use ep=1"):
        _program(model, pp=2, dp=2, world_size=4, ep=2)
    assert _program(model, pp=2, dp=2, world_size=4).tied_params  # without ep: a tied weight like any other


class FusedSwiGLU(nn.Module):
    def __init__(self):
        super().__init__()
        self.gate_up, self.down = nn.Linear(H, 2 * FF, bias=False), nn.Linear(FF, H, bias=False)

    def forward(self, x):
        gate, up = self.gate_up(x).chunk(2, dim=-1)
        return self.down(F.silu(gate) * up)


class DictOfExperts(nn.Module):
    """Experts kept in a ModuleDict, applied in its order, each a SwiGLU with one fused gate/up linear."""

    def __init__(self):
        super().__init__()
        self.router = nn.Linear(H, E, bias=False)
        self.experts = nn.ModuleDict({f"expert_{e}": FusedSwiGLU() for e in range(E)})

    def forward(self, x):
        probs = self.router(x).softmax(-1)
        top_w, top_i = probs.topk(2, dim=-1)
        gate = torch.zeros_like(probs).scatter(-1, top_i, top_w)
        return x + sum(gate[..., e:e + 1] * expert(x) for e, expert in enumerate(self.experts.values()))


def test_a_dict_of_experts_is_stacked_and_one_process_equals_the_model():
    """One process, the stacked computation against the model as written: the loss, and each
    expert's gradient under its own name (fp32; only the order of sums differs: rtol 1e-5, atol 1e-6)."""
    torch.manual_seed(0)
    model = TinyMoE(DictOfExperts)
    (x,), (y,) = _batch()
    program = _program(model)
    assert program.traced.stacked["blocks.0.experts.*.gate_up.weight"] == tuple(
        f"blocks.0.experts.expert_{e}.gate_up.weight" for e in range(E))
    engine = program.materialize()
    loss = engine.train_step(x, y)
    want = F.cross_entropy(model(x).flatten(0, -2), y.flatten())
    want.backward()
    torch.testing.assert_close(torch.as_tensor(float(loss)), want.detach(), rtol=1e-6, atol=1e-6)
    grads = engine.full_grads()
    assert grads.keys() == dict(model.named_parameters()).keys()
    for name, p in model.named_parameters():
        torch.testing.assert_close(grads[name], p.grad, rtol=1e-5, atol=1e-6, msg=lambda m, n=name: f"{n}: {m}")
