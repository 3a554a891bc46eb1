"""Context parallelism (cp) against one device: every layer on 1/cp of each sequence's tokens.

Models, tiny (hidden 32, 4 heads, 16 tokens, 4 sequences a step): the
reference GPT (learned positions, causal ``scaled_dot_product_attention``),
HF Llama (grouped-query attention, rotary positions, the causal mask it builds
itself) and HF BERT (attention over every token: the contiguous layout).

Layouts: cp=2 and cp=4; cp2 x tp2 with sequence parallelism; cp2 x pp2 with
1F1B, interleaved (2 virtual stages) and zero-bubble (zb-h1); cp2 x dp2 with the distributed optimizer
and gradient clipping; recompute='layer'; bf16. Each layout's loss and every
gradient over 3 AdamW steps match the single-device run on whole sequences
(``assert_ranks_match``: fp32, the first step element-wise rtol 1e-5 / atol
1e-6, later steps per tensor; bf16 the first step, losses rtol 2e-2,
gradients within 5e-2 relative norm + 1e-3, as the other bf16 parity tests).

Memory, from the runtime's own count (``peak_activation_bytes``, the bytes
autograd keeps between a microbatch's forward and backward): the reference GPT
at cp=4 keeps about a quarter of what it keeps at cp=1 on the same sequences.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import transformers as T
from families import train_steps
from helpers import (assert_ranks_match, layout_chunks, layout_world, parallelize_on, spawn_ranks,
                     token_batches)

from autopar.reference.models import build
from autopar.reference.parity import assert_parity

pytestmark = pytest.mark.multiprocess
VOCAB, ROWS, SEQ, LR, STEPS = 64, 4, 16, 1e-3, 3


def _model(name: str, layers: int = 2):
    """The model ``name``, seeded: the same weights in every process."""
    torch.manual_seed(0)
    hf = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=layers,
              num_attention_heads=4, max_position_embeddings=64)
    if name == "gpt":
        return build("gpt", vocab_size=VOCAB, seq_len=SEQ, n_layer=layers, n_head=4, d_model=32)
    if name == "llama":
        return T.LlamaForCausalLM(T.LlamaConfig(num_key_value_heads=2, **hf))
    return T.BertForMaskedLM(T.BertConfig(hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, **hf))


def _data():
    return token_batches(VOCAB, STEPS, ROWS, seed=1, seq=SEQ)


# label -> (model, layers, layout)
CASES = {
    # 2 ranks
    "gpt cp2": ("gpt", 2, dict(cp=2)),
    "llama cp2": ("llama", 2, dict(cp=2)),
    "bert cp2": ("bert", 2, dict(cp=2)),
    "gpt cp2 recompute": ("gpt", 2, dict(cp=2, recompute="layer")),
    "llama cp2 bf16": ("llama", 2, dict(cp=2, precision="bf16")),
    # 4 ranks
    "gpt cp4": ("gpt", 2, dict(cp=4)),
    "llama cp4": ("llama", 2, dict(cp=4)),
    "llama cp2 tp2 sp": ("llama", 2, dict(cp=2, tp=2, sequence_parallel=True)),
    "gpt cp2 pp2": ("gpt", 4, dict(cp=2, pp=2, microbatches=2)),
    "gpt cp2 pp2 interleaved": ("gpt", 4, dict(cp=2, pp=2, virtual_stages=2, microbatches=2)),
    "llama cp2 pp2 zb-h1": ("llama", 2, dict(cp=2, pp=2, microbatches=2, schedule="zb-h1")),
    "bert cp2 dp2": ("bert", 2, dict(cp=2, dp=2)),
}
DISTRIBUTED = {"bert cp2 dp2"}
"""Cases trained with the distributed optimizer (its state sharded over dp x cp), clipped to CLIP."""
CLIP = 0.05


def _program(label: str):
    name, layers, layout = CASES[label]
    return parallelize_on(_model(name, layers), _data(), ROWS // layout_chunks(layout), world_size=layout_world(layout),
                          **layout)


def _distributed_steps(engine, data):
    """AdamW from the distributed optimizer, clipped: each step's loss and full gradients."""
    opt = engine.distributed_optimizer(torch.optim.AdamW, lr=LR)
    losses, grads = [], []
    for inputs, targets in data:
        losses.append(engine.train_step(*inputs, *targets))
        engine.clip_grad_norm_(CLIP)
        grads.append(engine.full_grads())
        opt.step()
        opt.zero_grad()
    return losses, grads


