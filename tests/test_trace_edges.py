"""Tracing's edges: custom autograd Functions and values whose shape depends on tensor values.

- torch.export keeps a ``torch.autograd.Function``'s forward ops and drops its
  backward. A Function whose backward is its forward's gradient (a GELU
  written out by hand) is kept as its ops and trains at tp=2 x pp=2 with one
  device's gradients; one whose backward is another (a straight-through
  estimator, PhiMoE's router) is refused, naming the class, where it is
  defined, the line that called it and the fix. The fix (``x + (f(x) -
  x).detach()``, or a custom op with its own autograd) trains with the
  gradients one device gets from the original Function.
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
from families import SEQ
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


@torch.library.custom_op("autopar_tests::round_ste", mutates_args=())
def round_ste(x: torch.Tensor) -> torch.Tensor:
    """The straight-through estimator as a custom op with its own autograd."""
    return x.round()


@round_ste.register_fake
def _(x: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(x)


round_ste.register_autograd(lambda ctx, grad: grad)

ACTIVATIONS = {
    "function-ste": lambda h: RoundSTE.apply(4 * h),
    "detach-ste": lambda h: 4 * h + ((4 * h).round() - 4 * h).detach(),
    "custom-op-ste": lambda h: round_ste(4 * h),
    "plain-round": lambda h: (4 * h).round(),
    "function-gelu": lambda h: TanhGelu.apply(h),
}
"""The MLP's activation by name (the models are built in every rank). ``4 * h``: weights drawn from
N(0, 0.02) give activations that round to more than one value."""


class ActivationMLP(MLP):
    def __init__(self, cfg: ModelConfig, activation: str):
        super().__init__(cfg)
        self.activation = activation

    def forward(self, x):
        return self.proj(ACTIVATIONS[self.activation](self.fc(x)))


def _gpt(activation: str) -> nn.Module:
    """A 2-layer GPT whose MLPs use ``activation``; the same weights for every activation."""
    torch.manual_seed(0)
    cfg = ModelConfig(vocab_size=VOCAB, seq_len=SEQ, n_layer=2, n_head=4, d_model=32)
    model = GPT(cfg)
    for block in model.h:
        mlp = ActivationMLP(cfg, activation)
        mlp.load_state_dict(block.mlp.state_dict())
        block.mlp = mlp
    return model


def _data():
    return token_batches(VOCAB, steps=2, rows=ROWS, seed=1)


def _line_of(obj, text: str) -> int:
    """The line of ``obj``'s source that contains ``text``."""
    lines, first = inspect.getsourcelines(obj)
    return first + next(i for i, line in enumerate(lines) if text in line)


