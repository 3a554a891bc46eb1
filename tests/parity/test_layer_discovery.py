"""Layers found from the graph's module calls, wherever the blocks are held; and a model with none.

A Llama whose blocks sit in an ``nn.ModuleDict`` keyed by names, in separate
attributes, or in nested containers (``decoder.stages[i].blocks[j]``): the
same four layers are found (count, nodes and parameters per layer, per-layer
collectives, per-layer checkpoints), and tp=2, pp=2 and pp=2 with
recompute='layer' match one device. Blocks reached through a plain list built
in forward, or a plain dict of blocks registered with ``add_module`` under
arbitrary names: the same layers, matching one device at tp=2 and pp=2. One
block called four times: four layers, matching one device at pp=2. The
ModuleDict form interleaved (pp=2, virtual_stages=2, one layer per chunk),
with and without recompute='layer', matches one device. A model with no
repeated structure compiles at pp=1 (and matches one device at tp=2); pp=2 and
recompute='layer' are refused with a message naming what was looked for and a
different layout.
"""

from collections import Counter

import pytest
import torch.nn as nn
import torch.nn.functional as F
from families import FF, TB, RMSNorm, precompute_freqs_cis, train_steps
from helpers import assert_ranks_match, parallelize_on, seeded, spawn_ranks, token_batches

import autopar
from autopar.core.activation_recompute import Checkpointed
from passes.pipeline_split import PipelineError
from passes.recompute import with_recompute

V, H, S, L = 128, 64, 16, 4
D = 16


class _Llama(nn.Module):
    def __init__(self):
        super().__init__()
        self.tok_embeddings = nn.Embedding(V, H)
        self.norm = RMSNorm(H)
        self.output = nn.Linear(H, V, bias=False)
        self.register_buffer("freqs_cis", precompute_freqs_cis(D, S * 2), persistent=False)

    def blocks(self):
        raise NotImplementedError

    def forward(self, tokens):
        h = self.tok_embeddings(tokens)
        fc = self.freqs_cis[: tokens.shape[1]]
        for block in self.blocks():
            h = block(h, fc)
        return self.output(self.norm(h)).float()


class DictLlama(_Llama):
    """Blocks in an nn.ModuleDict keyed by names."""

    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleDict({f"layer{i}": TB(False) for i in range(L)})

    def blocks(self):
        return self.layers.values()


class AttrLlama(_Llama):
    """Blocks as separate attributes."""

    def __init__(self):
        super().__init__()
        self.block_a, self.block_b, self.block_c, self.block_d = (TB(False) for _ in range(L))

    def blocks(self):
        return [self.block_a, self.block_b, self.block_c, self.block_d]


