"""Graphs that hold higher-order ops, and hybrid stacks, cut at tp=2 x pp=2.

torch.export puts the body of a ``torch.no_grad()`` or ``torch.autocast`` region
(and of ``torch.cond`` ...) into a ``get_attr`` sub-module run by a higher-order
op. CPM-Ant computes its position buckets under ``no_grad``; HRM-Text runs its
early reasoning cycles (whole layers) under ``no_grad``. The pipeline cut copies
each sub-module into the chunk that runs it, and a value a ``no_grad`` region
returns crosses a boundary without a gradient. Nemotron-H is a hybrid stack:
its blocks are one class in four structures (Mamba mixer, experts, attention,
MLP), none repeated; they are found as layers and the cut balances them by
cost, and a layout with more chunks than blocks is refused naming the
structures. BLT (its patches given: ``patch_in_forward=False``) trains too. A
small hand-written model with ``autocast`` and ``no_grad`` regions shows which
chunk holds which sub-module; a ``torch.cond``, which the engine does not run,
is refused with its line.

Each family trains one step at tp=2 x pp=2 on 4 gloo ranks (one spawn) against
one device: loss and every gradient within FP32_TOLERANCE (fp32; the parallel
run only reorders sums).
"""

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from families import train_steps
from helpers import assert_ranks_match, parallelize_on, reference_run, seeded, spawn_ranks, token_batches

from autopar.compiler.trace import trace
from autopar.compiler.trace import lm_cross_entropy
from passes.layers import find_layers
from passes.pipeline_split import PipelineError

VOCAB, ROWS, M, LR = 256, 8, 2, 1e-3
HOPS = (torch.ops.higher_order.wrap_with_set_grad_enabled, torch.ops.higher_order.wrap_with_autocast)


def _hf_edge_family(name):
    import transformers as T

    torch.manual_seed(0)
    if name == "cpmant":  # init_std 0.02 (its default 1.0 gives logits of ~20: rounding beyond fp32 tolerance)
        cfg = T.CpmAntConfig(vocab_size=VOCAB, hidden_size=64, num_attention_heads=4, dim_head=16, dim_ff=128,
                             num_hidden_layers=4, prompt_types=3, prompt_length=2, segment_types=3,
                             position_bias_num_buckets=32, position_bias_max_distance=64, init_std=0.02)
    elif name == "hrm_text":  # 2 layers per stack; 2 high cycles of 2 low cycles, the first of each under no_grad
        cfg = T.HrmTextConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                              num_attention_heads=4, head_dim=16, max_position_embeddings=64, H_cycles=2,
                              L_cycles=2, L_bp_cycles=[1])
    elif name == "blt":  # patches given by the input (no entropy model: its patch lengths depend on values)
        sub = dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=4, intermediate_size=128, head_dim=16)
        cfg = T.BltConfig(vocab_size=VOCAB, patch_in_forward=False, use_cache=False, max_position_embeddings=64,
                          encoder_hash_byte_group_vocab=97,
                          encoder_config=dict(num_hidden_layers=1, hidden_size_global=64, **sub),
                          decoder_config=dict(num_hidden_layers=2, hidden_size_global=64, **sub),
                          global_config=dict(num_hidden_layers=2, **sub), patcher_config=dict(num_hidden_layers=2, **sub))
    else:  # nemotron_h: its default block pattern, one block of each structure
        cfg = T.NemotronHConfig(vocab_size=VOCAB, hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
                                head_dim=16, intermediate_size=128, ssm_state_size=16, mamba_num_heads=8,
                                mamba_head_dim=16, n_groups=2, chunk_size=16, max_position_embeddings=64,
                                n_routed_experts=4, moe_intermediate_size=32, moe_shared_expert_intermediate_size=32,
                                layers_block_type=["linear_attention", "moe", "full_attention", "mlp"])
    return T.AutoModelForCausalLM.from_config(cfg)


H = 32


