"""Tier (a): model code written in less common forms, without a process group.

Each model below writes a standard transformer piece the way some model
families do, and used to defeat the analysis:

- ``x @ W.T + b`` instead of ``nn.Linear`` (Falcon's linear layers);
- ``.to(dtype)`` inside the block (export records a dtype assertion that
  checks the *global* shape);
- a per-head RMSNorm on q and k (Qwen3, OLMo-2): a replicated parameter used
  on a split value, whose gradient needs f;
- multi-query attention through one fused projection (StarCoder, Falcon-7B):
  the analysis first asks for a segmented split of the fused output, then
  rejects it (one key/value head cannot be split); the rejected trial must
  leave no trace in the plan.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import autopar
from autopar.compiler.trace import trace
from passes.normalize import normalize

aten = torch.ops.aten
V, H, HEADS, SEQ, LAYERS = 96, 64, 4, 8, 2


class TransposedLinear(nn.Module):
    """``x @ W.T + b`` with W stored (out, in), as Falcon's FalconLinear."""

    def __init__(self, i, o, bias=True):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(o, i) / i**0.5)
        self.bias = nn.Parameter(torch.zeros(o)) if bias else None

    def forward(self, x):
        y = x @ self.weight.T
        return y if self.bias is None else y + self.bias


class FormBlock(nn.Module):
    def __init__(self, linear=nn.Linear, head_norm=False, mqa=False):
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(H), nn.LayerNorm(H)
        self.mqa = mqa
        d = H // HEADS
        self.qkv = linear(H, H + 2 * d) if mqa else linear(H, 3 * H)
        self.proj = linear(H, H)
        self.fc1, self.fc2 = linear(H, 4 * H), linear(4 * H, H)
        self.q_norm = nn.RMSNorm(d) if head_norm else None
        self.k_norm = nn.RMSNorm(d) if head_norm else None

    def forward(self, x):
        b, s, _ = x.shape
        d = H // HEADS
        h = self.ln1(x).to(torch.float32)  # a dtype cast: export records an assertion
        if self.mqa:
            q, k, v = self.qkv(h).split([H, d, d], dim=-1)
            k = k.view(b, s, 1, d).transpose(1, 2).expand(b, HEADS, s, d)
            v = v.view(b, s, 1, d).transpose(1, 2).expand(b, HEADS, s, d)
        else:
            q, k, v = self.qkv(h).split(H, dim=-1)
            k = k.view(b, s, HEADS, d).transpose(1, 2)
            v = v.view(b, s, HEADS, d).transpose(1, 2)
        q = q.view(b, s, HEADS, d).transpose(1, 2)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(a.transpose(1, 2).reshape(b, s, H))
        return x + self.fc2(F.gelu(self.fc1(self.ln2(x))))


class Model(nn.Module):
    def __init__(self, **kw):
        super().__init__()
        self.wte = nn.Embedding(V, H)
        self.h = nn.ModuleList(FormBlock(**kw) for _ in range(LAYERS))
        self.ln_f = nn.LayerNorm(H)

    def forward(self, idx):
        x = self.wte(idx)
        for blk in self.h:
            x = blk(x)
        return self.ln_f(x) @ self.wte.weight.T


def _example_pair():
    g = torch.Generator().manual_seed(0)
    return torch.randint(0, V, (2, SEQ), generator=g), torch.randint(0, V, (2, SEQ), generator=g)


def _compile_block_model(tp=2, pp=1, **kw):
    torch.manual_seed(0)
    x, y = _example_pair()
    return autopar.parallelize(Model(**kw), tp=tp, pp=pp, microbatches=max(pp, 1), example_inputs=(x,),
                               example_targets=y, sequence_parallel=False)  # tensor parallelism's own collectives


def _model_of(block) -> "Model":
    """The test model with its LAYERS blocks made by ``block()`` (seeded)."""
    torch.manual_seed(0)
    model = Model()
    model.h = nn.ModuleList(block() for _ in range(LAYERS))
    return model


