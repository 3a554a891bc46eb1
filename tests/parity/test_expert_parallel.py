"""Expert parallelism (ep) against one device: four mixture-of-experts models over every layout.

Models, tiny (hidden 32, 4 experts, top-2, 8 sequences of 8 tokens a step):
the reference ``MoEGPT`` (``autopar/reference/models.py``: a shared expert, the
load-balancing and z auxiliary losses in the training loss; one of them with
a dense first layer and the top-k probabilities not renormalised) and three
HuggingFace families unmodified: Mixtral, Qwen2-MoE (a gated shared expert)
and OLMoE.

Layouts (the 4 models spread over them, each at least twice, each dispatcher
several times): ep=2 (dp2), ep=4 (dp4), ep2 x dp4 (two replicas hold each
expert), ep2 x tp2 with sequence parallelism, ep2 x pp2 interleaved
(virtual_stages=2) and zero-bubble (zb-h1), recompute='layer', bf16; and
whole experts under tensor parallelism (``expert_tp=1``: the tp ranks share
the token rows, the expert groups run over tp x dp): ep2 = tp2 with no data
parallelism, ep4 over tp2 x dp2 with sequence parallelism, and ep2 inside
tp4 (two ranks hold each expert, each with half the replica's rows).
Each layout's loss and every gradient over 3 AdamW steps match the
single-device run (``assert_ranks_match``: fp32, the first step element-wise
rtol 1e-5 / atol 1e-6, later steps per tensor; bf16 as test_training_features:
the first step, losses rtol 2e-2, gradients within 5e-2 relative norm + 1e-3).

The reference model's auxiliary losses are per microbatch (as Switch,
Mixtral and Megatron compute them: over the tokens of one forward), so its
single-device run is the same global batch cut into the dp x microbatches
chunks the engine makes, each chunk's loss divided by their number and
backpropagated, one optimizer step per batch (``_chunked_reference``): for the
cross-entropy alone (the HF models) that is the plain one-device run.

Structure, as numbers: ``program.experts`` finds one layer per MoE block with
E=4 and k=2 and no refusal; each rank holds E/ep experts of each stacked
weight (the engine's local tensors, ``program.local_shape``), exactly the
experts ``program.expert_range`` names (their values, from the model's own).
And the auxiliary loss alone (the reference model with cross-entropy weight 0)
is exact under ep with both dispatchers.
"""

import pytest
import torch
import torch.distributed as dist
from families import train_steps
from helpers import (assert_ranks_match, chunked_one_device_steps, layout_chunks, layout_world, parallelize_on,
                     spawn_ranks, token_batches)

from autopar.core.grouped_mm import grouped_mm
from autopar.reference.models import MoE, MoEConfig, build, moe_outputs
from autopar.reference.parity import assert_parity

pytestmark = pytest.mark.multiprocess
VOCAB, ROWS, SEQ, LR, STEPS, E, K = 64, 8, 8, 1e-3, 3, 4, 2


def _model(name: str, layers: int = 2):
    """The model ``name``, seeded: the same weights in every process."""
    import transformers as T

    torch.manual_seed(0)
    ref = dict(vocab_size=VOCAB, seq_len=SEQ, n_layer=layers, n_head=4, d_model=32, n_experts=E, top_k=K, d_expert=24)
    hf = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=layers, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=64, bos_token_id=0, eos_token_id=0, pad_token_id=None)
    if name == "moe-gpt":  # shared expert, both auxiliary losses
        return build("gpt-moe", d_shared=16, aux_loss_coef=0.1, z_loss_coef=0.01, **ref)
    if name == "moe-gpt-dense":  # DeepSeek-style: a dense first layer, top-k probabilities as the softmax gave
        return build("gpt-moe", d_shared=16, n_dense=1, norm_topk=False, aux_loss_coef=0.1, z_loss_coef=0.01, **ref)
    if name == "moe-gpt-aux":  # the auxiliary losses alone
        return build("gpt-moe", aux_loss_coef=1.0, z_loss_coef=0.1, ce_weight=0.0, **ref)
    if name == "mixtral":
        return T.MixtralForCausalLM(T.MixtralConfig(num_local_experts=E, num_experts_per_tok=K, **hf))
    if name == "qwen2-moe":
        return T.Qwen2MoeForCausalLM(T.Qwen2MoeConfig(num_experts=E, num_experts_per_tok=K, moe_intermediate_size=32,
                                                      shared_expert_intermediate_size=48, **hf))
    return T.OlmoeForCausalLM(T.OlmoeConfig(num_experts=E, num_experts_per_tok=K, **hf))


