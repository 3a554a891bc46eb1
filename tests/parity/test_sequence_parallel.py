"""Sequence parallelism: parity with one device, its collectives and bytes, the activations it saves.

Parity (one spawn of 4 gloo ranks, every case in it): sequence parallelism at
tp=4 and tp=2, with pp=2 interleaved (v=2), with recompute='layer', with
dp=2, on the reference models (the GPT's tied embedding reduce-scattered along
the tokens), three HuggingFace families (GPT-2: tied head, 2 sequences per
microbatch split sequence by sequence;
Llama: grouped-query attention; GPT-J: parallel blocks) and an
``nn.TransformerEncoder`` language model; loss and every gradient against the
single-device run, tolerances as in test_tp_parity (``families.assert_steps_match``:
fp32 first step element-wise rtol 1e-5 / atol 1e-6, the parallel run only
reorders sums; after AdamW per tensor).

The parity runs use the default ``overlap`` (async tensor parallelism: the
all-gathers and reduce-scatters fused with their GEMMs, in ring steps at tp=4
too); the structure and kept-bytes checks compile with ``overlap=False``, to
see sequence parallelism's own collectives.

Structure (compile only, no process group): each all-reduce after a
row-parallel linear becomes one reduce-scatter and the next f one all-gather,
the same bytes on the wire; a pipeline boundary inside the split region sends
1/t of the replicated one. Kept activations: the engine's saved-tensor count
falls by what the graph predicts (the split ops and the linears after each
all-gather save 1/t), and each layer keeps 1/t of what it keeps on one device.
"""

import pytest
import torch
import torch.nn as nn
from families import SEQ, hf_gptj, make, train_steps
from helpers import assert_ranks_match, parallelize_on, reference_run, seeded, spawn_ranks, token_batches

import autopar
from autopar.core import comm
from autopar.core.collectives import collective_named, output_bytes, wire_factor
from autopar.core.comm import TPGroup, keeping_gathered_slices
from autopar.reference.models import build

LR, ROWS = 1e-3, 4
_VIEWS = {torch.ops.aten.view.default, torch.ops.aten.reshape.default, torch.ops.aten.t.default,
          torch.ops.aten.transpose.int, torch.ops.aten.flatten.using_ints, torch.ops.aten.alias.default}


class EncoderLM(nn.Module):
    """A language model around ``nn.TransformerEncoder`` (batch_first, post-norm, causal mask)."""

    def __init__(self, vocab: int = 320, width: int = 64, layers: int = 2):
        super().__init__()
        self.emb = nn.Embedding(vocab, width)
        self.pos = nn.Parameter(torch.randn(1, SEQ, width) * 0.02)
        layer = nn.TransformerEncoderLayer(width, 4, 2 * width, dropout=0.0, batch_first=True)
        self.enc = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.head = nn.Linear(width, vocab)
        self.register_buffer("mask", nn.Transformer.generate_square_subsequent_mask(SEQ), persistent=False)

    def forward(self, x):
        return self.head(self.enc(self.emb(x) + self.pos, mask=self.mask, is_causal=True))


def _sp_model(name: str):
    if name == "encoder":
        return seeded(EncoderLM), 320
    if name == "hf-gptj":
        return seeded(hf_gptj), 320
    if name == "llama-4":
        return seeded(build, "llama", vocab_size=320, seq_len=SEQ, n_layer=4, n_head=8, n_kv_head=4, d_model=64,
                      d_ff=96), 320
    return make(name)


# (model, tp, pp, virtual stages, recompute) on 4 ranks: dp = 4 / (tp * pp)
# (model, tp, pp, virtual stages, recompute) on 4 ranks: dp = 4 / (tp * pp). hf-gpt2 has 2
# sequences per microbatch (flattened tokens split sequence by sequence); nanogpt ties its head to
# the vocabulary-parallel embedding, whose output runs split.
CASES = [("nanogpt", 4, 1, 1, "none"), ("llama-4", 2, 2, 2, "layer"), ("hf-gpt2", 2, 2, 1, "none"),
         ("hf-llama", 2, 1, 1, "none"), ("hf-gptj", 2, 1, 1, "layer"), ("encoder", 2, 1, 1, "none")]


def _sp_batches(vocab):
    return token_batches(vocab, steps=2, rows=ROWS, seed=5)


def _sp_program(case):
    """The case's program and its batches."""
    name, tp, pp, v, recompute = case
    model, vocab = _sp_model(name)
    data = _sp_batches(vocab)
    dp, m = 4 // (tp * pp), 2
    # world_size given: the test process, where it is compiled first, has no group of 4 to infer dp from
    program = parallelize_on(model, data, ROWS // (dp * m), tp=tp, pp=pp, virtual_stages=v, microbatches=m,
                             recompute=recompute, sequence_parallel=True, world_size=4)
    return program, data


