"""The sharding analysis's index of parameter demands answers as a scan of every decision would.

``_State`` keeps, beside the decisions, which nodes ask for each parameter in
which placement, so a trial asks which parameters are wanted two ways without
going over the whole graph. Here every call of the analysis is checked
against that scan, on a model whose tied table is also read whole (the
trials and the vocabulary fallback both meet conflicts) and on the plain GPT.
"""

import pytest
import torch
import torch.nn as nn

import autopar
from autopar.reference.models import build
from passes.sharding import _State


def _scanned(state: _State, param_of: dict[str, str]) -> list[str]:
    """The conflicts gathered from every decision, in graph order (the index's reference)."""
    demands: dict[str, dict] = {}
    for n, d in state.dec.items():
        for pname, pl in d.param_demand.items():
            demands.setdefault(pname, {})[n.name] = pl
    return [f"{param_of.get(p, p)}: " + ", ".join(f"{k}={v}" for k, v in by_node.items())
            for p, by_node in demands.items() if len(set(by_node.values())) > 1]


class _TableReadWhole(nn.Module):
    """A GPT whose tied embedding table is also read whole by a penalty on its rows' norms."""

    def __init__(self):
        super().__init__()
        self.gpt = build("gpt", vocab_size=64, seq_len=8, n_layer=2, n_head=2, d_model=16)  # head tied to wte

    def forward(self, ids):
        return self.gpt(ids) + self.gpt.wte.weight.pow(2).mean()


@pytest.mark.parametrize("make", [_TableReadWhole, lambda: build("gpt", vocab_size=64, seq_len=8, n_layer=2,
                                                                n_head=2, d_model=16)])
def test_conflicts_match_a_scan_of_every_decision(make, monkeypatch):
    indexed = _State.param_conflicts
    answers = []

    def checked(state, param_of):
        got = indexed(state, param_of)
        assert got == _scanned(state, param_of)
        assert all(state.demands.values())  # a parameter no node asks for is dropped
        answers.append(got)
        return got

    monkeypatch.setattr(_State, "param_conflicts", checked)
    torch.manual_seed(0)
    x = torch.randint(0, 64, (2, 8))
    program = autopar.parallelize(make(), example_inputs=(x,), example_targets=x.clone(), tp=2)
    assert answers
    if make is _TableReadWhole:
        assert any(answers), "the table read whole gives the trials a conflict to see"
        assert any("vocabulary stays unsplit" in r.reason for r in program.plan.rejected)
