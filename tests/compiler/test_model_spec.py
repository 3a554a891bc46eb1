"""Tier (a): planning for a user's model: its dimensions read from the traced graph."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

import autopar
from autopar.compiler.model_spec import SpecError, spec_from_model
from autopar.planning.cost.layout import Cluster
from autopar.planning.cost.models import get_model
from autopar.planning.search.planner import SearchSpace, search
from autopar.reference.models import build


def _random_ids(seq=16, vocab=250):
    return (torch.randint(0, vocab, (2, seq)),)


@pytest.mark.parametrize("family,kw,expect", [
    ("gpt", {}, dict(heads=8, kv=8, ffn=256, gated=False)),
    ("gpt2-fused", {}, dict(heads=8, kv=8, ffn=256, gated=False)),  # attention written as q @ k^T
    ("llama", {"n_kv_head": 2, "d_ff": 96}, dict(heads=8, kv=2, ffn=96, gated=True)),
])
def test_dimensions_read_from_the_graph(family, kw, expect):
    model = build(family, vocab_size=250, seq_len=16, n_layer=3, n_head=8, d_model=64, **kw)
    spec = spec_from_model(model, _random_ids())
    assert (spec.layers, spec.hidden, spec.seq_len, spec.vocab) == (3, 64, 16, 250)
    assert (spec.heads, spec.kv, spec.ffn_size, spec.gated_mlp) == (
        expect["heads"], expect["kv"], expect["ffn"], expect["gated"])


def test_plan_a_meta_model_like_a_preset():
    """The paper's 1.7B GPT built on the meta device plans exactly as the preset does, and is
    recognised as the paper's row (so the comparison with the paper's layout is printed)."""
    preset = get_model("gpt-1.7b")
    with torch.device("meta"):
        model = build("gpt", vocab_size=preset.vocab, seq_len=preset.seq_len, n_layer=preset.layers,
                      n_head=preset.heads, d_model=preset.hidden)
    ids = (torch.zeros(1, preset.seq_len, dtype=torch.long),)
    space = SearchSpace.megatron_2021(dp_overlap=True)
    got = autopar.plan(model, ids, gpus=32, global_batch=512, space=space)
    spec = got.spec
    assert (spec.layers, spec.hidden, spec.heads, spec.seq_len, spec.vocab, spec.ffn_size) == (
        preset.layers, preset.hidden, preset.heads, preset.seq_len, preset.vocab, preset.ffn_size)
    want = search(preset, Cluster.of(32, "dgx-a100-80gb", 512), space)
    assert [e.layout for e in got.ranked] == [e.layout for e in want.ranked]
    assert got.best.t_iter == pytest.approx(want.best.t_iter)
    assert got.reference is not None and got.why()[0].startswith("the best layout is the reference layout")


def test_a_model_without_an_mlp_the_graph_shows_says_what_to_give():
    class Experts(nn.Module):  # the MLP applied as one bmm over stacked weights: no linears
        def __init__(self, d):
            super().__init__()
            self.w = nn.Parameter(torch.randn(2, d, d))

        def forward(self, x):
            return torch.bmm(x.expand(2, *x.shape[-2:]) if x.dim() == 2 else x.flatten(0, 1).unsqueeze(0)
                             .expand(2, -1, -1), self.w).sum(0).view_as(x)

    model = build("gpt", vocab_size=250, seq_len=16, n_layer=2, n_head=8, d_model=64)
    for block in model.h:
        block.mlp = Experts(64)
    with pytest.raises(SpecError, match="give --ffn by hand"):
        spec_from_model(model, _random_ids())


def test_cli_plans_from_a_huggingface_config(tmp_path, capsys):
    import json

    transformers = pytest.importorskip("transformers")
    from autopar.cli import main

    transformers.LlamaConfig(vocab_size=32000, hidden_size=1024, intermediate_size=2816, num_hidden_layers=8,
                             num_attention_heads=16, num_key_value_heads=4).save_pretrained(tmp_path)
    rc = main(["plan", "--hf-config", str(tmp_path / "config.json"), "--gpus", "16", "--batch", "128",
               "--seq-len", "1024", "--recompute", "full", "--json", "--top", "3"])
    assert rc == 0
    out = json.loads(capsys.readouterr().out)
    assert out["model"] == {"name": "llama", "layers": 8, "hidden": 1024, "heads": 16, "seq_len": 1024,
                            "vocab": 32000, "ffn": 2816, "kv_heads": 4, "gated_mlp": True, "fused_attention": True,
                            "dropout": False, "tied_head": False, "learned_positions": False}
    assert out["ranked"] and out["ranked"][0]["fits"]
    with pytest.raises(SystemExit, match="cannot read a HuggingFace config"):
        main(["plan", "--hf-config", str(tmp_path / "missing.json"), "--gpus", "16", "--batch", "128"])


def test_mixture_of_experts_read_from_the_graph():
    """Experts are found as ``parallelize`` finds them: E, top-k and one expert's width from the grouped
    matmuls; in Qwen2-MoE the router and the shared expert's one-feature gate are no MLP projections,
    and the dense MLP beside the experts is the shared expert."""
    transformers = pytest.importorskip("transformers")
    common = dict(vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)
    torch.manual_seed(0)
    mixtral = transformers.MixtralForCausalLM(transformers.MixtralConfig(intermediate_size=48, num_local_experts=4,
                                                                         num_experts_per_tok=2, **common))
    spec = spec_from_model(mixtral, _random_ids())
    assert (spec.experts, spec.top_k, spec.expert_ffn, spec.shared_expert_ffn, spec.moe_every, spec.gated_mlp) == \
        (4, 2, 48, 0, 1, True)
    qwen = transformers.Qwen2MoeForCausalLM(transformers.Qwen2MoeConfig(
        intermediate_size=48, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=24,
        shared_expert_intermediate_size=40, **common))
    spec = spec_from_model(qwen, _random_ids())
    assert (spec.experts, spec.top_k, spec.expert_ffn, spec.shared_expert_ffn) == (8, 2, 24, 40)
