"""Export to HuggingFace: from a running engine (``engine.save_pretrained``) and from a checkpoint
(``autopar export CKPT --to-hf DIR``).

One spawn of 4 gloo ranks trains a tiny HuggingFace Llama and GPT-2 (tied
embedding and LM head, on the first and last stages) one AdamW step at tp=2 x
pp=2, and a plain model with buffers at pp=2 x dp=2, and saves each. Checked: one weight file per stage, written by that
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
from helpers import parallelize_on, spawn_ranks, token_batches, write_contract_checkpoint

import autopar
from autopar.cli import main as cli_main

FAMILIES = ("hf-llama", "hf-gpt2")
LAYOUTS = {"hf-llama": {"tp": 2, "pp": 2, "dp": 1}, "hf-gpt2": {"tp": 2, "pp": 2, "dp": 1},
           "buffers": {"tp": 1, "pp": 2, "dp": 2}}
"""Each family spawned and its layout on the 4 ranks."""
MICROBATCHES = 2
LR = 1e-3
# The loaded model's loss (one device, eval mode) against the engine's loss on the same batch
# (tp=2 x pp=2): the same fp32 weights, bitwise; only the order of sums differs (split matmuls,
# the vocabulary-parallel cross-entropy), so they agree to fp32 rounding of a loss near log(V) ~ 5.7.
LOSS_TOLERANCE = {"rtol": 1e-5, "atol": 1e-6}


class BufferedModel(nn.Module):
    """Not a HuggingFace model: a persistent buffer (exported), a non-persistent one (not), a
    parameter the forward never reads (exported as the model holds it), two blocks."""

    def __init__(self, vocab: int = 64, width: int = 16):
        super().__init__()
        self.emb = nn.Embedding(vocab, width)
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(width, 2 * width), nn.GELU(), nn.Linear(2 * width, width))
                                    for _ in range(2))
        self.unused = nn.Linear(4, 4)
        self.head = nn.Linear(width, vocab)
        self.register_buffer("scale", torch.linspace(0.5, 1.5, width))
        self.register_buffer("offset", torch.linspace(-1.0, 1.0, width), persistent=False)

    def forward(self, ids):
        h = self.emb(ids) * self.scale + self.offset
        for block in self.blocks:
            h = h + block(h)
        return self.head(h)


def _export_model(family: str) -> tuple[nn.Module, int]:
    if family == "buffers":
        torch.manual_seed(0)
        return BufferedModel(), 64
    return make(family)


def _batches(family: str, vocab: int):
    """A training batch and an evaluation batch: one sequence per microbatch and replica."""
    return token_batches(vocab, steps=2, rows=LAYOUTS[family]["dp"] * MICROBATCHES, seed=1)


def _export_program(family: str):
    """The family's program for its layout (compiled once per test and process) and its batches."""
    model, vocab = _export_model(family)
    data = _batches(family, vocab)
    return parallelize_on(model, data, 1, microbatches=MICROBATCHES, **LAYOUTS[family]), data


def _train_and_export(family: str, out_dir: str) -> dict:
    """On one rank: one AdamW step in the family's layout, ``save_pretrained``, the full state dict
    and the engine's loss on the evaluation batch (a forward and backward, no optimizer step)."""
    program, data = _export_program(family)
    engine = program.materialize()
    optimizer = torch.optim.AdamW(engine.parameters(), lr=LR)
    engine.train_step(*data[0][0], *data[0][1])
    optimizer.step()
    optimizer.zero_grad()
    written = engine.save_pretrained(out_dir)
    state = {k: v.cpu() for k, v in engine.full_state_dict().items()}
    loss = engine.train_step(*data[1][0], *data[1][1])
    coords = engine.mesh.shape.coords(engine.mesh.rank)
    failures = _save_pretrained_failures(engine, out_dir) if family == "buffers" else None
    return {"written": written, "loss": loss, "coords": coords, "state": state if coords == (0, 0, 0) else None,
            "failures": failures}