def _train_sp_case(case):
    program, data = _sp_program(case)  # compiled in the test process before the spawn: inherited
    losses, grads = train_steps(program.materialize(), data, LR)
    return losses, grads, len(program.sequence.seeds)


def _kept_programs():
    """The nanogpt at tp=2 x dp=2 without and with sequence parallelism (by ``sequence_parallel``), and its batches."""
    model, vocab = _sp_model("nanogpt")
    data = _sp_batches(vocab)
    return {sp: parallelize_on(model, data, ROWS // 2, tp=2, dp=2, sequence_parallel=sp, overlap=False)
            for sp in (False, True)}, data


def _kept_bytes():
    """Bytes autograd keeps for one microbatch (the engine's count), without and with sequence parallelism."""
    programs, data = _kept_programs()
    out = {}
    for sp, program in programs.items():
        engine = program.materialize()
        engine.train_step(*data[0][0], *data[0][1])
        out[sp] = engine.stats["peak_activation_bytes"]
    return out


def _train_sp_cases():
    return {case: _train_sp_case(case) for case in CASES}, _kept_bytes()


@pytest.fixture(scope="module")
def kept_programs():
    """``_kept_programs()``'s programs, compiled once for the ranks and the graph's count alike."""
    return _kept_programs()[0]


@pytest.fixture(scope="module")
def sp_runs(kept_programs):
    for case in CASES:  # compile once here, not once per rank
        _sp_program(case)
    return spawn_ranks(_train_sp_cases, 4)


@pytest.mark.multiprocess
def test_sequence_parallel_matches_one_device(sp_runs):
    for case in CASES:
        model, vocab = _sp_model(case[0])
        ref = reference_run(model, _sp_batches(vocab), lr=LR)
        assert_ranks_match(ref, [r[0][case][:2] for r in sp_runs], label=f"sequence parallel {case}")
        assert all(r[0][case][2] > 0 for r in sp_runs), f"{case}: nothing ran split on the tokens"


@pytest.mark.multiprocess
def test_kept_activations_fall_as_the_graph_predicts(sp_runs, kept_programs):
    whole, split = kept_programs[False], kept_programs[True]
    saved_whole, saved_split = _saved_by_node(whole), _saved_by_node(split)
    # the ops split on the tokens and the readers of each all-gathered value (the column-parallel
    # linears, keeping the local slice) save 1/t of what they saved whole; every other op the same
    # (the embedding looks up every token before its reduce-scatter: it keeps all the ids)
    at_one_tp_th = set(split.sequence.split) - set(split.sequence.seeds) | _gathered_readers(split)
    assert at_one_tp_th & set(saved_whole)
    for node, nbytes in saved_whole.items():
        assert saved_split.get(node, 0) == (nbytes // 2 if node in at_one_tp_th else nbytes), node
    # the engine counts what the graph says: each saved storage once, and the chunk's output (the fp32
    # loss, kept in its context until its backward)
    loss_bytes = 4
    for kept in (r[1] for r in sp_runs):
        assert kept[False] == sum(_kept_by_layer(whole).values()) + loss_bytes
        assert kept[True] == sum(_kept_by_layer(split).values()) + loss_bytes


def _gathered_readers(program) -> set[str]:
    """Nodes reading an all-gather of split tokens (through views)."""
    graph = program.split.chunks[0].gm.graph
    todo = [n for n in graph.nodes if n.target is comm.gather_from_sp]
    readers: set[str] = set()
    while todo:
        for user in todo.pop().users:
            readers.add(user.name)
            if user.target in _VIEWS:
                todo.append(user)
    return readers


def _chunk_args(program, params):
    """One rank's arguments of the (one-chunk) program: an inspection group (collectives give
    shapes only), the parameters, zeros of the inputs' local shapes."""
    args = [TPGroup(0, program.tp, None)]
    for node in list(program.split.chunks[0].gm.graph.nodes)[1:]:
        if node.op != "placeholder":
            break
        val = node.meta["local_val"]
        args.append(params[node.name] if node.name in params else torch.zeros(val.shape, dtype=val.dtype))
    return args


def _record_saved(program, on_save) -> None:
    """Run the (one-chunk) program once as the engine does (kept slices of gathered values on),
    calling ``on_save(node, tensor)`` for each tensor autograd saves, weights left out."""
    chunk = program.split.chunks[0]
    params = {p: torch.randn(program.local_shape(program.traced.param_of[p]), requires_grad=True) for p in chunk.params}
    ptrs = {t.untyped_storage().data_ptr() for t in params.values()}
    run = torch.fx.Interpreter(chunk.gm)
    current = [None]

    def run_node(n, _train_sp_case=run.run_node):
        current[0] = n
        return _train_sp_case(n)

    def pack(t):
        if t.untyped_storage().data_ptr() not in ptrs:
            on_save(current[0], t)
        return t

    run.run_node = run_node
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), keeping_gathered_slices():
        run.run(*_chunk_args(program, params))


def _saved_by_node(program) -> dict[str, int]:
    """Bytes autograd saves during each node, counted per save as the engine counts them."""
    saved: dict[str, int] = {}

    def on_save(node, t):
        saved[node.name] = saved.get(node.name, 0) + t.numel() * t.element_size()

    _record_saved(program, on_save)
    return saved


def _kept_by_layer(program) -> dict[int | None, int]:
    """Bytes of the activations kept for the backward, per layer: each storage once, in the layer
    of the op that saved it first."""
    seen: set[int] = set()
    kept: dict[int | None, int] = {}

    def on_save(node, t):
        storage = t.untyped_storage()
        if storage.data_ptr() not in seen:
            seen.add(storage.data_ptr())
            layer = program._layer_of_node(node)
            kept[layer] = kept.get(layer, 0) + storage.nbytes()

    _record_saved(program, on_save)
    return kept


def test_each_layer_keeps_one_tp_th_of_its_activations(shared):
    """Korthikanti et al.: with sequence parallelism a layer keeps s b h (34 + 5 a s / h) / t bytes
    in 16-bit, the whole replicated region at 1/t. The fp32 analogue for the reference GPT (fused
    attention: no s^2 terms, dropout 0: no masks), counted from its graph: 4 (16 s b h + 4 s b + a s b)
    bytes per layer (LN inputs and outputs, q/k/v, the attention output, the MLP's two 4h values;
    two LN statistics each; the attention's log-sum-exp), at tp=1, and exactly 1/t of it per layer
    with sequence parallelism at tp=2 and tp=4 (the linears keep their input's local slice)."""
    s, b, h, a = SEQ, 2, 64, 4
    per_layer = 4 * (16 * s * b * h + 4 * s * b + a * s * b)
    one = _kept_by_layer(_shared_sp(shared, 1, sp=False))
    assert one[0] == one[1] == per_layer
    for tp in (2, 4):
        kept = _kept_by_layer(_shared_sp(shared, tp))
        assert kept[0] == kept[1] == per_layer // tp, tp
        tp_only = _kept_by_layer(_shared_sp(shared, tp, sp=False))
        assert tp_only[0] > kept[0] * 1.2  # tensor parallelism alone keeps the replicated region whole


def test_flattened_tokens_of_several_sequences_stay_split_through_the_views():
    """HF GPT-2 views (B, T, C) as (B*T, C) around each linear; with 2 sequences per microbatch the
    tokens are split sequence by sequence (each t ways), so no gather is added, and each layer
    keeps 1/t of what it keeps at tp=1, but for the attention mask (per sequence pair of tokens,
    computed from positions: whole on every rank)."""
    model, vocab = make("hf-gpt2")
    data = _sp_batches(vocab)
    one = _kept_by_layer(parallelize_on(model, data, 2, tp=1, dp=1))
    for tp in (2, 4):
        program = parallelize_on(model, data, 2, tp=tp, dp=1, sequence_parallel=True)
        assert program.sequence.gathers == () and "no gather added" in program.summary()
        assert {program.sequence.split[g].segments for g in program.sequence.seeds} >= {(SEQ, SEQ)}
        mask = _attention_mask_bytes(program)
        assert mask > 0
        kept = _kept_by_layer(program)
        assert kept[0] == kept[1] == (one[0] - mask) // tp + mask, tp


def _attention_mask_bytes(program) -> int:
    """Bytes of one layer's attention mask argument (the same at any tp)."""
    for node in program.split.chunks[0].gm.graph.nodes:
        if node.target is torch.ops.aten.scaled_dot_product_attention.default and len(node.args) > 3:
            mask = node.args[3].meta["local_val"]
            return 4 * mask.numel()  # the float mask SDPA saves
    return 0


def _compile_sp(tp, pp=1, sp=True, layers=2, **kw):
    """The nanogpt with sequence parallelism's own collectives (``overlap=False``: by default they are
    fused with their GEMMs, ``tests/passes/test_async_tp.py``)."""
    model, vocab = make("nanogpt", layers=layers)
    data = _sp_batches(vocab)
    return parallelize_on(model, data, 2, tp=tp, pp=pp, microbatches=pp, dp=1, sequence_parallel=sp,
                          overlap=False, **kw)


def _shared_sp(shared, *args, **kw):
    """``_compile_sp(*args, **kw)`` once per module: the tests that call this only read the program."""
    return shared(("sp", args, tuple(sorted(kw.items()))), lambda: _compile_sp(*args, **kw))


def _wire_bytes(program, names) -> float:
    """Bytes one rank sends per microbatch in the named collectives (ring wire factors)."""
    total = 0.0
    for node in program.rank_module.graph.nodes:
        if node.op == "call_function" and getattr(node.target, "__name__", "") in names:
            spec = collective_named(node.target.__name__)
            total += spec.nbytes(node) / len(spec.kinds) * sum(wire_factor(k, program.tp) for k in spec.kinds)
    return total


@pytest.mark.parametrize("tp", [2, 4])
def test_each_all_reduce_becomes_a_reduce_scatter_and_an_all_gather_of_the_same_bytes(shared, tp):
    whole, split = _shared_sp(shared, tp, sp=False), _shared_sp(shared, tp)
    before, after = whole.collectives(by_layer=True), split.collectives(by_layer=True)
    for layer in range(2):
        assert before[(layer, "reduce_from_tp")] == 2 and after[(layer, "reduce_from_tp")] == 0
        assert after[(layer, "reduce_scatter_to_sp")] == 2
        # every f before a column-parallel region becomes the all-gather (layer 0's too: the
        # embedding's all-reduce became a reduce-scatter, its output runs split)
        assert after[(layer, "gather_from_sp")] == before[(layer, "copy_to_tp")] == 2
        assert after[(layer, "copy_to_tp")] == 0
    counts = split.collectives()
    assert counts["vocab_parallel_embedding_sp"] == 1 and counts["vocab_parallel_embedding"] == 0
    assert counts["gather_from_sp"] == 5 and counts["reduce_scatter_to_sp"] == 4  # + the head's f
    # a ring all-reduce is a reduce-scatter plus an all-gather: the same bytes as the g and f
    # all-reduces, plus one all-gather of each f's value in the backward (the kept slice gathered again)
    gathered = sum(output_bytes(n) for n in split.rank_module.graph.nodes if n.target is comm.gather_from_sp)
    assert _wire_bytes(split, {"reduce_scatter_to_sp", "gather_from_sp", "vocab_parallel_embedding_sp"}) == \
        pytest.approx(_wire_bytes(whole, {"reduce_from_tp", "copy_to_tp", "vocab_parallel_embedding"})
                      + gathered * (tp - 1) / tp)
    assert "reduce_scatter_to_sp" in split.code(0) and "gather_from_sp" in split.code(0)


def test_a_boundary_inside_the_split_region_sends_one_tp_th(shared):
    whole, split = _shared_sp(shared, 2, pp=2, sp=False), _shared_sp(shared, 2, pp=2)
    (b_whole,), (b_split,) = whole.split.chunks[1].inputs, split.split.chunks[1].inputs
    assert b_whole.replicated and not b_split.replicated and whole.sent_sliced(b_whole)
    assert b_split.nbytes * 2 == b_whole.nbytes
    assert split.p2p_and_dp_bytes() == whole.p2p_and_dp_bytes()  # 1/t either way: sliced, or split already
    assert not any(k[0] == "boundary" for k in split.tp_communication(1))  # no all-gather on arrival


def test_summary_lists_what_runs_split_and_the_gathers(shared):
    text = _shared_sp(shared, 2).summary()
    assert "Sequence parallelism" in text and "layer_norm" in text and "reduce_scatter_to_sp" in text
    # GPT-2 with 2 sequences of 6 tokens at tp=4: 6 does not split 4 ways, so the 12 flattened
    # tokens are split in 4 blocks of 3 and viewing them back as (2, 6, C) needs the gather
    model, vocab = make("hf-gpt2")
    data = token_batches(vocab, steps=1, rows=2, seed=5, seq=6)
    tp4 = parallelize_on(model, data, 2, tp=4, dp=1, sequence_parallel=True)
    assert len(tp4.sequence.gathers) == 4 and all("transformer.h." in g.module for g in tp4.sequence.gathers)
    assert "view splits the sharded dim unevenly" in " ".join(tp4.summary().split())


def test_bad_input_is_refused_before_any_work():
    with pytest.raises(ValueError, match=r"sequence_parallel=True .* tp=1 .* Fix: tp >= 2"):
        _compile_sp(1)
    model, vocab = make("nanogpt")
    x = torch.randint(0, vocab, (1, 15))
    with pytest.raises(autopar.api.SequenceParallelError, match=r"token dim 1 of size 15 .* Fix: .*multiple of 2"):
        autopar.parallelize(model, tp=2, example_inputs=(x,), example_targets=(x,), sequence_parallel=True)
    auto = autopar.parallelize(model, tp=2, example_inputs=(x,), example_targets=(x,), sequence_parallel=None)
    assert auto.sequence is None and "Sequence parallelism: off (tp=2 does not divide" in auto.summary()
    y = torch.randint(0, vocab, (1, 16))
    assert autopar.parallelize(model, tp=2, example_inputs=(y,), example_targets=(y,),
                               sequence_parallel=None).sequence is not None
