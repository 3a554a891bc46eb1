"""The async tensor-parallel pass (``overlap={'tp'}``), without any process group.

Per layer of a transformer under sequence parallelism: two all-gathers, each
fused with the GEMMs reading it (q, k and v share one), and two reduce-scatters,
each fused with the row-parallel GEMM writing it; outside the layers the LM
head's all-gather is fused and the embedding's reduce-scatter is left whole.
The fused program moves the same bytes and counts the same GEMM FLOPs as the
unfused one. What does not match is left and the summary says why; what
refuses the pass (compiled chunks, zero-bubble schedules, no sequence
parallelism) and bad ``overlap`` values are named.
"""

import pytest
import torch
from families import BATCH, batches, hf_gptj, make
from helpers import parallelize_on

import autopar
from autopar.core.config import ConfigError, ParallelConfig
from autopar.core.flops import node_flops

# family -> GEMMs fused with each layer's (attention, MLP) all-gather
GEMMS_PER_GATHER = {"nanogpt": (3, 1), "llama": (3, 2), "hf-gpt2": (1, 1)}


def _compile(family, **config):
    if family == "hf-gptj":
        torch.manual_seed(0)
        model, vocab = hf_gptj(), 320
    else:
        model, vocab = make(family)
    return parallelize_on(model, batches(vocab, steps=1), BATCH, tp=2, sequence_parallel=True, **config)


def _flat(text: str) -> str:
    """The summary's words, its line wrapping undone."""
    return " ".join(text.split())


@pytest.fixture(scope="module")
def compile_sp(shared):
    """``compile_sp(family, overlap)``: the family at tp=2 with sequence parallelism, once per module."""
    return lambda family, overlap: shared((family, str(overlap)), lambda: _compile(family, overlap=overlap))


@pytest.mark.parametrize("family", list(GEMMS_PER_GATHER))
def test_each_layer_fuses_two_gathers_and_two_scatters(family, compile_sp):
    program = compile_sp(family, {"tp"})
    per_layer = program.collectives(by_layer=True)
    plan, nodes = program.async_tp, {n.name: n for n in program.rank_module.graph.nodes}
    for layer in range(program.layers.count):
        mine = {name: n for (at, name), n in per_layer.items() if at == layer}
        assert mine == {"all_gather_matmul": 2, "matmul_reduce_scatter": 2}, (layer, mine)
        gathers = [f for f in plan.fused if f.collective == "gather_from_sp"
                   and program._layer_of_node(nodes[f.node]) == layer]
        assert tuple(len(f.gemms) for f in gathers) == GEMMS_PER_GATHER[family]
    outside = {name: n for (at, name), n in per_layer.items() if at is None}
    assert outside["all_gather_matmul"] == 1 and "gather_from_sp" not in outside  # the LM head's
    assert outside["vocab_parallel_embedding_sp"] == 1
    assert [(w.collective, w.reason.split(":")[0]) for w in plan.left] == [
        ("vocab_parallel_embedding_sp", "the embedding's reduce-scatter")]


@pytest.mark.parametrize("family", list(GEMMS_PER_GATHER))
def test_the_fused_program_moves_the_same_bytes_and_counts_the_same_gemms(family, compile_sp):
    fused, plain = compile_sp(family, {"tp"}), compile_sp(family, False)
    assert fused.tp_communication(0).keys() != plain.tp_communication(0).keys()  # other collectives by name
    total = [sum(b for _, b in p.tp_communication(0).values()) for p in (fused, plain)]
    assert total[0] == total[1]
    plain_nodes = {n.name: n for n in plain.rank_module.graph.nodes}
    fused_nodes = {n.name: n for n in fused.rank_module.graph.nodes}
    for f in fused.async_tp.fused:
        assert node_flops(fused_nodes[f.node]) == sum(node_flops(plain_nodes[g]) for g in f.gemms), f


def test_a_parallel_blocks_summed_outputs_are_left_whole_and_said_why(compile_sp):
    program = compile_sp("hf-gptj", {"tp"})
    per_layer = program.collectives(by_layer=True)
    for layer in range(program.layers.count):  # attention and MLP read one gather: q, k, v and fc_in
        assert per_layer[(layer, "all_gather_matmul")] == 1 and per_layer[(layer, "reduce_scatter_to_sp")] == 1
    left = [w for w in program.async_tp.left if w.collective == "reduce_scatter_to_sp"]
    assert len(left) == program.layers.count and all("add.Tensor" in w.reason for w in left)
    summary = _flat(program.summary())
    assert f"left whole: {left[0].node} (reduce_scatter_to_sp in transformer.h.0): its input" in summary
    assert "not one bias-free GEMM's output" in summary


def test_the_summary_says_what_is_overlapped_and_why_not(compile_sp):
    summary = _flat(compile_sp("nanogpt", {"tp"}).summary())
    assert "Overlap, tensor parallelism (async TP): 5 all-gather(s)" in summary
    assert "per layer: 2 all-gather(s) + 2 reduce-scatter(s) in 2 layer(s)" in summary
    assert "Overlap, pipeline receives: as lowered" in summary
    off = _flat(compile_sp("nanogpt", False).summary())
    assert "Overlap, tensor parallelism (async TP): off (overlap has no 'tp')" in off


@pytest.mark.parametrize("config,why", [
    (dict(overlap=True, compile="aot_eager"), "Dynamo cannot trace"),
    (dict(overlap={"tp"}, pp=2, schedule="zb-h1", microbatches=2), "defers each backward's weight GEMMs"),
])
def test_compiled_chunks_and_split_backwards_keep_the_collectives_whole(config, why):
    program = _compile("nanogpt", **config)
    assert program.async_tp is None
    assert "all_gather_matmul" not in program.collectives() and program.collectives()["gather_from_sp"]
    assert why in _flat(program.summary())


def test_overlap_values():
    assert ParallelConfig(tp=2, pp=2, sequence_parallel=True, overlap=True).overlap == {"tp", "p2p"}
    assert ParallelConfig(tp=2, overlap=True).overlap == frozenset()  # sequence parallelism off, no pipeline
    assert ParallelConfig(pp=2, overlap="p2p").overlap == {"p2p"}
    assert ParallelConfig(tp=2, pp=2).overlap == frozenset()  # the default: nothing overlapped
    assert ParallelConfig(tp=2, pp=2, sequence_parallel=None).overlap == frozenset()
    assert ParallelConfig(tp=2, pp=2, sequence_parallel=None, overlap=True).overlap == {"tp", "p2p"}
    assert ParallelConfig(tp=2, pp=2, sequence_parallel=True, overlap=False).overlap == frozenset()
    for config, message in [(dict(tp=2, overlap={"tp"}), "sequence_parallel=False has none"),
                            (dict(overlap={"p2p"}), "pp=1 has no pipeline"),
                            (dict(pp=2, overlap={"p2p", "dp"}), "does not know"),
                            (dict(pp=2, overlap=2), "must be True, False or a set")]:
        with pytest.raises(ConfigError, match=message):
            ParallelConfig(**config)
    model, _ = make("nanogpt")
    with pytest.raises(ConfigError, match="sequence_parallel=False"):
        autopar.parallelize(model, tp=2, overlap={"tp"}, example_inputs=(torch.zeros(2, 16, dtype=torch.long),))
