"""Export to HuggingFace: from a running engine (``engine.save_pretrained``) and from a checkpoint
(``autopar export CKPT --to-hf DIR``).

One spawn of 4 gloo ranks trains a tiny HuggingFace Llama and GPT-2 (tied
embedding and LM head, on the first and last stages) one AdamW step at tp=2 x
pp=2 and saves each. Checked: one weight file per stage, written by that
stage's tp rank 0 (rank 0 adds the index and configs); the index's keys are the
keys HuggingFace's own ``save_pretrained`` writes for the model (its
``state_dict`` less non-persistent buffers and tied duplicates; ``inv_freq``
absent), each layer's tensors in its stage's file; ``from_pretrained`` reports
no missing, unexpected or mismatched key; its weights equal
``engine.full_state_dict()`` bitwise, whose keys are the model's
``state_dict()`` keys in order; its loss on a batch (``model.eval()``, one
device) equals the engine's loss on that batch.

The CLI converts a checkpoint laid out as the checkpoint contract says (DCP
``model.<name>`` full tensors saved without a process group, ``autopar.json``,
``latest``) into directories ``from_pretrained`` loads with no key problem,
bitwise; cut by size into an index and several files; reading one tensor at a
time (peak memory measured in a fresh process); bad input refused before any
file is written.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
import torch.nn as nn
from families import make
from helpers import parallelize_on, spawn_ranks, token_batches

import autopar
from autopar.cli import main as cli_main

FAMILIES = ("hf-llama", "hf-gpt2")
TP, PP, MICROBATCHES, ROWS = 2, 2, 2, 2
LR = 1e-3
# The loaded model's loss (one device, eval mode) against the engine's loss on the same batch
# (tp=2 x pp=2): the same fp32 weights, bitwise; only the order of sums differs (split matmuls,
# the vocabulary-parallel cross-entropy), so they agree to fp32 rounding of a loss near log(V) ~ 5.7.
LOSS_TOLERANCE = {"rtol": 1e-5, "atol": 1e-6}


def _train_and_save(family: str, out_dir: str) -> dict:
    """On one rank: one AdamW step at tp=2 x pp=2, ``save_pretrained``, the full state dict and the
    engine's loss on an evaluation batch (a forward and backward, no optimizer step)."""
    model, vocab = make(family)
    data = token_batches(vocab, steps=2, rows=ROWS, seed=1)
    program = parallelize_on(model, data, ROWS // MICROBATCHES, tp=TP, pp=PP, microbatches=MICROBATCHES)
    engine = program.materialize()
    optimizer = torch.optim.AdamW(engine.parameters(), lr=LR)
    engine.train_step(*data[0][0], *data[0][1])
    optimizer.step()
    optimizer.zero_grad()
    written = engine.save_pretrained(out_dir)
    state = {k: v.cpu() for k, v in engine.full_state_dict().items()}
    loss = engine.train_step(*data[1][0], *data[1][1])
    coords = engine.mesh.shape.coords(engine.mesh.rank)
    return {"written": written, "loss": loss, "coords": coords, "state": state if coords == (0, 0, 0) else None}


def _worker(root: str) -> dict:
    return {family: _train_and_save(family, os.path.join(root, family)) for family in FAMILIES}


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> tuple[Path, list[dict]]:
    """Both families trained and saved on one set of 4 ranks: (root, each rank's results)."""
    root = tmp_path_factory.mktemp("export")
    return root, spawn_ranks(_worker, TP * PP, str(root), timeout_s=600)


def _from_pretrained(path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, output_loading_info=True)


def _hf_saved_keys(model: nn.Module, tmp: Path) -> set[str]:
    """The tensor names HuggingFace's own ``save_pretrained`` writes for ``model``."""
    from safetensors import safe_open

    model.save_pretrained(tmp)
    with safe_open(tmp / "model.safetensors", "pt") as f:
        return set(f.keys())


def _assert_loads_strictly(info: dict, label: str) -> None:
    problems = {k: info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys", "error_msgs") if info[k]}
    assert not problems, f"{label}: {problems}"


@pytest.mark.multiprocess
@pytest.mark.parametrize("family", FAMILIES)
def test_save_pretrained_files_and_writers(saved, family, tmp_path):
    root, ranks = saved
    out = root / family
    weight_files = [f"model-0000{k}-of-00002.safetensors" for k in (1, 2)]
    assert sorted(os.listdir(out)) == sorted(weight_files + ["model.safetensors.index.json", "config.json",
                                                            "generation_config.json"])
    for res in ranks:  # each stage's file by its tp rank 0; rank 0 also the index and the configs
        stage, _, tp_rank = res[family]["coords"]
        want = ([weight_files[stage]] if tp_rank == 0 else []) + (
            ["model.safetensors.index.json", "config.json", "generation_config.json"] if res is ranks[0] else [])
        assert res[family]["written"] == want, (family, res[family]["coords"])
    weight_map = json.loads((out / "model.safetensors.index.json").read_text())["weight_map"]
    model, _ = make(family)
    non_persistent = set(dict(model.named_buffers())) - set(model.state_dict())
    tied = {"hf-llama": 0, "hf-gpt2": 1}[family]  # GPT-2's lm_head.weight is transformer.wte.weight
    assert len(weight_map) == len(model.state_dict()) - tied == {"hf-llama": 21, "hf-gpt2": 28}[family]
    assert set(weight_map) == _hf_saved_keys(model, tmp_path)
    assert not non_persistent & set(weight_map) and not any("inv_freq" in k for k in weight_map)
    assert family != "hf-llama" or non_persistent == {"model.rotary_emb.inv_freq", "model.rotary_emb.original_inv_freq"}
    for name, file in weight_map.items():  # two layers on two stages: layer i in file i + 1
        layer = re.search(r"\.(?:layers|h)\.(\d+)\.", name)
        if layer:
            assert file == weight_files[int(layer.group(1))], (name, file)
        elif "embed" in name or "wte" in name or "wpe" in name:
            assert file == weight_files[0], (name, file)
        else:  # final norm, LM head
            assert file == weight_files[1], (name, file)


@pytest.mark.multiprocess
@pytest.mark.parametrize("family", FAMILIES)
def test_save_pretrained_loads_bitwise(saved, family):
    root, ranks = saved
    state = ranks[0][family]["state"]
    model, vocab = make(family)
    assert list(state) == list(model.state_dict())  # exactly the model's keys, in its order
    loaded, info = _from_pretrained(root / family)
    _assert_loads_strictly(info, family)
    got = loaded.state_dict()
    assert set(got) == set(state)
    for name, value in state.items():
        assert torch.equal(got[name], value), f"{family} {name} differs from engine.full_state_dict()"
    assert not torch.equal(state[next(iter(state))], model.state_dict()[next(iter(state))])  # trained
    (x,), (y,) = token_batches(vocab, steps=2, rows=ROWS, seed=1)[1]
    loaded.eval()
    with torch.no_grad():
        loss = autopar.lm_cross_entropy(loaded(x).logits, y)
    for res in ranks:
        torch.testing.assert_close(torch.tensor(res[family]["loss"]), loss, **LOSS_TOLERANCE)