class RegionBlock(nn.Module):
    """Its norm under ``autocast(enabled=False)`` (a region export wraps), its MLP's activation too."""

    def __init__(self):
        super().__init__()
        self.norm, self.up, self.down = nn.LayerNorm(H), nn.Linear(H, 4 * H), nn.Linear(4 * H, H)

    def forward(self, h):
        with torch.autocast("cpu", enabled=False):
            n = self.norm(h)
        u = self.up(n)
        with torch.autocast("cpu", enabled=False):
            u = F.gelu(u)
        return h + self.down(u)


class Regions(nn.Module):
    """Four region blocks; a scale computed under ``no_grad`` before them and applied after them."""

    def __init__(self):
        super().__init__()
        self.emb, self.head = nn.Embedding(VOCAB, H), nn.Linear(H, VOCAB)
        self.blocks = nn.ModuleList(RegionBlock() for _ in range(4))

    def forward(self, x):
        h = self.emb(x)
        with torch.no_grad():
            scale = torch.sigmoid(h.mean(dim=-1, keepdim=True))
        for block in self.blocks:
            h = block(h)
        return self.head(h * scale)


def _edge_model(name):
    return seeded(Regions) if name == "regions" else _hf_edge_family(name)


def _edge_batches():
    return token_batches(VOCAB, steps=1, rows=ROWS, seed=1)