SAVED = "llama cp2"
"""The case whose trained weights are saved (``engine.save``) and loaded again at cp=1 and cp=4."""


def _train(labels: list[str], root: str) -> dict:
    """In each rank: every case of this world size trained, and its evaluation of the first batch; the
    SAVED case's weights saved under ``root`` after training, with the whole state rank 0 held."""
    out = {}
    for label in labels:
        engine = _program(label).materialize()
        (x,), (y,) = _data()[0]
        evaluated = engine.eval_step(x, y, outputs=True)
        steps = _distributed_steps(engine, _data()) if label in DISTRIBUTED else train_steps(engine, _data(), LR)
        out[label] = (steps, dist.get_rank(), evaluated)
        if label == SAVED:
            engine.save(f"{root}/saved", step=STEPS).wait()
            out["saved"] = engine.full_state_dict() if dist.get_rank() == 0 else None
    return out


def _load_at_cp4(root: str) -> dict:
    """In a rank of the 4-rank spawn: the SAVED checkpoint loaded at cp=4, its whole state and the
    evaluation of the first batch."""
    engine = _loading_program(4).materialize()
    engine.load(f"{root}/saved")
    (x,), (y,) = _data()[0]
    return {"state": engine.full_state_dict() if dist.get_rank() == 0 else None, "eval": engine.eval_step(x, y)}


def _loading_program(cp: int):
    name, layers, _ = CASES[SAVED]
    return parallelize_on(_model(name, layers), _data(), ROWS, cp=cp, world_size=cp)


def _kept_data():
    return token_batches(VOCAB, 1, 2, seed=1, seq=64)


def _kept_bytes(cp: int) -> int:
    engine = _kept_program(cp).materialize()
    (x,), (y,) = _kept_data()[0]
    engine.train_step(x, y)
    return engine.stats["peak_activation_bytes"]


def _kept_program(cp: int):
    """The reference GPT, 4 layers, 64 tokens a sequence, at cp: what a rank keeps for the backward."""
    torch.manual_seed(0)
    model = build("gpt", vocab_size=VOCAB, seq_len=64, n_layer=4, n_head=4, d_model=32)
    return parallelize_on(model, _kept_data(), 2, cp=cp, world_size=cp)


def _four_ranks(labels: list[str], root: str) -> dict:
    return {**_train(labels, root), "kept": _kept_bytes(4), "cp4": _load_at_cp4(root)}


_EXTRA = ("kept", "saved", "cp4")
"""What the spawns return beside the cases."""


@pytest.fixture(scope="module")
def cp_runs(tmp_path_factory):
    """label -> each rank's (steps, rank, evaluated); the kept bytes at cp=4; the SAVED case's state
    and its checkpoint loaded at cp=4. Every program is compiled here first (the ranks inherit it)."""
    root = str(tmp_path_factory.mktemp("cp"))
    for label in CASES:
        _program(label)
    _kept_program(4)
    _loading_program(4)
    two = [label for label, (_, _, layout) in CASES.items() if layout_world(layout) == 2]
    four = [label for label, (_, _, layout) in CASES.items() if layout_world(layout) == 4]
    runs = {"root": root}
    for res in (spawn_ranks(_train, 2, two, root), spawn_ranks(_four_ranks, 4, four, root)):
        runs.update({label: [r[label] for r in res] for label in res[0] if label not in _EXTRA})
        runs.update({key: res[0][key] for key in _EXTRA if key in res[0]})
    return runs


_REFERENCES: dict = {}