def _parallelize(model, tp=2, **kw):
    x, y = _example_pair()
    kw.setdefault("sequence_parallel", False)  # tensor parallelism's own collectives
    return autopar.parallelize(model, tp=tp, example_inputs=(x,), example_targets=y, **kw)


def test_normalize_turns_transposed_matmuls_into_linears_and_drops_assertions():
    torch.manual_seed(0)
    x, y = _example_pair()
    traced = trace(Model(linear=TransposedLinear), (x,), (y,), autopar.lm_cross_entropy)
    targets = [n.target for n in traced.gm.graph.nodes if n.op == "call_function"]
    assert aten._assert_tensor_metadata.default in targets
    before = targets.count(aten.matmul.default)
    done = normalize(traced.gm, set(traced.param_of))
    targets = [n.target for n in traced.gm.graph.nodes if n.op == "call_function"]
    # 4 linears per block became aten.linear; the tied LM head (x @ wte.T, no bias) too
    assert done["x @ W.T made linear"] == 4 * LAYERS + 1 == before
    assert targets.count(aten.linear.default) == 4 * LAYERS + 1
    assert aten.numpy_T.default not in targets and aten.matmul.default not in targets
    assert aten._assert_tensor_metadata.default not in targets and done["assertions dropped"] > 0
    # the biases were folded in: every block linear has one
    lin = [n for n in traced.gm.graph.nodes if n.target == aten.linear.default]
    assert sum(len(n.args) == 3 for n in lin) == 4 * LAYERS
    # same values as the model
    torch.manual_seed(0)
    model = Model(linear=TransposedLinear)
    params = [dict(model.named_parameters())[traced.param_of[n.name]] for n in traced.gm.graph.nodes
              if n.op == "placeholder" and n.name in traced.param_of]
    loss = traced.gm(*params, x, y)[0]
    torch.testing.assert_close(loss, autopar.lm_cross_entropy(model(x), y))


def test_transposed_linears_split_like_nn_linear():
    for linear in (nn.Linear, TransposedLinear):
        program = _compile_block_model(linear=linear)
        per_layer = program.collectives(by_layer=True)
        for layer in range(LAYERS):
            assert per_layer[(layer, "reduce_from_tp")] == 2 and per_layer[(layer, "copy_to_tp")] == 2
        assert program.fallbacks() == [] and program.plan.rejected == []


def test_per_head_norm_weight_gets_f_and_placeholders_stay_first():
    program = _compile_block_model(head_norm=True, pp=2)
    nodes = list(program.rank_module.graph.nodes)
    kinds = [n.op for n in nodes]
    first_other = kinds.index("call_function")
    assert "placeholder" not in kinds[first_other:]  # every placeholder before any computation
    per_layer = program.collectives(by_layer=True)
    # f on the QKV input, on the MLP input, and on the q_norm and k_norm weights (partial gradients)
    assert all(per_layer[(layer, "copy_to_tp")] == 4 for layer in range(LAYERS))
    shapes = program.local_shapes(rank=1)
    assert all(s[-1] != H for n, s in shapes.items() if n.startswith("scaled_dot_product_attention"))


def test_rejected_segmented_trial_leaves_no_stale_decisions():
    program = _compile_block_model(mqa=True)
    plan = program.plan
    rejected = {r.node for r in plan.rejected}
    qkv = [n.name for n in program.traced.gm.graph.nodes
           if n.target == aten.linear.default and n.args[1].name.endswith("qkv_weight")]
    assert len(qkv) == LAYERS and set(qkv) <= rejected  # one key/value head: the fused QKV stays whole
    for name in qkv:
        assert name not in plan.column
        assert type(plan.decisions[name].out).__name__ == "Replicate"
        # its users were decided against a replicated input, not the undone trial's shard
        for user in program.traced.gm.graph.find_nodes(op="call_function", target=aten.split_with_sizes.default):
            assert all(type(p).__name__ == "Replicate" for p in plan.decisions[user.name].out)
    # the MLPs are still split, and the rank program has consistent shapes
    per_layer = program.collectives(by_layer=True)
    assert all(per_layer[(layer, "reduce_from_tp")] >= 1 for layer in range(LAYERS))
    program.local_shapes(rank=1)