def _save_pretrained_failures(engine, out_dir: str) -> list[str]:
    """What each rank raises from ``save_pretrained`` into a file (refused before any work) and into
    a directory where stage 1's weight file is a directory (its writer fails after the gathers)."""
    import torch.distributed as dist

    rank = dist.get_rank()
    as_file, blocked = f"{out_dir}-file", f"{out_dir}-blocked"
    if rank == 0:
        Path(as_file).write_text("not a directory")
        os.makedirs(os.path.join(blocked, "model-00002-of-00002.safetensors"))
    dist.barrier()
    out = []
    for path in (as_file, blocked):
        try:
            engine.save_pretrained(path)
            out.append("")
        except (ValueError, RuntimeError) as e:
            out.append(f"{type(e).__name__}: {e}")
    return out


def _train_and_save_every_family(root: str) -> dict:
    return {family: _train_and_export(family, os.path.join(root, family)) for family in LAYOUTS}


@pytest.fixture(scope="module")
def trained_and_saved(tmp_path_factory) -> tuple[Path, list[dict]]:
    """Every spawned family trained and saved on one set of 4 ranks: (root, each rank's results)."""
    root = tmp_path_factory.mktemp("export")
    for family in LAYOUTS:  # compile once here: the ranks inherit the programs
        _export_program(family)
    return root, spawn_ranks(_train_and_save_every_family, 4, str(root), timeout_s=600)


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
def test_save_pretrained_files_and_writers(trained_and_saved, family, tmp_path):
    root, ranks = trained_and_saved
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
def test_save_pretrained_loads_bitwise(trained_and_saved, family):
    root, ranks = trained_and_saved
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
    (x,), (y,) = _batches(family, vocab)[1]
    loaded.eval()
    with torch.no_grad():
        loss = autopar.lm_cross_entropy(loaded(x).logits, y)
    for res in ranks:
        torch.testing.assert_close(torch.tensor(res[family]["loss"]), loss, **LOSS_TOLERANCE)


@pytest.mark.multiprocess
def test_save_pretrained_buffers_and_untraced_parameters(trained_and_saved):
    """A model that is not HuggingFace's, at pp=2 x dp=2: its state_dict exactly, in two stage files
    written by replica 0's ranks only, no config; strict ``load_state_dict`` of the files
    reproduces the engine's weights and loss."""
    from safetensors.torch import load_file

    root, ranks = trained_and_saved
    out, state = root / "buffers", ranks[0]["buffers"]["state"]
    model, vocab = _export_model("buffers")
    assert sorted(os.listdir(out)) == ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors",
                                       "model.safetensors.index.json"]
    assert [res["buffers"]["coords"] for res in ranks] == [(0, 0, 0), (0, 1, 0), (1, 0, 0), (1, 1, 0)]
    assert [res["buffers"]["written"] for res in ranks] == [
        ["model-00001-of-00002.safetensors", "model.safetensors.index.json"], [],
        ["model-00002-of-00002.safetensors"], []]
    weight_map = json.loads((out / "model.safetensors.index.json").read_text())["weight_map"]
    assert list(state) == list(model.state_dict()) and set(weight_map) == set(state) and len(state) == 14
    assert "offset" not in weight_map  # non-persistent
    assert {weight_map[k] for k in ("scale", "emb.weight", "unused.weight")} == {"model-00001-of-00002.safetensors"}
    assert weight_map["head.weight"] == "model-00002-of-00002.safetensors"
    files = {}
    for name in set(weight_map.values()):
        files.update(load_file(out / name))
    fresh, _ = _export_model("buffers")
    result = fresh.load_state_dict(files, strict=True)
    assert not result.missing_keys and not result.unexpected_keys
    for name, value in state.items():
        assert torch.equal(files[name], value), name
    assert torch.equal(files["unused.weight"], model.unused.weight.detach())  # never trained, as the model holds it
    (x,), (y,) = _batches("buffers", vocab)[1]
    with torch.no_grad():
        loss = autopar.lm_cross_entropy(fresh(x), y)
    torch.testing.assert_close(torch.tensor(ranks[0]["buffers"]["loss"]), loss, **LOSS_TOLERANCE)