def _losses(name: str, model) -> dict:
    """The reference model trains on cross-entropy + its auxiliary losses; the HF models on cross-entropy."""
    return dict(loss_fn=model.loss, output_fn=moe_outputs) if name.startswith("moe-gpt") else {}


def _data():
    return token_batches(VOCAB, STEPS, ROWS, seed=1, seq=SEQ)


AG, A2A = "allgather", "alltoall"
# label -> (model, layers, layout)
CASES = {
    # 2 ranks
    "moe-gpt ep2": ("moe-gpt", 2, dict(dp=2, ep=2, expert_dispatch=AG)),
    "mixtral ep2": ("mixtral", 2, dict(dp=2, ep=2, expert_dispatch=A2A)),
    "olmoe ep2 bf16": ("olmoe", 2, dict(dp=2, ep=2, expert_dispatch=AG, precision="bf16")),
    "moe-gpt-aux ep2": ("moe-gpt-aux", 2, dict(dp=2, ep=2, expert_dispatch=AG)),
    "moe-gpt-aux ep2 a2a": ("moe-gpt-aux", 2, dict(dp=2, ep=2, expert_dispatch=A2A)),
    "moe-gpt ep2 recompute": ("moe-gpt", 2, dict(dp=2, ep=2, recompute="layer", expert_dispatch=A2A)),
    "moe-gpt ep2 tp2 whole": ("moe-gpt", 2, dict(tp=2, dp=1, ep=2, expert_tp=1, expert_dispatch=AG)),
    # 4 ranks
    "qwen2-moe ep4": ("qwen2-moe", 2, dict(dp=4, ep=4, expert_dispatch=A2A)),
    "olmoe ep2 dp4": ("olmoe", 2, dict(dp=4, ep=2, expert_dispatch=A2A)),
    "moe-gpt ep2 tp2 sp": ("moe-gpt", 2, dict(tp=2, dp=2, ep=2, sequence_parallel=True, expert_dispatch=AG)),
    "mixtral ep2 tp2 sp": ("mixtral", 2, dict(tp=2, dp=2, ep=2, sequence_parallel=True, expert_dispatch=A2A)),
    "mixtral ep4 tp2 whole sp": ("mixtral", 2, dict(tp=2, dp=2, ep=4, expert_tp=1, sequence_parallel=True,
                                                    expert_dispatch=A2A)),
    "moe-gpt ep2 tp4 whole": ("moe-gpt", 2, dict(tp=4, dp=1, ep=2, expert_tp=1, expert_dispatch=AG)),
    "moe-gpt-dense ep2 pp2 v2": ("moe-gpt-dense", 4, dict(pp=2, virtual_stages=2, dp=2, ep=2, microbatches=2,
                                                          expert_dispatch=AG)),
    "olmoe ep2 pp2 zb-h1": ("olmoe", 2, dict(pp=2, dp=2, ep=2, microbatches=2, schedule="zb-h1")),
    "qwen2-moe ep2 pp2 bf16": ("qwen2-moe", 2, dict(pp=2, dp=2, ep=2, microbatches=2, expert_dispatch=A2A,
                                                    precision="bf16")),
}


CLIP = {"olmoe ep2 dp4": 0.05, "moe-gpt ep2 tp2 sp": 0.05, "mixtral ep4 tp2 whole sp": 0.05, "moe-gpt ep2 tp4 whole": 0.05}
"""Cases whose gradients are clipped to this total norm every step (below the gradients' norm, so it
acts): the expert weights' part of the norm is summed over the expert group (with whole experts, whose
groups run over tp, counted once per tp group)."""