class ExpertBlock(nn.Module):
    """Attention-free block whose MLP is two experts as one 3-D weight applied with bmm."""

    def __init__(self):
        super().__init__()
        self.ln = nn.LayerNorm(H)
        self.w_in = nn.Parameter(torch.randn(2, H, 2 * H) / H**0.5)
        self.w_out = nn.Parameter(torch.randn(2, 2 * H, H) / H**0.5)
        self.fc = nn.Linear(H, 4 * H)
        self.proj = nn.Linear(4 * H, H)

    def forward(self, x):
        b, s, _ = x.shape
        h = self.ln(x).reshape(1, b * s, H).expand(2, b * s, H)
        e = torch.bmm(F.gelu(torch.bmm(h, self.w_in)), self.w_out).sum(0).view(b, s, H)
        return x + e + self.proj(F.gelu(self.fc(x)))


def test_weights_no_rule_splits_are_listed_with_the_op_that_reads_them():
    model = _model_of(ExpertBlock)
    program = _parallelize(model, tp=2)
    whole = {name: (n, why) for name, n, why in program.replicated_weights()}
    assert set(whole) == {f"h.{i}.{w}" for i in range(LAYERS) for w in ("w_in", "w_out")}
    assert all(n == 2 * H * 2 * H and "bmm" in why and "test_graph_forms.py" in why for n, why in whole.values())
    text = program.summary()
    share = round(100 * 4 * H * H * 2 * LAYERS / sum(p.numel() for p in model.parameters()))
    assert f"({share}% of the model) held whole by every tp rank" in text
    assert "h.0.w_in" in text and "h.1.w_in" not in text  # layers 1.. as layer 0
    # the linears beside them are split
    assert program.param_spec("h.0.fc.weight") != program.param_spec("h.0.w_in")


E, FF = 4, 96


class MoEBlock(nn.Module):
    """Top-1 mixture of experts with stacked expert weights, applied either as grouped matmuls
    over tokens sorted by expert (``torch._grouped_mm``) or expert by expert (``W[e]``)."""

    def __init__(self, grouped: bool):
        super().__init__()
        self.grouped = grouped
        self.ln = nn.LayerNorm(H)
        self.router = nn.Linear(H, E, bias=False)
        self.w_up = nn.Parameter(torch.randn(E, 2 * FF, H) / H**0.5)  # (E, out, in): gate and up
        self.w_down = nn.Parameter(torch.randn(E, H, FF) / FF**0.5)

    def forward(self, x):
        b, s, _ = x.shape
        h = self.ln(x).reshape(-1, H)
        top_w, top_i = self.router(h).softmax(-1).topk(1, dim=-1)
        if self.grouped:
            order = torch.argsort(top_i.squeeze(-1), stable=True)
            counts = torch.histc(top_i.float(), bins=E, min=0, max=E - 1)
            offs = torch.cumsum(counts, 0).to(torch.int32)
            g, u = torch._grouped_mm(h[order], self.w_up.transpose(-2, -1), offs=offs).chunk(2, dim=-1)
            out = torch._grouped_mm(F.silu(g) * u, self.w_down.transpose(-2, -1), offs=offs)
            y = torch.zeros_like(out).index_copy(0, order, out)
        else:
            y = torch.zeros_like(h)
            for e in range(E):
                g, u = F.linear(h, self.w_up[e]).chunk(2, dim=-1)
                y = y + (top_i == e).to(h.dtype) * F.linear(F.silu(g) * u, self.w_down[e])
        return x + (y * top_w).view(b, s, H)


