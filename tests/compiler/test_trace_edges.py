"""Tracing's edges: custom autograd Functions and values whose shape depends on tensor values.

- torch.export keeps a ``torch.autograd.Function``'s forward ops and drops its
  backward. A Function whose backward is its forward's gradient (a GELU
  written out by hand) stays its ops, which the sharding rules split; any
  other (a straight-through estimator, PhiMoE's router) becomes one op whose
  backward is the Function's own. Both train at tp=2 x pp=2 with one device's
  loss and gradients; the ``x + (f(x) - x).detach()`` rewrite does too. A
  Function that cannot be one op (tensors inside a list; a forward reading a
  parameter it is not passed, as reentrant checkpointing) is refused, naming
  the class, where it is defined, the line that called it and the fix.
- ``torch.nonzero``, ``x[mask]``, routing by a computed index with
  ``index_add``, ``torch.unique`` and ``.item()`` read by a tensor are refused
  right after tracing with the op, the model's line and what to write instead
  (JetMoE's ``.tolist()`` too); an ``.item()`` read only by an assertion (XLM)
  is dropped with it, and XLM trains at tp=2 x pp=2.

PYTEST_DONT_REWRITE: export turns a model's plain ``assert`` on a tensor value into a runtime
assertion, which pytest's rewritten asserts are not; every assert here carries its own message.
"""

from __future__ import annotations

import inspect
import linecache
import re

import pytest
import torch
import torch.nn as nn
from families import SEQ, train_steps
from helpers import assert_ranks_match, parallelize_on, reference_run, spawn_ranks, token_batches

import autopar
from autopar.compiler.trace import lm_cross_entropy, trace
from autopar.reference.models import GPT, MLP, ModelConfig

VOCAB, ROWS, M, LR = 96, 8, 2, 1e-3


# ---------------------------------------------------------------- custom autograd Functions


class RoundSTE(torch.autograd.Function):
    """A straight-through estimator: forward rounds, backward passes the gradient through."""

    @staticmethod
    def forward(ctx, x):
        return x.round()

    @staticmethod
    def backward(ctx, grad):
        return grad


class ScaledSignSTE(torch.autograd.Function):
    """The same kind, in the form with ``setup_context`` and a non-tensor argument."""

    @staticmethod
    def forward(x, scale):
        return torch.sign(x) * scale

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.scale = inputs[1]

    @staticmethod
    def backward(ctx, grad):
        return grad * ctx.scale, None


class TanhGelu(torch.autograd.Function):
    """GELU (tanh approximation) with its derivative written out: the backward is the forward's gradient."""

    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return x * 0.5 * (1.0 + torch.tanh(0.79788456 * x * (1 + 0.044715 * x * x)))

    @staticmethod
    def backward(ctx, grad):
        (x,) = ctx.saved_tensors
        t = torch.tanh(0.79788456 * x * (1 + 0.044715 * x * x))
        return grad * (0.5 * x * ((1 - t * t) * (0.79788456 + 0.1070322243 * x * x)) + 0.5 * (1 + t))


class PairSTE(torch.autograd.Function):
    """A straight-through estimator over a list of tensors: no op can take it."""

    @staticmethod
    def forward(ctx, pair):
        return (pair[0] + pair[1]).round()

    @staticmethod
    def backward(ctx, grad):
        return [grad, grad]


ACTIVATIONS = {
    "function-ste": lambda h: RoundSTE.apply(4 * h),
    "detach-ste": lambda h: 4 * h + ((4 * h).round() - 4 * h).detach(),
    "plain-round": lambda h: (4 * h).round(),
    "function-gelu": lambda h: TanhGelu.apply(h),
    "pair-ste": lambda h: PairSTE.apply([h, h]),
}
"""The MLP's activation by name (the models are built in every rank). ``4 * h``: weights drawn from
N(0, 0.02) give activations that round to more than one value."""


class ActivationMLP(MLP):
    def __init__(self, cfg: ModelConfig, activation: str):
        super().__init__(cfg)
        self.activation = activation

    def extra_repr(self) -> str:  # the activation in the repr: the models differ only by it, not by a weight
        return f"activation={self.activation!r}"

    def forward(self, x):
        return self.proj(ACTIVATIONS[self.activation](self.fc(x)))