class Stage(nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList([TB(False) for _ in range(2)])

    def forward(self, h, fc):
        for block in self.blocks:
            h = block(h, fc)
        return h


class Decoder(nn.Module):
    def __init__(self):
        super().__init__()
        self.stages = nn.ModuleList([Stage() for _ in range(L // 2)])


class NestedLlama(_Llama):
    """Blocks at decoder.stages[i].blocks[j]."""

    def __init__(self):
        super().__init__()
        self.decoder = Decoder()

    def blocks(self):
        return list(self.decoder.stages)


class RuntimeListLlama(_Llama):
    """Blocks in a ModuleList, run through a plain Python list built in forward."""

    def __init__(self):
        super().__init__()
        self.stack = nn.ModuleList([TB(False) for _ in range(L)])

    def blocks(self):
        picked = []
        for i in range(len(self.stack)):
            picked.append(self.stack[i])
        return picked


class PlainDictLlama(_Llama):
    """Blocks registered with add_module under arbitrary names, run from a plain dict attribute."""

    def __init__(self):
        super().__init__()
        self.pool = {}
        for name in ("zeta", "alpha", "q7", "mid"):
            block = TB(False)
            self.add_module(name, block)
            self.pool[name] = block

    def blocks(self):
        return list(self.pool.values())


class ReusedLlama(_Llama):
    """One block called L times in forward (weights shared across the layers)."""

    def __init__(self):
        super().__init__()
        self.block = TB(False)

    def blocks(self):
        return [self.block] * L


class MLPBlock(nn.Module):
    """A block of another structure: a gated MLP alone."""

    def __init__(self):
        super().__init__()
        self.norm, self.feed_forward = RMSNorm(H), FF()

    def forward(self, h, fc):
        return h + self.feed_forward(self.norm(h))


class Alternating(_Llama):
    """Attention blocks and MLP blocks alternate in one ModuleList."""

    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList([TB(False) if i % 2 == 0 else MLPBlock() for i in range(L)])

    def blocks(self):
        return self.layers


class FirstDiffers(_Llama):
    """A ModuleDict whose first block is an MLP block, the others attention blocks."""

    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleDict({"first": MLPBlock(), **{f"b{i}": TB(False) for i in range(1, L)}})

    def blocks(self):
        return self.layers.values()


class FirstAttr(_Llama):
    """A different first block held as a plain attribute beside a ModuleList of the others."""

    def __init__(self):
        super().__init__()
        self.first = MLPBlock()
        self.layers = nn.ModuleList([TB(False) for _ in range(1, L)])

    def blocks(self):
        return [self.first, *self.layers]


class SeqTB(TB):
    """An attention block taking the hidden state alone (for an nn.Sequential), its rotary table a buffer."""

    def __init__(self):
        super().__init__(False)
        self.register_buffer("fc", precompute_freqs_cis(D, S * 2)[:S], persistent=False)

    def forward(self, h):
        return super().forward(h, self.fc)


class SeqMLP(MLPBlock):
    def forward(self, h):
        return super().forward(h, None)


class LastInSequential(nn.Module):
    """Blocks inside a called nn.Sequential whose last block is an MLP block; embedding and head outside it."""

    def __init__(self):
        super().__init__()
        self.tok_embeddings = nn.Embedding(V, H)
        self.body = nn.Sequential(*[SeqTB() for _ in range(L - 1)], SeqMLP())
        self.norm = RMSNorm(H)
        self.output = nn.Linear(H, V, bias=False)

    def forward(self, tokens):
        return self.output(self.norm(self.body(self.tok_embeddings(tokens)))).float()


class Flat(nn.Module):
    """No repeated structure: embedding, an MLP of two different linears, the head."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(V, H)
        self.up, self.down = nn.Linear(H, 96), nn.Linear(96, H)
        self.head = nn.Linear(H, V, bias=False)

    def forward(self, x):
        h = self.emb(x)
        return self.head(h + self.down(F.gelu(self.up(h))))


class FlatSameShapes(nn.Module):
    """No repeated block, though single modules repeat: two linears of one shape, two norms, the head."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(V, H)
        self.norm_a, self.norm_b = RMSNorm(H), RMSNorm(H)
        self.fc_a, self.fc_b = nn.Linear(H, H), nn.Linear(H, H)
        self.head = nn.Linear(H, V, bias=False)

    def forward(self, x):
        h = self.emb(x)
        h = h + self.fc_b(F.gelu(self.fc_a(self.norm_a(h))))
        return self.head(self.norm_b(h))


FORMS = {
    "module_dict": (DictLlama, [f"layers.layer{i}" for i in range(L)]),
    "attributes": (AttrLlama, [f"block_{c}" for c in "abcd"]),
    "nested": (NestedLlama, [f"decoder.stages.{i // 2}.blocks.{i % 2}" for i in range(L)]),
    "runtime_list": (RuntimeListLlama, [f"stack.{i}" for i in range(L)]),
    "plain_dict": (PlainDictLlama, ["zeta", "alpha", "q7", "mid"]),
}
BLOCK_PARAMS = 9  # wq, wk, wv, wo, w1, w2, w3 and two norms


def form_batches():
    return token_batches(V, steps=2, rows=8, seed=3, seq=S)


def _compile_form(model, **config):
    config.setdefault("sequence_parallel", False)  # the structure counts tensor parallelism's all-reduces
    return parallelize_on(model, form_batches(), 8 // config.get("microbatches", 1), **config)


def _tp2_pp2(shared, factory):
    """The seeded model compiled at tp=2 x pp=2 (2 microbatches, 4 ranks), once per module: the tests only read it."""
    return shared(("tp2 pp2", factory),
                  lambda: _compile_form(seeded(factory), tp=2, pp=2, microbatches=2, world_size=4))


@pytest.mark.parametrize("form", list(FORMS))
def test_layers_found_with_their_nodes_and_parameters(shared, form):
    factory, paths = FORMS[form]
    program = _tp2_pp2(shared, factory)
    layers = program.layers
    assert layers.count == L and list(layers.paths) == paths and not layers.by_calls
    assert [layers.label(i) for i in range(L)] == paths
    per_layer_nodes = Counter(layers.node_layer.values())
    assert sorted(per_layer_nodes) == list(range(L)) and len(set(per_layer_nodes.values())) == 1
    for i, path in enumerate(paths):
        assert program.layer_params(f"{path}.attention.wq.weight") == i
        assert program.layer_params(f"{path}.feed_forward.w2.weight") == i
    assert program.layer_params("tok_embeddings.weight") is None and program.layer_params("output.weight") is None
    owned = Counter(program.layer_params(n) for n in program.param_names)
    assert owned[None] == 3 and {owned[i] for i in range(L)} == {owned[0]}
    per_layer = {k: n for k, n in program.collectives(by_layer=True).items() if k[0] is not None}
    assert per_layer == {(i, kind): 2 for i in range(L) for kind in ("copy_to_tp", "reduce_from_tp")}
    assert [c.layers for c in program.split.chunks] == [[0, 1], [2, 3]]
    for chunk in program.split.chunks:
        wrapped = with_recompute(chunk.gm, "layer", layers)
        assert sum(isinstance(m, Checkpointed) for m in wrapped.children()) == len(chunk.layers)
    summary = program.summary()
    assert f"{L} layers ('{paths[0]}' .. '{paths[-1]}')" in summary
    # the summary's layer table: each layer's module and its node range, in graph order
    names = [n.name for n in program.traced.gm.graph.nodes if layers.node_layer.get(n.name) == L - 1]
    assert f"{names[0]} .. {names[-1]}" in summary and all(path in summary for path in paths)


@pytest.mark.parametrize("form", ["runtime_list", "plain_dict"])
def test_blocks_chosen_at_run_time_are_counted_like_a_module_dict(shared, form):
    """Blocks reached through a list or dict built outside any module container: the same layer count,
    nodes per layer and parameters per layer as the ModuleDict form."""
    want, program = _tp2_pp2(shared, DictLlama), _tp2_pp2(shared, FORMS[form][0])
    nodes = Counter(want.layers.node_layer.values())
    assert program.layers.count == want.layers.count == L
    assert Counter(program.layers.node_layer.values()) == nodes and len(set(nodes.values())) == 1 and nodes[0] > 0
    owned = Counter(program.layer_params(n) for n in program.param_names)
    assert owned == {**{i: BLOCK_PARAMS for i in range(L)}, None: 3}
    assert len(program.param_names) == L * BLOCK_PARAMS + 3


def test_one_block_called_four_times_is_four_layers(shared):
    want, program = _tp2_pp2(shared, DictLlama), _tp2_pp2(shared, ReusedLlama)
    layers = program.layers
    assert layers.count == L and layers.by_calls and list(layers.paths) == ["block"] * L
    assert Counter(layers.node_layer.values()) == Counter(want.layers.node_layer.values())
    assert len(program.param_names) == BLOCK_PARAMS + 3
    assert all(program.layer_params(n) is None for n in program.param_names)  # every layer calls the block
    assert [c.layers for c in program.split.chunks] == [[0, 1], [2, 3]]
    assert f"{L} layers ('block' .. 'block', one block called repeatedly)" in program.summary()


def test_interleaved_pipeline_takes_one_layer_per_chunk():
    program = _compile_form(seeded(DictLlama), pp=2, virtual_stages=2, schedule="interleaved", microbatches=2,
                       world_size=2)
    assert [c.layers for c in program.split.chunks] == [[0], [1], [2], [3]]
    for chunk in program.split.chunks:
        wrapped = with_recompute(chunk.gm, "layer", program.layers)
        assert sum(isinstance(m, Checkpointed) for m in wrapped.children()) == 1


HETERO = {  # model, layer paths, kinds (each layer's first layer of its structure), the MLP-block layers
    "alternating": (Alternating, [f"layers.{i}" for i in range(L)], (0, 1, 0, 1), {1, 3}),
    "first_differs": (FirstDiffers, ["layers.first", "layers.b1", "layers.b2", "layers.b3"], (0, 1, 1, 1), {0}),
    "first_attribute": (FirstAttr, ["first", "layers.0", "layers.1", "layers.2"], (0, 1, 1, 1), {0}),
    "last_in_sequential": (LastInSequential, [f"body.{i}" for i in range(L)], (0, 0, 0, 3), {3}),
}


@pytest.mark.parametrize("form", list(HETERO))
def test_blocks_of_two_kinds_are_layers_each_shown_once(shared, form):
    """Blocks of another structure in the same container are layers too, of their own kind: the
    pipeline cut and the per-layer counts see them, the summary shows each kind's first layer."""
    factory, paths, kinds, mlp = HETERO[form]
    program = _tp2_pp2(shared, factory)
    layers = program.layers
    assert layers.count == L and list(layers.paths) == paths and layers.kinds == kinds
    sizes = Counter(layers.node_layer.values())
    assert len({sizes[i] for i in mlp}) == 1 and len({sizes[i] for i in set(range(L)) - mlp}) == 1
    for i, path in enumerate(paths):
        assert program.layer_params(f"{path}.feed_forward.w2.weight") == i
    per_layer = {k: n for k, n in program.collectives(by_layer=True).items() if k[0] is not None}
    assert per_layer == {(i, kind): 1 if i in mlp else 2 for i in range(L) for kind in ("copy_to_tp", "reduce_from_tp")}
    assert [c.layers for c in program.split.chunks] == [[0, 1], [2, 3]]
    summary = program.summary()
    shown = {i for i in range(L) if f"{paths[i]}.feed_forward.w2.weight" in summary}
    assert shown == {layers.stands_for(i) for i in range(L)} == set(kinds)


@pytest.mark.parametrize("flat", [Flat, FlatSameShapes])
def test_no_repeated_structure_compiles_at_pp1_and_is_refused_where_layers_are_needed(flat):
    program = _compile_form(seeded(flat), tp=2, world_size=2)
    assert program.layers.count == 0 and [c.layers for c in program.split.chunks] == [[]]
    assert program.fallbacks() == [] and program.replicated_weights() == []
    assert "no repeated layers (looked for a module call repeated" in program.summary()
    assert "Layers: the repeated module calls" not in program.summary()
    chunk = _compile_form(seeded(flat), tp=2, world_size=2, recompute="chunk")
    assert isinstance(chunk.split.chunks[0].module, Checkpointed)
    with pytest.raises(PipelineError, match=r"pipeline parallelism \(pp \* virtual_stages = 2 chunks\) cuts between "
                                            r"repeated layers.*looked for a module call repeated at least twice.*"
                                            r"Fix: use pp=1 and virtual_stages=1"):
        _compile_form(seeded(flat), pp=2, microbatches=2, world_size=2)
    with pytest.raises(autopar.RecomputeError, match=r"recompute='layer' checkpoints each repeated layer.*looked for a "
                                             r"module call repeated.*Fix: use recompute='chunk'.*or recompute='none'"):
        _compile_form(seeded(flat), tp=2, world_size=2, recompute="layer")


INTERLEAVED = {"pp": 2, "virtual_stages": 2, "schedule": "interleaved", "microbatches": 2}
LAYOUTS = {"tp2": {"tp": 2}, "pp2": {"pp": 2, "microbatches": 2},
           "pp2_layer": {"pp": 2, "microbatches": 2, "recompute": "layer"},
           "pp2_v2": INTERLEAVED, "pp2_v2_layer": {**INTERLEAVED, "recompute": "layer"}}
RUNS = [(form, layout) for form in ("module_dict", "attributes", "nested") for layout in ("tp2", "pp2", "pp2_layer")]
RUNS += [(form, layout) for form in ("runtime_list", "plain_dict") for layout in ("tp2", "pp2")]
RUNS += [("reused", "pp2"), ("module_dict", "pp2_v2"), ("module_dict", "pp2_v2_layer")]
RUNS += [("flat", "tp2"), ("alternating", "pp2_layer"), ("first_differs", "pp2")]
RUNS += [("first_attribute", "pp2_layer"), ("last_in_sequential", "pp2"), ("last_in_sequential", "tp2")]


def _seeded_form(form):
    return seeded({"flat": Flat, "reused": ReusedLlama, **{k: v[0] for k, v in {**FORMS, **HETERO}.items()}}[form])


def _form_program(form, layout):
    cfg = LAYOUTS[layout]
    return parallelize_on(_seeded_form(form), form_batches(), 8 // cfg.get("microbatches", 1), **cfg)


def _train_every_form():
    out = {}
    for form, layout in RUNS:
        program = _form_program(form, layout)  # compiled in the test process before the spawn: inherited
        out[(form, layout)] = train_steps(program.materialize(), form_batches(), 1e-3)
    return out


@pytest.fixture(scope="module")
def form_runs():
    for form, layout in RUNS:  # compile once here, not once per rank
        _form_program(form, layout)
    return spawn_ranks(_train_every_form, 2, timeout_s=900)


@pytest.mark.multiprocess
@pytest.mark.parametrize("form,layout", RUNS)
def test_matches_one_device(form_runs, reference, form, layout):
    # one single-device run per form, whatever the layouts compared with it
    ref = reference(("layer discovery", form), lambda: _seeded_form(form), form_batches, lr=1e-3)
    assert_ranks_match(ref, [r[(form, layout)] for r in form_runs], label=f"{form} {layout}")
