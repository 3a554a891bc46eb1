"""Edge cases of the sharding rules, against one process on 2 gloo ranks (tp=2).

Each block below once compiled into a program that was silently wrong or did
not run:

- ``baddbmm`` whose product sums over the split dim: g would have added
  ``beta * input`` t times; and one whose product is split on columns (the
  input would have needed slicing): neither is split there any more (the
  product runs on gathered operands, or the linears feeding it stay whole), and
  the plan says why;
- ``einsum`` summing over a split subscript with a third operand read whole
  (a parameter, an activation): that operand's gradient is partial and gets f;
- ``einsum`` where an operand broadcasts (size 1) on the split subscript
  (multi-query attention written with einsum): it is read whole, not sliced;
- a parallel block written with an in-place add on a view of a tensor read
  afterwards: the merge of row-parallel reductions leaves it alone.

Tolerances as in test_tp_parity.
"""

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from helpers import assert_ranks_match, compiled, reference_run, seeded, spawn_ranks, token_batches

pytestmark = pytest.mark.multiprocess
V, E, S, B, H = 96, 64, 8, 2, 4
D = E // H


class BaddbmmContracting(nn.Module):
    def __init__(self):
        super().__init__()
        self.q, self.k, self.v, self.o = (nn.Linear(E, E) for _ in range(4))
        self.bias = nn.Parameter(torch.randn(1, S, S))

    def forward(self, x):
        s = torch.baddbmm(self.bias.expand(x.shape[0], S, S), self.q(x), self.k(x).transpose(1, 2),
                          beta=0.5, alpha=0.3)
        return x + self.o(torch.softmax(s, -1) @ self.v(x))


class BaddbmmColumns(nn.Module):
    def __init__(self):
        super().__init__()
        self.v, self.o = nn.Linear(E, E), nn.Linear(E, E)
        self.b = nn.Parameter(torch.randn(S, E) * 0.1)

    def forward(self, x):
        return x + self.o(torch.baddbmm(self.b, torch.softmax(x @ x.transpose(1, 2), -1), self.v(x)))


class EinsumSumWithParam(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(E, E), nn.Linear(E, E)
        self.p = nn.Parameter(torch.randn(S))

    def forward(self, x):
        return x * (1 + 0.1 * torch.einsum("bsd,bsd,s->bs", self.a(x), self.b(x), self.p).unsqueeze(-1))


class EinsumSumWithActivation(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(E, E), nn.Linear(E, E)

    def forward(self, x):
        return x * (1 + 0.5 * torch.einsum("bsd,bsd,bs->bs", self.a(x), self.b(x), x[..., 0]).unsqueeze(-1))


class EinsumMultiQuery(nn.Module):
    def __init__(self):
        super().__init__()
        self.q, self.o, self.kv = nn.Linear(E, E), nn.Linear(E, E), nn.Linear(E, 2 * D)

    def forward(self, x):
        b = x.shape[0]
        q = self.q(x).view(b, S, H, D).transpose(1, 2)
        k, v = (t.unsqueeze(1) for t in self.kv(x).view(b, S, 2, D).unbind(2))
        s = torch.einsum("bhqd,bhkd->bhqk", q, k) * D**-0.5
        a = torch.einsum("bhqk,bhkd->bhqd", torch.softmax(s, -1), v)
        return x + self.o(a.transpose(1, 2).reshape(b, S, E))


class InplaceOnAView(nn.Module):
    def __init__(self):
        super().__init__()
        self.ln = nn.LayerNorm(E)
        self.fc1, self.fc2 = nn.Linear(E, 2 * E), nn.Linear(2 * E, E)
        self.gc1, self.gc2 = nn.Linear(E, 2 * E), nn.Linear(2 * E, E)

    def forward(self, x):
        h = self.ln(x)
        a, b = self.fc2(F.gelu(self.fc1(h))), self.gc2(F.gelu(self.gc1(h)))
        out = x * 1.0
        z = out.view(out.shape).add_(a)
        return (z + b) + 0 * out


BLOCKS = {c.__name__: c for c in (BaddbmmContracting, BaddbmmColumns, EinsumSumWithParam, EinsumSumWithActivation,
                                  EinsumMultiQuery, InplaceOnAView)}


class EdgeLM(nn.Module):
    def __init__(self, block):
        super().__init__()
        self.wte, self.ln, self.head = nn.Embedding(V, E), nn.LayerNorm(E), nn.Linear(E, V, bias=False)
        self.layers = nn.ModuleList(BLOCKS[block]() for _ in range(2))

    def forward(self, ids):
        x = self.wte(ids)
        for layer in self.layers:
            x = layer(x)
        return self.head(self.ln(x))


def _lm_with_block(block):
    return seeded(EdgeLM, block)


def _block_batches():
    return token_batches(V, steps=1, rows=B, seed=1, seq=S)


def _block_program(block):
    (x,), (y,) = _block_batches()[0]
    return compiled(_lm_with_block(block), tp=2, world_size=2, example_inputs=(x,), example_targets=y)


def _train_one_step_per_block():
    out = {}
    for block in BLOCKS:
        (x,), (y,) = _block_batches()[0]
        program = _block_program(block)  # inherited from the test process
        engine = program.materialize()
        said = [f[1] for f in program.fallbacks()] + [r.reason for r in program.plan.rejected]
        out[block] = (engine.train_step(x, y), engine.full_grads(), said)
    return out


@pytest.fixture(scope="module")
def block_runs():
    for block in BLOCKS:  # compile once here: the ranks inherit the programs
        _block_program(block)
    return spawn_ranks(_train_one_step_per_block, 2, timeout_s=600)


@pytest.mark.parametrize("block", list(BLOCKS))
def test_matches_one_process(block_runs, block):
    per_rank = [([res[block][0]], [res[block][1]]) for res in block_runs]  # one step: (losses, gradients)
    assert_ranks_match(reference_run(_lm_with_block(block), _block_batches()), per_rank, label=block)


@pytest.mark.parametrize("block", ["BaddbmmContracting", "BaddbmmColumns"])
def test_baddbmm_split_off_its_batch_dim_is_not_split_there_and_says_so(block_runs, block):
    said = block_runs[0][block][2]  # a fallback (gathered operands) or a linear left whole, with the reason
    assert any("baddbmm with its product split on rows, columns or the contraction" in why for why in said), said
