"""A chunk's backward split into B (input gradients) and W (weight gradients) equals the unsplit one.

The chunks are a compiled program's (4 layers, pp=2, two virtual stages: four chunks,
the first with the embedding, the last with the head and loss), run one after
the other in this process as the engine runs them: each chunk's inputs are
leaves, its output gradients come from the next chunk's B. The reference runs
``torch.autograd.backward`` per chunk; the split runs B per chunk and W in a
given order. Both on the same weights and microbatches, so every gradient is
the same computation up to the order in which contributions are summed into a
``.grad`` (tied weights, microbatches): fp32 within rtol 1e-5, atol 1e-6.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
from families import SEQ, make

import autopar
from autopar.core.activation_recompute import Checkpointed
from autopar.core.comm import TPGroup
from autopar.runtime.optim.split_backward import SplitBackward, _leading_to, _topological, plan_split

M = 2  # microbatches
ROWS = 2
TOL = {"rtol": 1e-5, "atol": 1e-6}  # fp32: only the order of the sums into .grad differs
BF16_TOL = {"rtol": 1e-2, "atol": 1e-3}  # bf16 autocast: a bf16 sum order differs (2^-8 relative per rounding)


def _compile_split_pipeline(family: str, **config):
    model, vocab = make(family, layers=4)
    x = torch.randint(0, vocab, (ROWS * M, SEQ), generator=torch.Generator().manual_seed(1))
    y = torch.randint(0, vocab, (ROWS * M, SEQ), generator=torch.Generator().manual_seed(2))
    program = autopar.parallelize(model, pp=2, virtual_stages=2, microbatches=M, example_inputs=(x[:ROWS],),
                                  example_targets=y[:ROWS], world_size=2, **config)
    return program, model, [(x[i * ROWS:(i + 1) * ROWS], y[i * ROWS:(i + 1) * ROWS]) for i in range(M)]


class _Pipeline:
    """The program's chunks run in order in this process, on fresh leaf copies of the model's weights."""

    def __init__(self, program, model: nn.Module, micro, defer: str = "gemm") -> None:
        self.program, self.micro, self.defer = program, micro, defer
        traced = program.traced
        state = {**dict(model.named_buffers()), **dict(model.named_parameters())}
        self.weights = {name: nn.Parameter(state[name].detach().clone()) for name in program.param_names}
        self.fixed = {ph: state[name].detach() for ph, name in traced.buffer_of.items()}
        self.fixed.update({ph: traced.constants[name] for ph, name in traced.constant_of.items()})
        self.ptrs = {p.untyped_storage().data_ptr() for p in self.weights.values()}

    def args(self, chunk, i: int, inputs: list[torch.Tensor]) -> list:
        traced = self.program.traced
        batch = dict(zip(traced.input_names + traced.target_names, self.micro[i]))
        params = [self.weights[traced.param_of[ph]] for ph in chunk.params]
        return [TPGroup()] + params + [batch.get(ph, self.fixed.get(ph)) for ph in chunk.feeds] + inputs

    def forward(self, i: int, split: bool, autocast: bool = False):
        """Microbatch i through every chunk: per chunk (inputs, outputs, its SplitBackward or None)."""
        kept, handed = [], []
        for chunk in self.program.split.chunks:
            inputs = [t.detach().requires_grad_(b.requires_grad) for t, b in zip(handed, chunk.inputs)]
            sb = SplitBackward(self.ptrs, self.defer) if split else None
            with (sb.recording() if sb else _nothing()), torch.autocast("cpu", torch.bfloat16, enabled=autocast):
                outs = list(chunk.module(*self.args(chunk, i, inputs)))
            if chunk.index == self.program.split.n - 1:
                outs = [outs[0] / M]
            handed = [o.detach().to(b.dtype) for o, b in zip(outs, chunk.outputs)]
            kept.append((inputs, outs, sb))
        return kept

    def backward_inputs(self, kept, split: bool) -> None:
        """B of every chunk, last first (the unsplit backward when ``split`` is False)."""
        grads: list = [None]
        for c in reversed(range(len(kept))):
            inputs, outs, sb = kept[c]
            chunk = self.program.split.chunks[c]
            pairs = [(o, g) for o, g in zip(outs, grads) if o.requires_grad]
            if split:
                grads = sb.input_grads([o for o, _ in pairs], [g for _, g in pairs], inputs)
            else:
                torch.autograd.backward([o for o, _ in pairs], [g for _, g in pairs])
                grads = [x.grad for x in inputs]
            grads = [g if b.requires_grad else None for g, b in zip(grads, chunk.inputs)]
            kept[c] = (inputs, None, sb)  # the outputs dropped, as the engine drops its context

    def grads(self) -> dict[str, torch.Tensor]:
        return {n: p.grad for n, p in self.weights.items()}


class _nothing:
    def __enter__(self):
        return None

    def __exit__(self, *exc):
        return False


def _unsplit_pipeline_grads(program, model, micro, autocast=False):
    pipe = _Pipeline(program, model, micro)
    for i in range(M):
        pipe.backward_inputs(pipe.forward(i, split=False, autocast=autocast), split=False)
    return pipe.grads()


def _split(program, model, micro, order: str, autocast=False, defer="gemm"):
    """``order``: 'BBWW' (B of both microbatches, then both Ws) or 'BWBW'."""
    pipe = _Pipeline(program, model, micro, defer)
    pending = []
    for i in range(M):
        kept = pipe.forward(i, split=True, autocast=autocast)
        pipe.backward_inputs(kept, split=True)
        assert all(p.grad is None for p in pipe.weights.values()) or i > 0 and order == "BWBW"
        pending.append(kept)
        if order == "BWBW":
            _weights(pending.pop())
    for kept in pending:
        _weights(kept)
    return pipe.grads()


def _weights(kept) -> None:
    for _, _, sb in reversed(kept):
        sb.weight_grads()


def _assert_same(got, want, tol, label):
    assert got.keys() == want.keys()
    for name, ref in want.items():
        assert got[name] is not None, f"{label}: no gradient for {name}"
        torch.testing.assert_close(got[name], ref, **tol, msg=lambda m, n=name: f"{label} {n}: {m}")


@pytest.mark.parametrize("family, config, autocast", [
    ("nanogpt", {}, False),
    ("hf-llama", {}, False),
    ("nanogpt", {"recompute": "layer"}, False),
    ("llama", {"recompute": "layer"}, True),
])
def test_split_backward_matches_unsplit(family, config, autocast, shared):
    program, model, micro = shared((family, str(config)), lambda: _compile_split_pipeline(family, **config))
    want = _unsplit_pipeline_grads(program, model, micro, autocast)
    tol = BF16_TOL if autocast else TOL
    for order in ("BBWW", "BWBW"):
        _assert_same(_split(program, model, micro, order, autocast), want, tol, f"{family} {config} {order}")
    # every built-in weight node deferred (norms too): the same gradients
    _assert_same(_split(program, model, micro, "BBWW", autocast, defer="all"), want, tol, f"{family} all")


def test_input_gradients_after_b_and_nothing_in_grad_before_w(shared):
    """B alone gives the previous chunk exactly the unsplit input gradients; no weight has a
    gradient until W runs; W with no B first, or twice, is refused."""
    program, model, micro = shared(("nanogpt", "{}"), lambda: _compile_split_pipeline("nanogpt"))
    ref = _Pipeline(program, model, micro)
    ref_kept = ref.forward(0, split=False)
    ref.backward_inputs(ref_kept, split=False)
    pipe = _Pipeline(program, model, micro)
    kept = pipe.forward(0, split=True)
    with pytest.raises(RuntimeError, match="before input_grads"):
        kept[1][2].weight_grads()
    pipe.backward_inputs(kept, split=True)
    assert all(p.grad is None for p in pipe.weights.values())
    for c in range(1, len(kept)):  # chunk 0's inputs are token ids: nothing flows
        for x_ref, x in zip(ref_kept[c][0], kept[c][0]):
            assert x.grad is None  # B returns the gradients; it leaves .grad of the inputs alone
    _weights(kept)
    with pytest.raises(RuntimeError, match="ran twice"):
        kept[0][2].weight_grads()


def test_split_counts_and_bytes_held_for_w(shared):
    """The split as numbers, and what W keeps, on chunk 1 of the reference GPT (one layer).

    Between B and W the chunk's saved activations are exactly the inputs of its weight GEMMs
    (each storage once: q, k and v read one norm output), less than what F kept for B; W also
    keeps the gradients flowing into those GEMMs and the norms' weight gradients computed in B.
    """
    program, model, micro = shared(("nanogpt", "{}"), lambda: _compile_split_pipeline("nanogpt"))
    chunk = program.split.chunks[1]
    pipe = _Pipeline(program, model, micro)
    kept = pipe.forward(0, split=True)
    middle = kept[1][2]
    before = middle.held_bytes()
    pipe.backward_inputs(kept, split=True)
    after_saved, after = middle.store.held_bytes(), middle.held_bytes()
    linears = [n for n in chunk.gm.graph.nodes if n.target is torch.ops.aten.linear.default]
    gemm_inputs = {n.args[0].name: n.args[0].meta["val"] for n in linears}
    assert after_saved == sum(v.numel() * v.element_size() for v in gemm_inputs.values())
    gemm_grads = sum(n.meta["val"].numel() * n.meta["val"].element_size() for n in linears)
    norms = [n for n in chunk.gm.graph.nodes if n.target is torch.ops.aten.layer_norm.default]
    norm_params = [program.traced.param_of[a.name] for n in norms for a in n.args[2:4]]
    norm_weights = sum(pipe.weights[name].numel() * 4 for name in norm_params)  # fp32 gradients
    assert after == after_saved + gemm_grads + norm_weights
    assert after_saved < before
    # one deferred autograd node per weight GEMM (the layer's 6 linears); the 2 norms' 4 weight
    # gradients computed in B; no collective at tp=1
    assert middle.counts["deferred"] == len(linears) == 6, middle.counts
    assert middle.counts["captured"] == 4, middle.counts
    _weights(kept)
    assert middle.held_bytes() == 0


def test_regions_replay_once_for_b_and_w():
    """A checkpointed region runs its forward twice in all (forward, B's replay): W replays nothing."""
    torch.manual_seed(0)
    calls = []

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.norm, self.fc = nn.LayerNorm(8), nn.Linear(8, 8)

        def forward(self, x):
            calls.append(1)
            return torch.tanh(self.fc(self.norm(x)))

    block = Checkpointed(Block())
    x = torch.randn(4, 8, requires_grad=True)
    sb = SplitBackward()
    with sb.recording():
        y = block(x)
    gx, = sb.input_grads([y], [torch.ones_like(y)], [x])
    assert len(calls) == 2
    sb.weight_grads()
    assert len(calls) == 2
    ref = Block()
    ref.load_state_dict(block.inner.state_dict())
    x2 = x.detach().clone().requires_grad_()
    ref(x2).sum().backward()
    torch.testing.assert_close(gx, x2.grad, rtol=0, atol=0)  # same ops, same order: bitwise
    for (n, p), q in zip(block.inner.named_parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=0, atol=0, msg=n)


def test_unrecorded_forward_is_refused():
    lin = nn.Linear(4, 4)
    x = torch.randn(2, 4, requires_grad=True)
    y = lin(x)
    with pytest.raises(RuntimeError, match="not recorded"):
        SplitBackward().input_grads([y], [torch.ones_like(y)], [x])


class _Experts(torch.autograd.Function):
    """Rows times one weight as a custom autograd function (as ``transformers::grouped_mm_fallback``
    is): its backward node is on the B side."""

    @staticmethod
    def forward(ctx, rows, w):
        ctx.save_for_backward(rows, w)
        return rows @ w

    @staticmethod
    def backward(ctx, g):
        rows, w = ctx.saved_tensors
        return g @ w.t(), rows.t() @ g


def _routed(x, a, router, w, k=2):
    """A first stage's MoE layer with a residual: the rows and their routing probabilities both
    gathered by one int64 sort permutation; x (token features) needs no gradient."""
    h = x @ a
    probs, idx = torch.softmax(h @ router, -1).topk(k, -1)
    perm = idx.flatten().argsort()
    y = _Experts.apply(h[perm // k], w)
    p = probs.flatten()[perm]
    out = torch.zeros_like(h).index_add(0, perm // k, y * p.unsqueeze(-1))
    return (out + h).pow(2).mean()


@pytest.mark.parametrize("defer", ["gemm", "all"])
def test_captured_entry_below_another_runs_once(defer):
    """Two entries computed in B where one's node lies below the other's: the probabilities'
    gather (entered from the weighting of the experts' rows) leads through the router to h's own
    node, which is entered from the residual add too. B's engine call runs the nodes between the
    two to reach the lower one, so the plan puts them on the B side: W does not run them again
    (it read the permutation's slot B released and failed; kept, their gradient counted twice)."""
    torch.manual_seed(0)
    weights = [nn.Parameter(torch.randn(*s)) for s in [(6, 8), (8, 4), (8, 8)]]
    x = torch.randn(10, 6)
    _routed(x, *weights).backward()
    want = [p.grad.clone() for p in weights]
    for p in weights:
        p.grad = None
    sb = SplitBackward({p.untyped_storage().data_ptr() for p in weights}, defer)
    with sb.recording():
        loss = _routed(x, *weights)
    plan = plan_split([loss.grad_fn], set(), defer)
    assert sb.input_grads([loss], [None], [x]) == [None]
    assert all(p.grad is None for p in weights)
    sb.weight_grads()
    assert sb.held_bytes() == 0
    for p, ref in zip(weights, want):
        torch.testing.assert_close(p.grad, ref, **TOL)
    # the router's nodes (the probabilities' gather, top-k, softmax) are B's; no captured node above another
    assert {n.name() for n in plan.b_side} >= {"IndexBackward0", "TopkBackward0", "SoftmaxBackward0"}
    captured = {v for v, _ in plan.captured}
    to_captured = _leading_to(_topological([loss.grad_fn]), captured)
    assert not any(c in to_captured for v in captured for c, _ in v.next_functions), "a captured node above another"
