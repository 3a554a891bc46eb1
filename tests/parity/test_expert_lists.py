"""Experts written as a list of modules, under expert parallelism, against one device.

Three ways of writing a mixture of experts with a ``ModuleList`` of expert MLPs
(hidden 16, 4 experts, 2 layers, 8 sequences of 8 tokens a step):

- **dense routing**: every expert applied to every token, its output weighted
  by a gate that is zero outside the token's top 2 (SwiGLU experts, no biases);
- **capacity dispatch** (GShard, Switch, DeepSpeed-MoE): top-1, each expert's
  slot of a (E, C, H) tensor built from the router's choices with a capacity
  C per expert, expert e applied to slot e (GELU MLPs with biases);
- dense routing of experts holding plain weight parameters applied with ``@``
  and a per-feature scale.

The compiler stacks each list into one grouped computation
(``passes/expert_lists.py``), so expert parallelism holds E/ep whole experts
per rank. Each layout's loss and every gradient, under the model's own
per-expert names, over 3 AdamW steps match the single-device run of the
model as written (``assert_ranks_match``: fp32, the first step element-wise
rtol 1e-5 / atol 1e-6, later steps per tensor). The capacity depends on the
tokens of one forward, so the one-device run cuts each global batch into the
layout's dp x microbatches parts as the engine does (``_reference``).

Also: a checkpoint saved at ep=2 (DCP, stacked names) loads in one process
at ep=1 with every tensor bit for bit and gives the model's ``state_dict``
keys, as do ``engine.save_pretrained`` and the export of the checkpoint
(``autopar export --to-hf``); the model's own per-expert tensors in a safetensors file load at ep=2,
each rank holding its two experts' values.
"""

import copy

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from families import train_steps
from helpers import (assert_ranks_match, chunked_one_device_steps, layout_chunks, layout_world, parallelize_on,
                     spawn_ranks, token_batches)

import autopar

pytestmark = pytest.mark.multiprocess
VOCAB, H, FF, E, ROWS, SEQ, STEPS, LR = 64, 16, 24, 4, 8, 8, 3, 1e-3


class SwiGLU(nn.Module):
    def __init__(self):
        super().__init__()
        self.gate, self.up, self.down = nn.Linear(H, FF, bias=False), nn.Linear(H, FF, bias=False), \
            nn.Linear(FF, H, bias=False)

    def forward(self, x):
        return self.down(F.silu(self.gate(x)) * self.up(x))


class DenseRouted(nn.Module):
    """Every expert on every token, weighted by the top-2 gates (zero elsewhere)."""

    def __init__(self):
        super().__init__()
        self.router = nn.Linear(H, E, bias=False)
        self.experts = nn.ModuleList([SwiGLU() for _ in range(E)])

    def forward(self, x):
        probs = self.router(x).softmax(-1)
        top_w, top_i = probs.topk(2, dim=-1)
        gate = torch.zeros_like(probs).scatter(-1, top_i, top_w / top_w.sum(-1, keepdim=True))
        return sum(gate[..., e:e + 1] * expert(x) for e, expert in enumerate(self.experts))


class CapacityRouted(nn.Module):
    """Top-1 with a capacity of 2 x tokens / E per expert: a (E, C, H) dispatch, expert e on slot e."""

    def __init__(self):
        super().__init__()
        self.router = nn.Linear(H, E, bias=False)
        self.experts = nn.ModuleList([nn.Sequential(nn.Linear(H, FF), nn.GELU(), nn.Linear(FF, H)) for _ in range(E)])

    def forward(self, x):
        b, s, h = x.shape
        t = x.reshape(-1, h)
        cap = 2 * t.shape[0] // E
        probs = self.router(t).softmax(-1)
        w, idx = probs.topk(1, dim=-1)
        chosen = F.one_hot(idx[:, 0], E).to(t.dtype)  # (n, E)
        slot = (torch.cumsum(chosen, 0) - 1) * chosen  # the token's place in its expert's queue
        kept = chosen * (slot < cap).to(t.dtype)
        place = F.one_hot((slot * kept).long().sum(-1), cap).to(t.dtype)  # a dropped token: slot 0, zero weight
        dispatch = kept.unsqueeze(-1) * place.unsqueeze(1)  # (n, E, C)
        slots = torch.einsum("nec,nh->ech", dispatch, t)
        out = torch.stack([expert(part) for part, expert in zip(slots.unbind(0), self.experts)])
        return torch.einsum("nec,ech->nh", dispatch * w.unsqueeze(-1), out).view(b, s, h)