@pytest.mark.multiprocess
def test_save_pretrained_failures_reach_every_rank(trained_and_saved):
    """A path that is a file: every rank refuses before any gather (CheckpointError). A writer that fails mid-way (its
    file's name taken by a directory): every rank raises ExportError naming that rank (2: stage 1's
    writer), none is left waiting on it."""
    _, ranks = trained_and_saved
    for res in ranks:
        as_file, blocked = res["buffers"]["failures"]
        assert as_file.startswith("CheckpointError") and "is a file" in as_file and "rank 0" in as_file, as_file
        assert blocked.startswith("ExportError") and "rank 2: IsADirectoryError" in blocked, blocked
        assert "rank 0" not in blocked and "rank 1" not in blocked and "rank 3" not in blocked, blocked

# ------------------------------------------------------------------ autopar export CKPT --to-hf DIR
def _export(capsys, *argv) -> tuple[int, list[str]]:
    """``autopar export ...``: its exit code and output lines."""
    code = cli_main(["export", *map(str, argv)])
    return code, capsys.readouterr().out.splitlines()


def test_cli_export_gpt2_in_several_files(tmp_path, capsys):
    """A tied GPT-2 cut into files of at most 150 KB: an index, one progress line per file, the
    keys HuggingFace writes, and from_pretrained loading it strictly and bitwise."""
    model, _ = make("hf-gpt2")
    saved_tensors = write_contract_checkpoint(model, tmp_path / "ckpt")
    code, lines = _export(capsys, tmp_path / "ckpt", "--to-hf", tmp_path / "hf", "--max-shard-size", "150KB")
    assert code == 0, lines
    index = json.loads((tmp_path / "hf" / "model.safetensors.index.json").read_text())
    files = sorted(set(index["weight_map"].values()))
    assert len(files) >= 3 and all((tmp_path / "hf" / f).stat().st_size <= 150_000 + 30_000 for f in files)
    assert len([line for line in lines if re.match(r"\[\d+/\d+\] model-", line)]) == len(files)
    assert set(index["weight_map"]) == _hf_saved_keys(model, tmp_path / "hf-own")
    assert index["metadata"]["total_size"] == sum(v.numel() * 4 for k, v in saved_tensors.items()
                                                  if k != "lm_head.weight")
    loaded, info = _from_pretrained(tmp_path / "hf")
    _assert_loads_strictly(info, "gpt2 export")
    got = loaded.state_dict()
    assert got.keys() == saved_tensors.keys() and all(torch.equal(got[k], v) for k, v in saved_tensors.items())


@pytest.mark.parametrize("family", ["hf-llama", "buffers"])
def test_cli_export_one_file(family, tmp_path, capsys):
    """A step directory named directly, default size: one ``model.safetensors`` holding the
    state_dict's tensors (persistent buffers, never-read parameters; config.json for a HF model);
    the weight files and index of an earlier export into the directory removed."""
    from safetensors.torch import load_file

    model, _ = _export_model(family)
    saved_tensors = write_contract_checkpoint(model, tmp_path / "ckpt", step=7)
    (tmp_path / "hf").mkdir()
    for stale in ("model-00001-of-00003.safetensors", "model.safetensors.index.json"):
        (tmp_path / "hf" / stale).write_text("an earlier export")
    code, lines = _export(capsys, tmp_path / "ckpt" / "step-00000007", "--to-hf", tmp_path / "hf")
    assert code == 0, lines
    written = sorted(os.listdir(tmp_path / "hf"))
    if family == "buffers":
        assert written == ["model.safetensors"]
        tensors = load_file(tmp_path / "hf" / "model.safetensors")
        assert sorted(tensors) == sorted(saved_tensors) and "offset" not in tensors
        assert all(torch.equal(tensors[k], v) for k, v in saved_tensors.items())
        return
    assert written == ["config.json", "generation_config.json", "model.safetensors"]
    assert json.loads((tmp_path / "hf" / "config.json").read_text())["architectures"] == ["LlamaForCausalLM"]
    loaded, info = _from_pretrained(tmp_path / "hf")
    _assert_loads_strictly(info, "llama export")
    got = loaded.state_dict()
    assert got.keys() == saved_tensors.keys() and all(torch.equal(got[k], v) for k, v in saved_tensors.items())