def _compile(model: nn.Module, **config):
    inputs, targets = _data()[0]
    return autopar.parallelize(model, example_inputs=tuple(x[: ROWS // M] for x in inputs),
                               example_targets=tuple(y[: ROWS // M] for y in targets), tp=2, pp=2,
                               microbatches=M, **config)


def test_plain_autograd_of_a_straight_through_forward_is_not_its_gradient():
    """Why the refusal: the gradient the inlined forward would train with is another one."""
    ste, plain = (reference_run(_gpt(a), _data()[:1])[1][0] for a in ("function-ste", "plain-round"))
    name = "h.0.mlp.fc.weight"
    gap = float((ste[name] - plain[name]).norm() / ste[name].norm())
    assert gap == 1.0, gap  # round's autograd gradient is zero: all of the Function's gradient is lost


def test_a_function_whose_backward_is_not_its_forwards_gradient_is_refused():
    with pytest.raises(autopar.TraceError) as err:
        _compile(_gpt("function-ste"))
    msg = str(err.value)
    # the class, where it is defined, the line that called it, by how much the gradients differ, the fix
    assert f"torch.autograd.Function {__name__}.RoundSTE" in msg, msg
    assert f"(defined at {__file__}:{inspect.getsourcelines(RoundSTE)[1]})" in msg, msg
    assert f"at {__file__}:{_file_line('lambda h: RoundSTE.apply(4 * h)')}: " in msg, msg
    assert "differs from the gradient of its forward's ops by 100.0%" in msg, msg
    assert "x + (f(x) - x).detach()" in msg and "torch.library.custom_op" in msg, msg


def _file_line(text: str) -> int:
    """The line of this file that contains ``text`` (written once in it, and here)."""
    with open(__file__) as f:
        hits = [i + 1 for i, line in enumerate(f) if text in line]
    assert len(hits) == 2, (text, hits)
    return hits[0]


def test_a_function_called_from_the_loss_with_setup_context_is_refused():
    """Functions are seen wherever they are called, not only in the model's modules."""

    def loss_fn(logits, targets):
        return lm_cross_entropy(ScaledSignSTE.apply(logits, 0.5), targets)

    ids = _data()[0][0][0][:2]
    with pytest.raises(autopar.TraceError) as err:
        trace(_gpt("detach-ste"), (ids,), (ids,), loss_fn)
    msg = str(err.value)
    assert f"{__name__}.ScaledSignSTE (defined at {__file__}:{inspect.getsourcelines(ScaledSignSTE)[1]})" in msg
    assert f"{__file__}:{_line_of(loss_fn, 'ScaledSignSTE.apply')}: return lm_cross_entropy(ScaledSignSTE" in msg


def _functions_worker():
    out = {}
    for name, model in (("function-gelu", _gpt("function-gelu")), ("detach-ste", _gpt("detach-ste")),
                        ("custom-op-ste", _gpt("custom-op-ste")), ("xlm", _xlm())):
        from families import train_steps

        program = parallelize_on(model, _data(), ROWS // M, tp=2, pp=2, microbatches=M)
        out[name] = (*train_steps(program.materialize(), _data(), LR), program.fallbacks(),
                     [r.module for r in program.plan.rejected])
    return out


@pytest.mark.multiprocess
def test_functions_kept_or_rewritten_and_xlm_train_with_one_devices_gradients_at_tp2_pp2():
    """On 4 gloo ranks (tp=2 x pp=2, 2 microbatches, 2 AdamW steps), against one device:
    - the hand-written GELU Function, traced as its ops, every linear split;
    - the straight-through estimator rewritten with ``.detach()``, and as a custom op with its own
      autograd (left whole: no sharding rule), against one device running the original Function;
    - XLM, whose only ``.item()`` feeds an assertion.
    Tolerances: ``assert_ranks_match`` (fp32, the parallel run reorders sums only)."""
    results = spawn_ranks(_functions_worker, 4)
    references = {"function-gelu": _gpt("function-gelu"), "detach-ste": _gpt("function-ste"),
                  "custom-op-ste": _gpt("function-ste"), "xlm": _xlm()}
    for name, model in references.items():
        assert_ranks_match(reference_run(model, _data(), lr=LR), [res[name][:2] for res in results], name)
    for res in results:
        assert res["function-gelu"][2:] == ([], []), res["function-gelu"][2:]
        assert res["detach-ste"][2:] == ([], []), res["detach-ste"][2:]
        # the custom op has no sharding rule: its MLP's linears stay whole, and the plan says so
        assert set(res["custom-op-ste"][3]) == {f"h.{i}.mlp.{p}" for i in range(2) for p in ("fc", "proj")}
        assert res["xlm"][2] == [], res["xlm"][2]


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
        _compile(cls())
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

    ids = _data()[0][0][0][:2]
    traced = trace(Checked(), (ids,), (ids,), lm_cross_entropy)
    targets = {str(n.target) for n in traced.gm.graph.nodes if n.op == "call_function"}
    assert not any("item" in t or "assert_scalar" in t or t == "aten.max.default" for t in targets), targets


# ---------------------------------------------------------------- HuggingFace families


def _hf(name: str) -> nn.Module:
    import transformers as T

    torch.manual_seed(0)
    common = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64, bos_token_id=0,
                  eos_token_id=0)
    if name == "phimoe":
        return T.PhimoeForCausalLM(T.PhimoeConfig(num_local_experts=4, num_experts_per_tok=2, pad_token_id=None,
                                                  **common))
    return T.JetMoeForCausalLM(T.JetMoeConfig(kv_channels=16, num_local_experts=4, num_experts_per_tok=2,
                                              **{k: v for k, v in common.items() if k != "num_attention_heads"}))


def _xlm() -> nn.Module:
    import transformers as T

    torch.manual_seed(0)
    return T.XLMWithLMHeadModel(T.XLMConfig(vocab_size=VOCAB, emb_dim=64, n_layers=2, n_heads=4,
                                            max_position_embeddings=64, dropout=0.0, attention_dropout=0.0,
                                            bos_index=0, eos_index=0, pad_index=1))


def _quoted_line_is_the_files(msg: str, pattern: str) -> None:
    """The ``file:line code`` the message quotes is that line of that file."""
    found = re.search(pattern, msg)
    assert found, (pattern, msg)
    file, line, code = found.groups()
    assert linecache.getline(file, int(line)).strip() == code.strip(), (file, line, code)


def test_phimoe_router_function_is_refused_by_name():
    from transformers.models.phimoe import modeling_phimoe

    with pytest.raises(autopar.TraceError) as err:
        _compile(_hf("phimoe"))
    msg = str(err.value)
    cls = modeling_phimoe.PhimoeMultiplier
    where = f"{inspect.getsourcefile(cls)}:{inspect.getsourcelines(cls)[1]}"
    assert f"torch.autograd.Function {cls.__module__}.PhimoeMultiplier (defined at {where})" in msg, msg
    _quoted_line_is_the_files(msg, r"\n  at (\S+modeling_phimoe\.py):(\d+): (.*PhimoeMultiplier\.apply\(.*)\n")


def test_jetmoe_routing_is_refused_with_the_op_and_the_line():
    from transformers.models.jetmoe import modeling_jetmoe

    with pytest.raises(autopar.TraceError) as err:
        _compile(_hf("jetmoe"))
    msg = str(err.value)
    assert msg.startswith("cannot trace JetMoeForCausalLM: aten.item"), msg
    found = re.search(r"\n  at modeling_jetmoe\.py:(\d+) (.*?) \(in (\S+)\)\n", msg)
    assert found, msg
    line, code, path = found.groups()
    assert linecache.getline(modeling_jetmoe.__file__, int(line)).strip() == code, (line, code)
    assert path.startswith("model.layers.0."), path