def _gpt_with_activation(activation: str) -> nn.Module:
    """A 2-layer GPT whose MLPs use ``activation``; the same weights for every activation."""
    torch.manual_seed(0)
    cfg = ModelConfig(vocab_size=VOCAB, seq_len=SEQ, n_layer=2, n_head=4, d_model=32)
    model = GPT(cfg)
    for block in model.h:
        mlp = ActivationMLP(cfg, activation)
        mlp.load_state_dict(block.mlp.state_dict())
        block.mlp = mlp
    return model


def _trace_batches():
    return token_batches(VOCAB, steps=2, rows=ROWS, seed=1)


def _trace_ids():
    return _trace_batches()[0][0][0][:2]


def _line_of(obj, text: str) -> int:
    """The line of ``obj``'s source that contains ``text``."""
    lines, first = inspect.getsourcelines(obj)
    return first + next(i for i, line in enumerate(lines) if text in line)


def _compile_tp2_pp2_traced(model: nn.Module, **config):
    inputs, targets = _trace_batches()[0]
    return autopar.parallelize(model, example_inputs=tuple(x[: ROWS // M] for x in inputs),
                               example_targets=tuple(y[: ROWS // M] for y in targets), tp=2, pp=2,
                               microbatches=M, **config)


def _targets(traced) -> list[str]:
    return [str(n.target) for n in traced.gm.graph.nodes if n.op == "call_function"]


def _function_keys(traced) -> list[str]:
    """The Functions kept as one op, by their key (``module.Class#n``)."""
    return [n.args[1] for n in traced.gm.graph.nodes if n.op == "call_function"
            and n.target is torch.ops.autopar.function.default]


def test_plain_autograd_of_a_straight_through_forward_is_not_its_gradient():
    """Why a Function's backward must be kept: the inlined forward's gradient is another one."""
    ste, plain = (reference_run(_gpt_with_activation(a), _trace_batches()[:1])[1][0]
                  for a in ("function-ste", "plain-round"))
    name = "h.0.mlp.fc.weight"
    gap = float((ste[name] - plain[name]).norm() / ste[name].norm())
    assert gap == 1.0, gap  # round's autograd gradient is zero: all of the Function's gradient is lost


def test_a_function_with_a_gradient_of_its_own_is_one_op_and_one_computing_its_forwards_stays_ops():
    ste = trace(_gpt_with_activation("function-ste"), (_trace_ids(),), (_trace_ids(),), lm_cross_entropy)
    keys = _function_keys(ste)
    assert len(keys) == 2 and all(k.startswith(f"{__name__}.RoundSTE#") for k in keys), keys  # one per layer
    assert "aten.round.default" not in _targets(ste), _targets(ste)
    gelu = trace(_gpt_with_activation("function-gelu"), (_trace_ids(),), (_trace_ids(),), lm_cross_entropy)
    assert _function_keys(gelu) == [] and "aten.tanh.default" in _targets(gelu), _targets(gelu)


def test_a_function_called_from_the_loss_with_setup_context_is_one_op():
    """Functions are seen wherever they are called, not only in the model's modules."""

    def loss_fn(logits, targets):
        return lm_cross_entropy(ScaledSignSTE.apply(logits, 0.5), targets)

    traced = trace(_gpt_with_activation("detach-ste"), (_trace_ids(),), (_trace_ids(),), loss_fn)
    keys = _function_keys(traced)
    assert len(keys) == 1 and keys[0].startswith(f"{__name__}.ScaledSignSTE#"), keys
    assert "aten.sign.default" not in _targets(traced), _targets(traced)


def test_a_function_that_cannot_be_one_op_is_refused_by_name():
    with pytest.raises(autopar.TraceError) as err:
        _compile_tp2_pp2_traced(_gpt_with_activation("pair-ste"))
    msg = str(err.value)
    # the class, where it is defined, the line that called it, why, the fix
    assert msg.startswith(f"cannot trace the custom torch.autograd.Function {__name__}.PairSTE "
                          f"(defined at {__file__}:{inspect.getsourcelines(PairSTE)[1]})"), msg
    assert f"\n  at {__file__}:{_file_line('lambda h: PairSTE.apply([h, h])')}: " in msg, msg
    assert "an argument is a list of tensors" in msg, msg
    assert "x + (f(x) - x).detach()" in msg, msg


class ReentrantCheckpointMLP(MLP):
    def forward(self, x):
        return torch.utils.checkpoint.checkpoint(super().forward, x, use_reentrant=True)


def test_a_function_reading_a_parameter_it_is_not_given_is_refused():
    """Reentrant checkpointing: a Function whose forward reads the block's weights from its closure."""
    model = _gpt_with_activation("detach-ste")
    for block in model.h:
        block.mlp.__class__ = ReentrantCheckpointMLP
    with pytest.raises(autopar.TraceError) as err:
        trace(model, (_trace_ids(),), (_trace_ids(),), lm_cross_entropy)
    msg = str(err.value)
    assert msg.startswith("cannot trace the custom torch.autograd.Function "
                          "torch.utils.checkpoint.CheckpointFunction"), msg
    assert f"at {__file__}:{_line_of(ReentrantCheckpointMLP, 'use_reentrant=True')}: " in msg, msg
    assert "its forward reads a parameter of shape (128, 32) that is not one of its arguments" in msg, msg
    assert "use_reentrant=False or autopar's recompute=" in msg, msg


def _file_line(text: str) -> int:
    """The line of this file that contains ``text`` (written once in it, and here)."""
    with open(__file__) as f:
        hits = [i + 1 for i, line in enumerate(f) if text in line]
    assert len(hits) == 2, (text, hits)
    return hits[0]


PARITY = {"function-gelu": {}, "function-ste": {}, "function-ste-zb-recompute": dict(schedule="zb-h1",
                                                                                     recompute="layer"),
          "detach-ste": {}, "xlm": {}, "phimoe": {}}
"""The models trained at tp=2 x pp=2 and their configuration beyond it."""


def _parity_model(name: str) -> nn.Module:
    if name in ("xlm", "phimoe"):
        return _xlm() if name == "xlm" else _hf_traced(name)
    return _gpt_with_activation(name.removesuffix("-zb-recompute"))


def _parity_program(name: str):
    return parallelize_on(_parity_model(name), _trace_batches(), ROWS // M, tp=2, pp=2, microbatches=M, world_size=4,
                          **PARITY[name])


def _parity_worker():
    out = {}
    for name in PARITY:
        program = _parity_program(name)  # inherited from the test process
        out[name] = (*train_steps(program.materialize(), _trace_batches(), LR), program.fallbacks(),
                     sorted(r.module for r in program.plan.rejected))
    return out


@pytest.mark.multiprocess
def test_functions_xlm_and_phimoe_train_with_one_devices_gradients_at_tp2_pp2():
    """On 4 gloo ranks (tp=2 x pp=2, 2 microbatches, 2 AdamW steps), against one device:
    - the hand-written GELU Function, traced as its ops, every linear split;
    - the straight-through estimator Function, one op with its own backward (its MLP's linears
      whole: the op has no sharding rule), also under ZB-H1's split backward with each layer
      recomputed, and its ``.detach()`` rewrite, against one device running the Function;
    - XLM, whose only ``.item()`` feeds an assertion (its q and k projections stay whole: the
      attention mask's ``expand_as`` has no sharding rule);
    - PhiMoE, its router's Function one op (the routers whole); ``router_jitter_noise=0`` makes its
      sampled routing deterministic, so one device draws the same experts.
    Tolerances: ``assert_ranks_match`` (fp32, the parallel run reorders sums only)."""
    for name in PARITY:  # compile once here: the ranks inherit the programs
        _parity_program(name)
    results = spawn_ranks(_parity_worker, 4)
    references = {name: _parity_model("function-ste" if name == "detach-ste" else name) for name in PARITY}
    for name, model in references.items():
        assert_ranks_match(reference_run(model, _trace_batches(), lr=LR), [res[name][:2] for res in results], name)
    mlps = [f"h.{i}.mlp.{p}" for i in range(2) for p in ("fc", "proj")]
    for res in results:
        assert all(res[name][2] == [] for name in references), {n: res[n][2] for n in references}
        assert res["function-gelu"][3] == res["detach-ste"][3] == [], (res["function-gelu"][3], res["detach-ste"][3])
        assert res["function-ste"][3] == res["function-ste-zb-recompute"][3] == mlps, res["function-ste"][3]
        assert res["phimoe"][3] == [f"model.layers.{i}.mlp.router" for i in range(2)], res["phimoe"][3]


# ---------------------------------------------------------------- data-dependent shapes


class _Base(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.emb = nn.Embedding(VOCAB, 32)
        self.fc = nn.Linear(32, 32)
        self.head = nn.Linear(32, VOCAB)


class Nonzero(_Base):
    def forward(self, ids):
        h = self.fc(self.emb(ids))
        picked = torch.nonzero(h[..., 0] > 0)
        return self.head(h + picked.sum())


class BooleanMask(_Base):
    def forward(self, ids):
        h = self.fc(self.emb(ids))
        positive = h[h[..., 0] > 0]
        return self.head(h + positive.mean())


class IndexAddRouting(_Base):
    def forward(self, ids):
        h = self.fc(self.emb(ids)).flatten(0, 1)
        routed = torch.where(h[:, 0] > 0)[0]
        out = torch.zeros_like(h).index_add(0, routed, self.fc(h[routed]))
        return self.head(out.view(ids.shape[0], ids.shape[1], -1))


class Unique(_Base):
    def forward(self, ids):
        h = self.fc(self.emb(ids))
        seen = torch.unique(ids)
        return self.head(h) + seen.float().mean()


class ItemAsValue(_Base):
    def forward(self, ids):
        h = self.fc(self.emb(ids))
        scale = ids.float().mean().item()
        return self.head(h * scale)


@pytest.mark.parametrize("cls, op, text", [
    (Nonzero, "aten.nonzero", "picked = torch.nonzero(h[..., 0] > 0)"),
    (BooleanMask, "aten.index.Tensor (indexing x[...] with a boolean mask", "positive = h[h[..., 0] > 0]"),
    (IndexAddRouting, "aten.where", "routed = torch.where(h[:, 0] > 0)[0]"),
    (Unique, "aten._unique2", "seen = torch.unique(ids)"),
    (ItemAsValue, "aten.item", "scale = ids.float().mean().item()"),
], ids=lambda v: v.__name__ if isinstance(v, type) else None)
def test_data_dependent_shapes_are_refused_with_the_op_and_the_line(cls, op, text):
    with pytest.raises(autopar.TraceError) as err:
        _compile_tp2_pp2_traced(cls())
    msg = str(err.value)
    assert msg.startswith(f"cannot trace {cls.__name__}: {op}"), msg
    assert "whose size depends on tensor values" in msg, msg
    assert f"at test_trace_edges.py:{_line_of(cls.forward, text)} {text}" in msg, msg
    assert "try: " in msg, msg


def test_a_value_read_only_by_an_assertion_is_dropped_with_it():
    class Checked(_Base):
        def forward(self, ids):
            lengths = (ids != 1).sum(dim=1).long()  # as XLM checks its lengths
            assert lengths.max().item() <= ids.shape[1]
            return self.head(self.fc(self.emb(ids)))

    ids = _trace_batches()[0][0][0][:2]
    traced = trace(Checked(), (ids,), (ids,), lm_cross_entropy)
    targets = {str(n.target) for n in traced.gm.graph.nodes if n.op == "call_function"}
    assert not any("item" in t or "assert_scalar" in t or t == "aten.max.default" for t in targets), targets


# ---------------------------------------------------------------- HuggingFace families


def _hf_traced(name: str) -> nn.Module:
    import transformers as T

    torch.manual_seed(0)
    common = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64, bos_token_id=0,
                  eos_token_id=0)
    if name == "phimoe":
        return T.PhimoeForCausalLM(T.PhimoeConfig(num_local_experts=4, num_experts_per_tok=2, pad_token_id=None,
                                                  router_jitter_noise=0.0, **common))
    return T.JetMoeForCausalLM(T.JetMoeConfig(kv_channels=16, num_local_experts=4, num_experts_per_tok=2,
                                              **{k: v for k, v in common.items() if k != "num_attention_heads"}))


def _xlm() -> nn.Module:
    import transformers as T

    torch.manual_seed(0)
    return T.XLMWithLMHeadModel(T.XLMConfig(vocab_size=VOCAB, emb_dim=64, n_layers=2, n_heads=4,
                                            max_position_embeddings=64, dropout=0.0, attention_dropout=0.0,
                                            bos_index=0, eos_index=0, pad_index=1))


def test_jetmoe_routing_is_refused_with_the_op_and_the_line():
    from transformers.models.jetmoe import modeling_jetmoe

    with pytest.raises(autopar.TraceError) as err:
        _compile_tp2_pp2_traced(_hf_traced("jetmoe"))
    msg = str(err.value)
    assert msg.startswith("cannot trace JetMoeForCausalLM: aten.item"), msg
    found = re.search(r"\n  at modeling_jetmoe\.py:(\d+) (.*?) \(in (\S+)\)\n", msg)
    assert found, msg
    line, code, path = found.groups()
    assert linecache.getline(modeling_jetmoe.__file__, int(line)).strip() == code, (line, code)
    assert path.startswith("model.layers.0."), path