def _program(label: str):
    name, layers, layout = CASES[label]
    model = _model(name, layers)
    return parallelize_on(model, _data(), ROWS // layout_chunks(layout), world_size=layout_world(layout),
                          **_losses(name, model), **layout)


def _train(labels: list[str]) -> dict:
    """In each rank: every case of this world size trained; its losses and gradients, what the rank
    holds of each stacked expert weight (shape, expert range, largest difference from the model's own
    experts of that range before training), and an evaluation step on the first batch before training
    (the loss and the whole logits)."""
    out = {}
    for label in labels:
        program = _program(label)  # compiled in the test process before the spawn: inherited
        engine = program.materialize()
        mine = dict(engine.named_local_parameters())
        own = dict(_model(*CASES[label][:2]).named_parameters())
        ep_rank = engine.mesh.ep_rank
        held = {}
        for name in (n for n in program.expert_params if n in mine):  # this stage's
            first, count = program.expert_range(name, ep_rank)
            local, full = mine[name].detach(), own[name].detach()[first:first + count]
            diff = float((local - full).abs().max()) if local.shape == full.shape else None
            held[name] = (tuple(local.shape), tuple(program.local_shape(name)), first, count, diff)
        (x,), (y,) = _data()[0]
        evaluated = engine.eval_step(x, y, outputs=True)
        out[label] = (train_steps(engine, _data(), LR, clip=CLIP.get(label)), held, dist.get_rank(), evaluated)
    return out


_REFERENCES: dict[tuple, tuple[list[float], list[dict[str, torch.Tensor]]]] = {}


def _chunked_reference(label: str) -> tuple[list[float], list[dict[str, torch.Tensor]]]:
    """One device: each step's global batch cut into the dp x microbatches chunks of the layout (a
    replica's rows, then its microbatches), each chunk's loss / chunks backpropagated, then AdamW.
    Computed once per (model, chunks, precision)."""
    name, layers, layout = CASES[label]
    key = (name, layers, layout_chunks(layout), layout.get("precision", "fp32"), CLIP.get(label))
    if key not in _REFERENCES:
        _REFERENCES[key] = _train_one_device(name, layers, layout, CLIP.get(label))
    return _REFERENCES[key]


def _train_one_device(name: str, layers: int, layout: dict,
                      clip: float | None) -> tuple[list[float], list[dict[str, torch.Tensor]]]:
    model = _model(name, layers)
    loss_fn = _losses(name, model).get("loss_fn")
    return chunked_one_device_steps(
        model, _data(), layout_chunks(layout), LR, clip=clip, bf16=layout.get("precision") == "bf16",
        loss_of=loss_fn or (lambda out, y: torch.nn.functional.cross_entropy(out.logits.flatten(0, -2), y.flatten())))


@pytest.fixture(scope="module")
def ep_runs():
    """(label -> program, label -> each rank's result): every case trained, one spawn per world size,
    each program compiled here first (the ranks inherit it)."""
    programs = {label: _program(label) for label in CASES}
    runs = {}
    for world in sorted({layout_world(layout) for _, _, layout in CASES.values()}):
        labels = [label for label, (_, _, layout) in CASES.items() if layout_world(layout) == world]
        runs.update(_by_label(spawn_ranks(_train, world, labels)))
    return programs, runs


def _by_label(results: list[dict]) -> dict[str, list]:
    return {label: [res[label] for res in results] for label in results[0]}


def test_every_layout_matches_one_device(ep_runs):
    for label, per_rank in ep_runs[1].items():
        reference = _chunked_reference(label)
        if CASES[label][2].get("precision") == "bf16":  # bf16 keeps 8 mantissa bits: the first step
            for (losses, grads), _, rank, _ in per_rank:
                assert_parity(reference[0][:1], reference[1][0], losses[:1], grads[0], rtol=2e-2, atol=1e-3,
                              rel_norm=5e-2, label=f"{label} rank {rank}")
        else:
            assert_ranks_match(reference, [steps for steps, *_ in per_rank], label)