class RawExpert(nn.Module):
    """Weights as plain parameters, applied with ``@``, and a per-feature scale."""

    def __init__(self):
        super().__init__()
        self.w_in = nn.Parameter(torch.randn(H, FF) / H**0.5)
        self.w_out = nn.Parameter(torch.randn(FF, H) / FF**0.5)
        self.scale = nn.Parameter(1 + torch.randn(FF) / 10)

    def forward(self, x):
        return (F.relu(x @ self.w_in) * self.scale) @ self.w_out


class DenseRoutedRaw(DenseRouted):
    def __init__(self):
        super().__init__()
        self.experts = nn.ModuleList([RawExpert() for _ in range(E)])


class ListMoELM(nn.Module):
    def __init__(self, block):
        super().__init__()
        self.emb = nn.Embedding(VOCAB, H)
        self.norms = nn.ModuleList([nn.LayerNorm(H) for _ in range(2)])
        self.moes = nn.ModuleList([block() for _ in range(2)])
        self.head = nn.Linear(H, VOCAB, bias=False)

    def forward(self, idx):
        h = self.emb(idx)
        for norm, moe in zip(self.norms, self.moes):
            h = h + moe(norm(h))
        return self.head(h)


def _model(kind: str) -> nn.Module:
    torch.manual_seed(0)
    return ListMoELM({"dense": DenseRouted, "capacity": CapacityRouted, "raw": DenseRoutedRaw}[kind])


def _data():
    return token_batches(VOCAB, STEPS, ROWS, seed=1, seq=SEQ)


CASES = {
    "dense ep2": ("dense", dict(dp=2, ep=2, expert_dispatch="alltoall")),
    "capacity ep2 allgather": ("capacity", dict(dp=2, ep=2, expert_dispatch="allgather")),
    "dense ep4 distributed optimizer": ("dense", dict(dp=4, ep=4)),
    "capacity ep2 tp2": ("capacity", dict(tp=2, dp=2, ep=2, expert_dispatch="alltoall")),
    "dense ep2 tp2 whole sp": ("dense", dict(tp=2, dp=2, ep=2, expert_tp=1, sequence_parallel=True)),
    "capacity ep2 pp2": ("capacity", dict(pp=2, dp=2, ep=2, microbatches=2)),
    "raw ep2 tp2": ("raw", dict(tp=2, dp=2, ep=2)),
}


def _program(label: str):
    kind, layout = CASES[label]
    return parallelize_on(_model(kind), _data(), ROWS // layout_chunks(layout), world_size=layout_world(layout),
                          **layout)


def _train(labels: list[str]) -> dict:
    out = {}
    for label in labels:
        engine = _program(label).materialize()
        held = {n: tuple(p.shape) for n, p in engine.named_local_parameters() if n in engine.program.expert_params}
        out[label] = (_distributed_steps(engine) if "distributed optimizer" in label else
                      train_steps(engine, _data(), LR), held)
    return out


def _distributed_steps(engine):
    """``train_steps`` with the distributed optimizer: AdamW state sharded over the replicas holding
    the same parameters (for the experts: the ranks holding the same experts)."""
    opt = engine.distributed_optimizer(torch.optim.AdamW, lr=LR)
    losses, grads = [], []
    for inputs, targets in _data():
        losses.append(engine.train_step(*inputs, *targets))
        grads.append(engine.full_grads())
        opt.step()
        opt.zero_grad()
    return losses, grads


def _reference(label: str) -> tuple[list[float], list[dict[str, torch.Tensor]]]:
    """One device, the model as written: each global batch cut into the layout's chunks, each chunk's
    loss / chunks backpropagated, then AdamW."""
    kind, layout = CASES[label]
    return chunked_one_device_steps(_model(kind), _data(), layout_chunks(layout), LR,
                                    lambda out, y: F.cross_entropy(out.flatten(0, -2), y.flatten()))


@pytest.fixture(scope="module")
def runs():
    for label in CASES:
        _program(label)  # compiled here first: the ranks inherit it
    out = {}
    for world in sorted({layout_world(layout) for _, layout in CASES.values()}):
        labels = [label for label, (_, layout) in CASES.items() if layout_world(layout) == world]
        results = spawn_ranks(_train, world, labels)
        out.update({label: [r[label] for r in results] for label in labels})
    return out


def test_lists_of_experts_match_one_device_at_every_layout(runs):
    for label, per_rank in runs.items():
        assert_ranks_match(_reference(label), [steps for steps, _ in per_rank], label)