def _compile_tp2_pp2(name, **config):
    config = {"tp": 2, "pp": 2, "microbatches": M, "world_size": 4, **config}
    return parallelize_on(_edge_model(name), _edge_batches(), ROWS // M, **config)


_TP2_PP2: dict[tuple[str, str], tuple] = {}
"""The tp=2 x pp=2 programs of this file by (family, recompute), with the random state right after each
compile: the structural tests and the ranks of the parity test read the same compiles."""


@pytest.fixture(scope="module", autouse=True)
def _forget_tp2_pp2_programs():
    yield
    _TP2_PP2.clear()


def _edge_tp2_pp2(name, recompute="none"):
    """``_compile_tp2_pp2(name)`` with ``recompute``, compiled once in this module; a later call returns it and
    leaves the random state as the compile left it (the model is seeded, so that state is the compile's own).
    Ranks forked after the test process compiled it inherit it."""
    if (name, recompute) not in _TP2_PP2:
        program = _compile_tp2_pp2(name, **({} if recompute == "none" else {"recompute": recompute}))
        _TP2_PP2[(name, recompute)] = program, torch.get_rng_state()
    program, rng = _TP2_PP2[(name, recompute)]
    torch.set_rng_state(rng)
    return program


def _regions(gm):
    """Higher-order op nodes of a graph -> the sub-modules they run."""
    return {n.name: {a.target for a in n.all_input_nodes if a.op == "get_attr"}
            for n in gm.graph.nodes if n.op == "call_function" and n.target in HOPS}


def test_each_chunk_holds_the_sub_modules_of_the_regions_it_runs():
    program = _edge_tp2_pp2("regions")
    traced = _regions(program.traced.gm)
    layer = program.layers.node_layer
    assert program.layers.count == 4 and len(traced) == 9  # 2 autocast regions per block, 1 no_grad region
    first, last = program.split.chunks
    assert first.layers and last.layers and first.layers + last.layers == [0, 1, 2, 3]
    for chunk in program.split.chunks:
        held = _regions(chunk.gm)
        # the regions of its own layers, and the no_grad region (outside the layers, after the embedding) in chunk 0
        want = {n for n in traced if layer.get(n) in chunk.layers or (n not in layer and chunk.index == 0)}
        assert set(held) == want, (chunk.index, sorted(held), sorted(want))
        for name, subs in held.items():
            assert subs == traced[name] and all(isinstance(getattr(chunk.gm, s), torch.fx.GraphModule) for s in subs)
        carried = {n.target for n in chunk.gm.graph.nodes if n.op == "get_attr"}
        assert carried == set().union(*held.values())  # no other region's sub-module
    # the no_grad scale crosses into chunk 1 beside the hidden state, without a gradient
    assert sorted(b.requires_grad for b in last.inputs) == [False, True], last.inputs
    # the activation's region would run replicated: the up projection stays whole, and the plan says why
    why = {r.module: r.reason for r in program.plan.rejected}
    assert {m.rsplit(".", 1)[-1] for m in why} >= {"up"} and all("wrap_with_autocast" in r for r in why.values())


def test_no_grad_layers_are_costed_and_carried():
    """HRM-Text: layers run under no_grad (a sub-module holding whole layers) go with the chunk of their
    inputs, their graph's cost counted (a third: no backward), the parameters they share tied across stages."""
    program = _edge_tp2_pp2("hrm_text")
    assert program.layers.count == 4 and program.layers.by_calls
    regions = [_regions(c.gm) for c in program.split.chunks]
    assert sum(len(r) for r in regions) == 2 and all(len(s) == 1 for r in regions for s in r.values())
    costs = program.split.costs
    assert max(costs) <= 1.7 * min(costs), costs
    assert program.tied_params  # the low-level stack's weights, read by regions and layers on both stages


def test_hybrid_stack_of_one_class_in_four_structures():
    program = _edge_tp2_pp2("nemotron_h")
    layers = program.layers
    assert layers.count == 4 and layers.kinds == (0, 1, 2, 3)
    assert list(layers.paths) == [f"model.layers.{i}" for i in range(4)]
    assert layers.describe() == ("4 layers ('model.layers.0' .. 'model.layers.3'; 4 structures: "
                                 + ", ".join(f"1 like 'model.layers.{i}'" for i in range(4)) + ")")
    assert "4 structures" in program.summary()
    got = [c.layers for c in program.split.chunks]
    assert sorted(sum(got, [])) == [0, 1, 2, 3] and all(got)
    # cut by cost, not by count: the Mamba block (the costliest) with the embedding against the other three
    assert got == [[0], [1, 2, 3]], got
    with pytest.raises(PipelineError, match=r"the model has 4 layers \('model.layers.0' .. 'model.layers.3'; "
                                            r"4 structures: 1 like 'model.layers.0', .*\) but pp \* virtual_stages = "
                                            r"8 chunks need at least one layer each. Fix: use pp \* virtual_stages "
                                            r"<= 4"):
        _compile_tp2_pp2("nemotron_h", tp=1, pp=4, virtual_stages=2, schedule="interleaved", microbatches=4,
                         world_size=4)


class EdgeBlock(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(H, 2 * H), nn.Linear(2 * H, H)

    def forward(self, h):
        return h + self.fc2(F.relu(self.fc1(h)))


class Stack(nn.Module):
    def __init__(self, n):
        super().__init__()
        self.blocks = nn.ModuleList(EdgeBlock() for _ in range(n))

    def forward(self, h):
        for b in self.blocks:
            h = b(h)
        return h


class TwoStacks(nn.Module):
    """Two calls of one class in two structures, each a stack of repeated blocks: stacks, not a hybrid stack."""

    def __init__(self):
        super().__init__()
        self.emb, self.head = nn.Embedding(VOCAB, H), nn.Linear(H, VOCAB)
        self.enc, self.dec = Stack(2), Stack(3)

    def forward(self, x):
        return self.head(self.dec(self.enc(self.emb(x))))


def test_stacks_of_one_class_are_not_taken_for_a_hybrid_stack():
    x = torch.randint(0, VOCAB, (2, 8))
    layers = find_layers(trace(seeded(TwoStacks), (x,), (x,), lm_cross_entropy, None).gm)
    assert layers.paths == tuple([f"enc.blocks.{i}" for i in range(2)] + [f"dec.blocks.{i}" for i in range(3)])


RUNS = [("regions", "none"), ("regions", "layer"), ("cpmant", "none"), ("hrm_text", "none"), ("nemotron_h", "none"),
        ("blt", "none")]


def _train_every_edge_run():
    out = {}
    for name, recompute in RUNS:
        program = _edge_tp2_pp2(name, recompute)  # inherited from the test process
        out[(name, recompute)] = train_steps(program.materialize(), _edge_batches(), LR)
    return out


@pytest.mark.multiprocess
def test_families_with_regions_and_hybrid_stacks_match_one_device():
    """The regions model also with each layer recomputed (its regions inside the checkpointed layers);
    BLT with its patches given (its layers: the local encoder's and decoder's; the global transformer
    between them stays outside the layers)."""
    for name, recompute in RUNS:  # compile once here: the ranks inherit the programs
        _edge_tp2_pp2(name, recompute)
    results = spawn_ranks(_train_every_edge_run, 4)
    for name, recompute in RUNS:
        assert_ranks_match(reference_run(_edge_model(name), _edge_batches(), lr=LR),
                           [res[(name, recompute)] for res in results], f"{name} recompute={recompute}")


class CondBlock(RegionBlock):
    def forward(self, h):
        u = self.up(self.norm(h))
        u = torch.cond(u.mean() > 0, lambda u: F.gelu(u), lambda u: F.relu(u), (u,))
        return h + self.down(u)


def test_a_higher_order_op_the_engine_does_not_run_is_refused_with_its_line():
    """``torch.cond`` (traced by torch.export directly here: the graph the cut would get) is refused before
    any chunk is made, naming the op, its node, its module and the model's line."""
    from passes.pipeline_split import _check_regions

    model = seeded(Regions)
    model.blocks[2] = seeded(CondBlock)
    gm = torch.export.export(model, (torch.randint(0, VOCAB, (2, 8)),), strict=False).module()
    with pytest.raises(PipelineError, match=r"higher-order op cond \(graph node cond, module 'blocks.2', at "
                                            r"test_hf_family_edges.py:\d+ u = torch.cond\(u.mean\(\) > 0.*\) runs a "
                                            r"sub-graph the engine does not run.*Fix: .*torch.where"):
        _check_regions(gm)
    _check_regions(torch.export.export(seeded(Regions), (torch.randint(0, VOCAB, (2, 8)),), strict=False).module())
    # as a user meets it: torch's own Function behind cond is not taken for the model's, and the
    # compile refuses the op by name before any process starts
    with pytest.raises(PipelineError, match=r"higher-order op cond .*test_hf_family_edges.py:\d+ u = torch.cond"):
        parallelize_on(model, _edge_batches(), ROWS // M, tp=2, pp=2, microbatches=M)


class DropoutRegionBlock(RegionBlock):
    """Dropout inside an ``autocast`` region: the evaluation graph must switch it off there too."""

    def forward(self, h):
        with torch.autocast("cpu", enabled=False):
            n = F.dropout(self.norm(h), p=0.5, training=self.training)
        return h + self.down(F.gelu(self.up(n)))


def test_a_region_is_evaluated_in_eval_mode():
    """The sub-graph a region runs gets its evaluation form like the chunk around it: a dropout in it
    is removed (the training graph's region keeps it), and ``eval_step`` equals ``model.eval()``."""
    model = seeded(Regions)
    model.blocks[1] = seeded(DropoutRegionBlock)
    data = _edge_batches()
    program = parallelize_on(model, data, ROWS // M, microbatches=M)
    (x,), (y,) = data[0]
    chunk = program.split.chunks[0]

    def dropouts(gm):
        return sum(1 for m in gm.modules() if isinstance(m, torch.fx.GraphModule)
                   for n in m.graph.nodes if "dropout" in str(n.target))

    assert dropouts(chunk.gm) >= 1 and dropouts(chunk.eval_gm) == 0
    with torch.no_grad():
        want = float(lm_cross_entropy(model.eval()(x), y))
    # fp32, the same ops on one process; microbatch losses averaged in another order: 1e-5 relative
    torch.testing.assert_close(program.materialize().eval_step(x, y), want, rtol=1e-5, atol=1e-6)