def test_auxiliary_loss_alone_is_exact_under_ep(ep_runs):
    """The load-balancing and z losses alone (cross-entropy weight 0): the router's gradient and all
    upstream of it match one device, the experts' gradients are zero, with both dispatchers."""
    for label in ("moe-gpt-aux ep2", "moe-gpt-aux ep2 a2a"):
        reference = _chunked_reference(label)
        first = reference[1][0]
        assert 0.9 < reference[0][0] < 2.5  # two layers' balance terms (each ~1: E * sum f P), no cross-entropy
        # the last layer's experts feed no router: no gradient; the first's feed the second's router
        assert float(first["h.1.mlp.w_down"].abs().max()) == 0 and float(first["h.0.mlp.w_down"].norm()) > 0
        assert float(first["h.0.mlp.router.weight"].norm()) > 1e-4 and float(first["ln_f.weight"].norm()) == 0
        assert_ranks_match(reference, [steps for steps, *_ in ep_runs[1][label]], label)


def test_eval_step_under_ep(ep_runs):
    """``eval_step`` before training: the loss of the initial model (cross-entropy + auxiliary losses for
    the reference model, per microbatch as it trains) and the whole logits (for the reference model, the
    logits inside the (logits, aux loss) its ``output_fn`` returns)."""
    for label, per_rank in ep_runs[1].items():
        name, layers, layout = CASES[label]
        model = _model(name, layers).eval()
        (x,), (y,) = _data()[0]
        chunks = layout_chunks(layout)
        rows = ROWS // chunks
        bf16 = layout.get("precision") == "bf16"
        loss_fn = _losses(name, model).get("loss_fn")
        with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            outs = [model(x[c * rows:(c + 1) * rows]) for c in range(chunks)]
            loss = sum(float(loss_fn(o, y[c * rows:(c + 1) * rows]) if loss_fn is not None else
                             torch.nn.functional.cross_entropy(o.logits.flatten(0, -2),
                                                               y[c * rows:(c + 1) * rows].flatten()))
                       for c, o in enumerate(outs)) / chunks
        tol = dict(rtol=2e-2, atol=1e-2) if bf16 else dict(rtol=1e-5, atol=1e-6)
        for *_, rank, evaluated in per_rank:  # the logits found inside the reference model's (logits, aux) too
            got, logits = evaluated
            torch.testing.assert_close(got, loss, **tol, msg=lambda m: f"{label} rank {rank}: {m}")
            want = torch.cat([o.logits for o in outs]).float()
            torch.testing.assert_close(logits.float(), want, **(dict(rtol=5e-2, atol=5e-2) if bf16 else tol),
                                       msg=lambda m: f"{label} rank {rank} logits: {m}")


def _moe_layers(name: str, layers: int) -> int:
    return layers - 1 if name == "moe-gpt-dense" else layers