def test_each_rank_holds_e_over_ep_whole_experts(runs):
    """Each stacked weight is held as E/ep experts on every rank (tp's split inside unless experts are whole)."""
    for label, per_rank in runs.items():
        kind, layout = CASES[label]
        ep, tp = layout["ep"], layout.get("tp", 1)
        split = tp if layout.get("expert_tp", tp) == tp else 1
        for _, held in per_rank:
            assert held, label
            for name, shape in held.items():  # (E/ep, ., .), each expert FF x H, split over tp or whole
                assert ".*." in name and shape[0] == E // ep, (label, name, shape)
                assert shape[1] * shape[2] * split == FF * H, (label, name, shape)


def _save_at_ep2(root: str) -> dict:
    engine = _program("dense ep2").materialize()
    train_steps(engine, _data()[:1], LR)
    engine.save(root, step=1)
    engine.save_pretrained(f"{root}/exported")
    state = engine.full_state_dict()  # collective
    return state if dist.get_rank() == 0 else None


def test_a_checkpoint_saved_at_ep2_loads_at_ep1_under_the_models_names(tmp_path):
    saved = spawn_ranks(_save_at_ep2, 2, str(tmp_path))[0]
    model = _model("dense")
    assert saved.keys() == model.state_dict().keys()  # the model's per-expert names, not the stacked ones
    inputs, targets = _data()[0]
    one = autopar.parallelize(model, example_inputs=tuple(x[:4] for x in inputs),
                              example_targets=tuple(y[:4] for y in targets)).materialize()
    one.load(str(tmp_path))
    loaded = one.full_state_dict()
    for key, value in saved.items():
        assert torch.equal(loaded[key], value), key
    # the HuggingFace export of the ranks, and the export of the checkpoint: the model's own keys
    from safetensors.torch import load_file

    from autopar.runtime.hf.export_checkpoint import export_checkpoint

    export_checkpoint(str(tmp_path), str(tmp_path / "from-checkpoint"))
    for exported in ("exported", "from-checkpoint"):
        files = sorted((tmp_path / exported).glob("*.safetensors"))
        tensors = {k: v for f in files for k, v in load_file(str(f)).items()}
        assert tensors.keys() == saved.keys(), exported
        for key, value in saved.items():
            assert torch.equal(tensors[key], value), (exported, key)


def _hub_layout_at_ep2(path: str) -> dict:
    engine = _program("capacity ep2 allgather").materialize(checkpoint=path)
    experts = set(engine.program.expert_params)  # the stacked weights, split ep ways (biases stay whole)
    return {n: (p.detach().clone(), n in experts) for n, p in engine.named_local_parameters()} | \
        {"ep_rank": engine.mesh.ep_rank}


def test_per_expert_tensors_of_a_safetensors_file_load_at_ep2(tmp_path):
    """The model's own state (one tensor per expert, as such models are published) in a safetensors
    file: each rank stacks its two experts' weights (and every expert's bias, which rides with the rows),
    and they equal the model's."""
    from safetensors.torch import save_file

    model = _model("capacity")
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p))
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(tmp_path / "model.safetensors"))
    own = model.state_dict()
    for held in spawn_ranks(_hub_layout_at_ep2, 2, str(tmp_path)):
        first = held.pop("ep_rank") * (E // 2)
        for name, (value, split) in held.items():
            if ".*." in name:
                experts = range(first, first + E // 2) if split else range(E)
                want = torch.stack([own[name.replace("*", str(e))] for e in experts])
            else:
                want = own[name]
            assert torch.equal(value, want), name


def test_the_stacked_layer_is_found_and_named():
    program = _program("dense ep2")
    assert [(x.module, x.experts, x.refusal) for x in program.experts] == [(f"moes.{i}.experts", E, None)
                                                                          for i in range(2)]
    assert [(x.top_k, x.router) for x in program.experts] == [(2, f"moes.{i}") for i in range(2)]  # gates
    assert [x.top_k for x in _program("capacity ep2 allgather").experts] == [1, 1]  # the dispatch's top-1
    assert program.traced.stacked["moes.0.experts.*.gate.weight"] == tuple(f"moes.0.experts.{e}.gate.weight"
                                                                           for e in range(E))
    assert copy.copy(program.expert_params) == {f"moes.{i}.experts.*.{w}.weight": E for i in range(2)
                                                for w in ("gate", "up", "down")}