def test_cli_export_refuses_bad_input(tmp_path, capsys):
    """Each bad input: exit code 2, a message naming what is wrong, nothing written."""
    model, _ = _export_model("buffers")
    write_contract_checkpoint(model, tmp_path / "ckpt")
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "latest").write_text("step-00000009")
    mismatched = tmp_path / "mismatched"
    write_contract_checkpoint(_export_model("buffers")[0], mismatched)
    manifest_path = mismatched / "step-00000003" / "autopar.json"
    manifest = json.loads(manifest_path.read_text())
    manifest["params"]["head.weight"] = [64, 17]
    manifest_path.write_text(json.dumps(manifest))
    cases = [
        (tmp_path / "ckpt" / "step-00000013.partial", "is an unfinished or interrupted save"),
        (tmp_path, "neither autopar.json"),
        (broken, "names 'step-00000009'"),
        (mismatched, "'model.head.weight' has shape [64, 16], autopar.json says [64, 17]"),
    ]
    for path, why in cases:
        code, lines = _export(capsys, path, "--to-hf", tmp_path / "out")
        # the message wraps at the terminal's width, which the temporary path's length moves
        assert code == 2 and why in " ".join(" ".join(lines).split()), (path, lines)
    code, lines = _export(capsys, tmp_path / "ckpt", "--to-hf", tmp_path / "out", "--max-shard-size", "5 parsecs")
    assert code == 2 and "is not a size" in " ".join(lines)
    assert not (tmp_path / "out").exists()


_PEAK_MEMORY = """
import sys
import torch.distributed.checkpoint  # the export imports it on first use: code, not the export's data
from autopar.runtime.hf.export_checkpoint import export_checkpoint

def kib(field):
    return next(int(line.split()[1]) for line in open("/proc/self/status") if line.startswith(field))

open("/proc/self/clear_refs", "w").write("5")  # the peak (VmHWM) restarts from the current size
before = kib("VmRSS")
export_checkpoint(sys.argv[1], sys.argv[2])
print((kib("VmHWM") - before) * 1024)
"""


@pytest.mark.skipif(not os.access("/proc/self/clear_refs", os.W_OK), reason="needs Linux's /proc peak-memory reset")
def test_cli_export_memory_stays_near_the_largest_tensor(tmp_path):
    """24 tensors of 8 MiB (192 MiB): the export's peak memory grows by a few times the largest
    tensor, not by the model (measured 36-44 MiB: DCP's read buffer, the tensor it deserialises
    and the one it fills, and the allocator's reuse of them)."""
    n, rows, cols = 24, 2048, 1024
    params = {f"layers.{i}.weight": torch.randn(rows, cols) for i in range(n)}
    step = tmp_path / "step-00000001"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save({f"model.{k}": v for k, v in params.items()}, checkpoint_id=step, no_dist=True)
    (step / "autopar.json").write_text(json.dumps({"format": 1, "step": 1, "aliases": {}, "buffers": {},
                                                   "params": {k: [rows, cols] for k in params}, "hf_config": None}))
    total, largest = n * rows * cols * 4, rows * cols * 4
    del params
    run = subprocess.run([sys.executable, "-c", _PEAK_MEMORY, str(step), str(tmp_path / "hf")], capture_output=True,
                         text=True, env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}, timeout=300,
                         check=False)
    assert run.returncode == 0, run.stderr[-2000:]
    growth = int(run.stdout.split()[-1])
    assert (tmp_path / "hf" / "model.safetensors").stat().st_size > total
    assert growth < 8 * largest, (f"peak memory grew by {growth / 2**20:.0f} MiB for a {total / 2**20:.0f} MiB "
                                  f"model of {largest / 2**20:.0f} MiB tensors (the bound: a third of the model)")