def _reference(label: str):
    """One device on whole sequences: each step's global batch cut into the layout's dp x microbatches
    chunks, each chunk's token-mean loss weighted by its share of the targets (all equal here), then
    AdamW (the distributed cases clipped)."""
    name, layers, layout = CASES[label]
    clip = CLIP if label in DISTRIBUTED else None
    key = (name, layers, layout.get("precision", "fp32"), clip)
    if key not in _REFERENCES:
        model = _model(name, layers)
        opt = torch.optim.AdamW(model.parameters(), lr=LR)
        bf16 = layout.get("precision") == "bf16"
        losses, grads = [], []
        for (x,), (y,) in _data():
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
                logits = model(x).logits if name != "gpt" else model(x)
                loss = torch.nn.functional.cross_entropy(logits.flatten(0, -2).float(), y.flatten())
            loss.backward()
            if clip is not None:
                norm = torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
                assert norm > 2 * clip  # the clip acts
            losses.append(float(loss.detach()))
            grads.append({n: p.grad.clone() if p.grad is not None else torch.zeros_like(p)
                          for n, p in model.named_parameters(remove_duplicate=False)})
            opt.step()
            opt.zero_grad()
        _REFERENCES[key] = (losses, grads)
    return _REFERENCES[key]


def test_every_layout_matches_one_device(cp_runs):
    for label in CASES:
        reference = _reference(label)
        per_rank = cp_runs[label]
        if CASES[label][2].get("precision") == "bf16":  # bf16 keeps 8 mantissa bits: the first step
            for (losses, grads), rank, _ in per_rank:
                assert_parity(reference[0][:1], reference[1][0], losses[:1], grads[0], rtol=2e-2, atol=1e-3,
                              rel_norm=5e-2, label=f"{label} rank {rank}")
        else:
            assert_ranks_match(reference, [steps for steps, *_ in per_rank], label)


def test_eval_step_gathers_the_logits_in_token_order(cp_runs):
    """``eval_step`` before training: the loss of the whole sequences, and the logits every rank holds
    in the global token order (the load-balanced layout put back)."""
    for label in CASES:
        per_rank = cp_runs[label]
        name, layers, layout = CASES[label]
        model = _model(name, layers).eval()
        (x,), (y,) = _data()[0]
        bf16 = layout.get("precision") == "bf16"
        with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            logits = model(x).logits if name != "gpt" else model(x)
            loss = torch.nn.functional.cross_entropy(logits.flatten(0, -2).float(), y.flatten())
        tol = dict(rtol=2e-2, atol=2e-2) if bf16 else dict(rtol=1e-5, atol=1e-5)
        for _, rank, (got, got_logits) in per_rank:
            torch.testing.assert_close(got, float(loss), **tol, msg=lambda m: f"{label} rank {rank}: {m}")
            torch.testing.assert_close(got_logits.float(), logits.float(), **tol,
                                       msg=lambda m: f"{label} rank {rank} logits: {m}")


def test_activations_kept_per_rank_fall_by_cp(cp_runs):
    """The bytes autograd keeps for one microbatch at cp=4 are about a quarter of cp=1's (the same
    sequences): every activation is per token; what is not (a whole position table before it is cut
    to the rank's positions) is small."""
    alone = _kept_bytes(1)
    ratio = cp_runs["kept"] / alone
    assert 0.22 < ratio < 0.30, (cp_runs["kept"], alone, ratio)
    print(f"kept per rank: cp=1 {alone} B, cp=4 {cp_runs['kept']} B, ratio {ratio:.3f}")


def test_a_checkpoint_loads_at_another_cp(cp_runs):
    """The weights saved at cp=2 after training load bit for bit at cp=1 (this process) and at cp=4
    (4 ranks), and evaluate alike: the state does not depend on how the sequence was split."""
    saved = cp_runs["saved"]
    engine = _loading_program(1).materialize()
    engine.load(f"{cp_runs['root']}/saved")
    here = engine.full_state_dict()
    assert set(here) == set(saved) == set(cp_runs["cp4"]["state"])
    for name, value in saved.items():
        assert torch.equal(here[name], value), name
        assert torch.equal(cp_runs["cp4"]["state"][name], value), name
    (x,), (y,) = _data()[0]
    torch.testing.assert_close(cp_runs["cp4"]["eval"], engine.eval_step(x, y), rtol=1e-5, atol=1e-6)