def test_experts_found_and_held_e_over_ep_per_rank(ep_runs):
    programs, runs = ep_runs
    for label, (name, layers, layout) in CASES.items():
        program = programs[label]
        found = program.experts
        assert len(found) == _moe_layers(name, layers), (label, [x.module for x in found])
        assert [(x.experts, x.top_k, x.refusal) for x in found] == [(E, K, None)] * len(found), (label, found)
        ep = layout.get("ep", 1)
        assert program.ep == ep
        if ep == 1:
            assert program.expert_params == {} and all(held == {} for _, held, *_ in runs[label])
            continue
        # two stacked weights (gate-up and down) per MoE layer, each of E experts
        assert len(program.expert_params) == 2 * len(found), (label, program.expert_params)
        assert set(program.expert_params.values()) == {E}
        firsts = {}
        for _, held, rank, _ in runs[label]:
            stage_params = set(held)
            assert stage_params <= set(program.expert_params), (label, rank, stage_params)
            for pname, (shape, local_shape, first, count, diff) in held.items():
                assert count == E // ep and shape[0] == E // ep, (label, rank, pname, shape, first, count)
                assert shape == local_shape, (label, rank, pname, shape, local_shape)
                if layout.get("expert_tp") == 1:  # whole experts: every dim but the experts' as the model's
                    assert diff is not None, (label, rank, pname, shape)
                if diff is not None:  # not split by tp: the values are exactly the model's experts
                    assert diff == 0.0, (label, rank, pname, first, count, diff)
                firsts.setdefault(pname, set()).add(first)
        # the ep ranks of an expert group hold every block of experts between them
        assert all(f == {i * E // ep for i in range(ep)} for f in firsts.values()), (label, firsts)


# --------------------------------------------------------------------- the reference model's own parts


def test_grouped_mm_is_a_matmul_per_group_with_zeros_past_the_offsets():
    """``autopar::grouped_mm``: each group's rows times its expert, rows past offs[-1] zero in the output
    and in the input's gradient, an expert without rows gets a zero gradient; its gradient is the
    numerical one; bf16 under autocast like a matmul."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(9, 5, dtype=torch.float64, generator=g, requires_grad=True)
    w = torch.randn(3, 5, 4, dtype=torch.float64, generator=g, requires_grad=True)
    offs = torch.tensor([2, 2, 7], dtype=torch.int32)  # expert 1 has no rows; rows 7, 8 are padding
    y = grouped_mm(x, w, offs)
    want = torch.cat([x[:2] @ w[0], x[2:7] @ w[2], torch.zeros(2, 4, dtype=torch.float64)])
    torch.testing.assert_close(y, want, rtol=0, atol=0)
    y.backward(torch.ones_like(y))
    assert float(x.grad[7:].abs().max()) == 0 and float(w.grad[1].abs().max()) == 0
    torch.testing.assert_close(w.grad[2], x[2:7].detach().T @ torch.ones(5, 4, dtype=torch.float64))
    assert torch.autograd.gradcheck(lambda a, b: grouped_mm(a, b, offs), (x, w))
    torch.library.opcheck(torch.ops.autopar.grouped_mm.default, (x.detach().float(), w.detach().float(), offs))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert grouped_mm(x.detach().float(), w.detach().float(), offs).dtype == torch.bfloat16


def test_reference_moe_layer_is_the_token_by_token_mixture():
    """``MoE`` (sorted rows, grouped matmuls, weighted unsort) equals the mixture written token by token:
    sum over the top-k experts of p * SwiGLU_e(x), plus the shared expert; its auxiliary loss is
    aux_coef * E * sum_e f_e P_e + z_coef * mean logsumexp^2, both with and without renormalised top-k."""
    for norm in (True, False):
        torch.manual_seed(0)
        cfg = MoEConfig(d_model=8, n_experts=E, top_k=K, d_expert=6, d_shared=5, norm_topk=norm,
                        aux_loss_coef=0.3, z_loss_coef=0.2)
        moe = MoE(cfg)
        torch.nn.init.normal_(moe.w_gate_up, std=0.5)
        torch.nn.init.normal_(moe.w_down, std=0.5)
        x = torch.randn(2, 5, 8)
        y, aux = moe(x)
        tokens = x.reshape(-1, 8)
        logits = moe.router(tokens)
        probs = logits.softmax(-1)
        want, counts = [], torch.zeros(E)
        for t in range(tokens.shape[0]):
            p, ids = probs[t].topk(K)
            p = p / p.sum() if norm else p
            out = moe.shared(tokens[t])
            for pe, e in zip(p, ids.tolist()):
                gate, up = (tokens[t] @ moe.w_gate_up[e]).chunk(2)
                out = out + pe * ((torch.nn.functional.silu(gate) * up) @ moe.w_down[e])
                counts[e] += 1
            want.append(out)
        torch.testing.assert_close(y.reshape(-1, 8), torch.stack(want), rtol=1e-5, atol=1e-6)
        balance = E * (counts / (tokens.shape[0] * K) * probs.mean(0)).sum()
        z = torch.logsumexp(logits, -1).pow(2).mean()
        torch.testing.assert_close(aux, 0.3 * balance + 0.2 * z)