@pytest.mark.parametrize("grouped", [True, False], ids=["grouped_mm", "expert_by_expert"])
def test_experts_split_like_an_mlp(grouped):
    model = _model_of(lambda: MoEBlock(grouped))
    if grouped:  # torch._grouped_mm's shape function takes bf16 only
        model = model.to(torch.bfloat16)
    program = _parallelize(model, tp=2)
    assert program.replicated_weights() == [] and program.fallbacks() == []
    for layer in range(LAYERS):
        up, down = program.param_spec(f"h.{layer}.w_up"), program.param_spec(f"h.{layer}.w_down")
        # gate and up are split apiece (each rank: its half of both), down by its input features
        assert (up.dim, tuple(up.segments)) == (1, (FF, FF)) and (down.dim, down.segments) == (2, None)
        assert program.local_shape(f"h.{layer}.w_up") == (E, FF, H)
        assert program.local_shape(f"h.{layer}.w_down") == (E, H, FF // 2)
    per_layer = program.collectives(by_layer=True)
    # one g after the experts' down projections (expert by expert: one per expert, summed lazily
    # is not done, so E of them), one f on their shared input
    g = 1 if grouped else E
    assert all(per_layer[(layer, "reduce_from_tp")] == g for layer in range(LAYERS)), per_layer
    assert [r.module for r in program.plan.rejected] == [f"h.{i}.router" for i in range(LAYERS)]


def test_a_split_dim_of_size_one_does_not_broadcast():
    """A gate of one output feature (a shared expert's sigmoid gate) cannot be split: padded to
    t, its split dim would broadcast against the full hidden size."""

    class GatedMLP(nn.Module):
        def __init__(self):
            super().__init__()
            self.ln = nn.LayerNorm(H)
            self.gate = nn.Linear(H, 1)
            self.fc, self.proj = nn.Linear(H, 4 * H), nn.Linear(4 * H, H)

        def forward(self, x):
            h = self.ln(x)
            return x + torch.sigmoid(self.gate(h)) * self.proj(F.gelu(self.fc(h)))

    model = _model_of(GatedMLP)
    program = _parallelize(model, tp=2)
    rejected = {r.module: r.reason for r in program.plan.rejected}
    assert set(rejected) == {f"h.{i}.gate" for i in range(LAYERS)}
    assert all("size 1 that broadcasts to 64" in why for why in rejected.values())
    assert program.fallbacks() == [] and program.param_spec("h.0.fc.weight").dim == 0
    program.local_shapes(rank=1)


def test_rmsnorm_over_a_split_projection_is_a_local_mean_and_g():
    """q normalised over all heads before they are taken apart (OLMoE, OLMo-2): the mean over
    the split dim is each rank's mean over t, summed by one all-reduce; no gather."""

    class QNorm(FormBlock):
        def __init__(self):
            super().__init__()
            self.norm_weight = nn.Parameter(torch.ones(3 * H))

        def forward(self, x):
            b, s, _ = x.shape
            d = H // HEADS
            qkv = self.qkv(self.ln1(x))
            qkv = qkv * torch.rsqrt(qkv.pow(2).mean(-1, keepdim=True) + 1e-6) * self.norm_weight  # RMSNorm
            q, k, v = qkv.split(H, dim=-1)
            q, k, v = (t.view(b, s, HEADS, d).transpose(1, 2) for t in (q, k, v))
            a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            x = x + self.proj(a.transpose(1, 2).reshape(b, s, H))
            return x + self.fc2(F.gelu(self.fc1(self.ln2(x))))

    model = _model_of(QNorm)
    program = _parallelize(model, tp=2)
    assert program.fallbacks() == [] and program.plan.rejected == []
    per_layer = program.collectives(by_layer=True)
    # g after the norm's mean, after proj and after fc2; f on the QKV input, the MLP input and
    # the norm's (replicated, split-read) weight
    assert all(per_layer[(layer, "reduce_from_tp")] == 3 for layer in range(LAYERS)), per_layer
    assert all(per_layer[(layer, "copy_to_tp")] == 3 for layer in range(LAYERS)), per_layer


class HeadMix(FormBlock):
    """A weight applied to every head's output (the heads dim is split, so the weight is read
    whole on each rank and its gradient is partial): as a matrix, or as one slice W[0] of a stack."""

    def __init__(self, stacked: bool):
        super().__init__()
        d = H // HEADS
        self.stacked = stacked
        self.w = nn.Parameter(torch.randn(2, d, d) / d**0.5 if stacked else torch.randn(d, d) / d**0.5)

    def forward(self, x):
        b, s, _ = x.shape
        d = H // HEADS
        q, k, v = (t.view(b, s, HEADS, d).transpose(1, 2) for t in self.qkv(self.ln1(x)).split(H, dim=-1))
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        a = F.linear(a, self.w[0] if self.stacked else self.w)
        x = x + self.proj(a.transpose(1, 2).reshape(b, s, H))
        return x + self.fc2(F.gelu(self.fc1(self.ln2(x))))


def test_a_weight_read_through_a_view_on_split_rows_gets_f():
    counts = []
    for stacked in (False, True):
        model = _model_of(lambda: HeadMix(stacked))
        program = _parallelize(model, tp=2)
        assert program.fallbacks() == [] and program.plan.rejected == []
        counts.append(program.collectives()["copy_to_tp"])
    # f on QKV's input, on the MLP's input and on the head-mixing weight (its gradient is partial)
    assert counts == [3 * LAYERS + 1, 3 * LAYERS + 1]


def test_a_harmless_fallback_does_not_unsplit_separate_q_k_v():
    """One op without a rule on the attention output (a sort) is gathered; q, k and v, tried as a
    group, stay split: only members that reach neither a sink nor each other are dropped."""

    class SortAttn(FormBlock):
        def __init__(self):
            super().__init__()
            self.q, self.k, self.v = (nn.Linear(H, H) for _ in range(3))

        def forward(self, x):
            b, s, _ = x.shape
            d = H // HEADS
            h = self.ln1(x)
            q, k, v = (m(h).view(b, s, HEADS, d).transpose(1, 2) for m in (self.q, self.k, self.v))
            a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            x = x + self.proj(a.transpose(1, 2).reshape(b, s, H)) + 0.01 * torch.sort(a, dim=-1).values.mean()
            return x + self.fc2(F.gelu(self.fc1(self.ln2(x))))

    model = _model_of(SortAttn)
    program = _parallelize(model, tp=2)
    assert [f[1] for f in program.fallbacks()] == ["no sharding rule for aten.sort.default"] * LAYERS
    assert program.plan.rejected == []
    for layer in range(LAYERS):
        assert all(program.param_spec(f"h.{layer}.{m}.weight").dim == 0 for m in "qkv")


class ParallelBlock(nn.Module):
    """Attention and MLP side by side on one LayerNorm: x + attn(ln(x)) + mlp(ln(x))."""

    def __init__(self, bias: bool, inplace: bool, residual_first: bool):
        super().__init__()
        self.inplace, self.residual_first = inplace, residual_first
        self.ln = nn.LayerNorm(H)
        self.qkv = nn.Linear(H, 3 * H, bias=bias)
        self.proj = nn.Linear(H, H, bias=bias)
        self.fc1, self.fc2 = nn.Linear(H, 4 * H, bias=bias), nn.Linear(4 * H, H, bias=bias)
        self.drop = nn.Dropout(0.0)  # left in by configs: the identity

    def forward(self, x):
        b, s, _ = x.shape
        d = H // HEADS
        h = self.ln(x)
        q, k, v = (t.view(b, s, HEADS, d).transpose(1, 2) for t in self.qkv(h).split(H, dim=-1))
        attn = self.drop(self.proj(F.scaled_dot_product_attention(q, k, v, is_causal=True)
                                   .transpose(1, 2).reshape(b, s, H)))
        mlp = self.drop(self.fc2(F.gelu(self.fc1(h))))
        if self.inplace:
            mlp += attn
            return x + mlp
        return (x + attn) + mlp if self.residual_first else attn + mlp + x


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("form", ["sum", "inplace", "residual_first"])
def test_parallel_block_reduces_once(bias, form):
    model = _model_of(lambda: ParallelBlock(bias, form == "inplace", form == "residual_first"))
    program = _parallelize(model, tp=2)
    per_layer = program.collectives(by_layer=True)
    for layer in range(LAYERS):
        # one f on the shared LayerNorm output, one g for attention and MLP together
        assert per_layer[(layer, "reduce_from_tp")] == 1 and per_layer[(layer, "copy_to_tp")] == 1, per_layer
    program.local_shapes(rank=1)  # the rewritten rank program propagates shapes (values: test_hf_families)


class EinsumLinear(nn.Module):
    """A linear written as einsum, with the weight stored (out, in) or (in, out)."""

    def __init__(self, i, o, bias=True, stored_in_out=False):
        super().__init__()
        self.stored_in_out = stored_in_out
        self.weight = nn.Parameter(torch.randn(i, o) / i**0.5 if stored_in_out else torch.randn(o, i) / i**0.5)

    def forward(self, x):
        if self.stored_in_out:
            return torch.einsum("...k,kn->...n", x, self.weight)
        return torch.einsum("bsk,nk->bsn", x, self.weight)


@pytest.mark.parametrize("stored_in_out", [False, True])
def test_einsum_linears_split_like_nn_linear(stored_in_out):
    torch.manual_seed(0)
    model = Model(linear=lambda i, o, bias=True: EinsumLinear(i, o, stored_in_out=stored_in_out))
    program = _parallelize(model, tp=2)
    assert program.fallbacks() == [] and program.plan.rejected == [] and program.replicated_weights() == []
    per_layer = program.collectives(by_layer=True)
    assert all(per_layer[(i, "reduce_from_tp")] == 2 and per_layer[(i, "copy_to_tp")] == 2 for i in range(LAYERS))


def test_interleaved_gate_and_up_stay_split():
    """gate = h[..., ::2], up = h[..., 1::2] of one projection (GPT-OSS): each rank's block of
    the projection starts on an even column, so its own even and odd columns are its blocks of
    gate and up."""

    class InterleavedMLP(nn.Module):
        def __init__(self):
            super().__init__()
            self.ln = nn.LayerNorm(H)
            self.fc, self.proj = nn.Linear(H, 8 * H), nn.Linear(4 * H, H)

        def forward(self, x):
            h = self.fc(self.ln(x))
            return x + self.proj(F.silu(h[..., ::2]) * h[..., 1::2])

    model = _model_of(InterleavedMLP)
    for tp in (2, 4):
        program = _parallelize(model, tp=tp)
        assert program.fallbacks() == [] and program.plan.rejected == []
        assert program.param_spec("h.0.fc.weight").dim == 0 and program.param_spec("h.0.proj.weight").dim == 1
        shapes = program.local_shapes(rank=tp - 1)
        assert {s[-1] for n, s in shapes.items() if n.startswith("slice")} == {4 * H // tp}


def test_sequential_of_embedding_blocks_and_head_finds_the_blocks():
    """nn.Sequential(embedding, *blocks, head): the layers are the children of the blocks' class,
    numbered from 0 (the first block is child 1); per-layer collectives, parameters and layer
    recomputation see them."""
    from passes.recompute import Checkpointed, with_recompute

    class Head(nn.Module):
        def __init__(self):
            super().__init__()
            self.ln, self.out = nn.LayerNorm(H), nn.Linear(H, V, bias=False)

        def forward(self, x):
            return self.out(self.ln(x))

    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(V, H), *[FormBlock() for _ in range(4)], Head())
    program = _parallelize(model, pp=2, microbatches=2, recompute="layer")
    layers = program.layers
    assert (layers.prefix, layers.count, layers.offset) == ("", 4, 1)
    assert [c.layers for c in program.split.chunks] == [[0, 1], [2, 3]]
    per_layer = program.collectives(by_layer=True)
    assert all(per_layer[(i, "reduce_from_tp")] == 2 and per_layer[(i, "copy_to_tp")] == 2 for i in range(4))
    assert program.layer_params("1.qkv.weight") == 0 and program.layer_params("4.fc2.bias") == 3
    assert program.layer_params("0.weight") is None and program.layer_params("5.out.weight") is None
    for chunk in program.split.chunks:
        wrapped = with_recompute(chunk.gm, "layer", layers)
        assert sum(isinstance(m, Checkpointed) for m in wrapped.children()) == len(chunk.layers)
