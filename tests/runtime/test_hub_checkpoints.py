"""HuggingFace checkpoints as transformers writes them: its conversion mapping applied, damaged files named.

A tiny GPT-NeoX (whose ``save_pretrained`` stores the LM head as
``embed_out``, transformers' conversion mapping renaming it to ``lm_head`` on
load) and a tiny Llama (a sharded index) are written by the installed
transformers' ``save_pretrained``, rebuilt on the meta device from their config
and compiled at tp=2 x pp=2. In one spawn of four ranks each loads its slices
(``materialize(checkpoint=dir)``), evaluates a batch and exports
(``engine.save_pretrained``); the eval loss equals
``AutoModelForCausalLM.from_pretrained(dir)``'s in eval mode on the same batch,
and ``from_pretrained`` of the export loads strictly, with the names and shapes
transformers itself wrote, every tensor equal. In the same spawn, three damaged
copies of GPT-NeoX's file (truncated, a header that is not JSON, a header
whose offsets do not fit its tensors) fail on every rank with a
``CheckpointError`` naming the file and the numbers.

In this process: a BERT decoder whose LayerNorms are stored under the legacy
names ``gamma``/``beta`` loads (transformers' ``legacy`` renames); a Mixtral
checkpoint, one tensor per expert, is read into the model's stacked experts as
slices of each expert's tensor only; an operation the conversion cannot slice
reads its sources whole and says so in the log.
"""

from __future__ import annotations

import json
import logging
import shutil
import struct
from pathlib import Path

import pytest
import torch
from families import BATCH, SEQ, _hf_llama, batches, tiny_mixtral
from helpers import compiled, meta_model_from, spawn_ranks, write_contract_checkpoint
from safetensors import safe_open
from safetensors.torch import load_file, save_file

import autopar
from autopar.core.tensor_placement import Shard
import autopar.runtime.hf.weights_in as weights_in
from autopar.runtime.checkpoint.errors import CheckpointError
from autopar.runtime.hf.conversion import Leaf, Reads
from autopar.runtime.hf.weights_in import HFCheckpoint
from autopar.runtime.weights.shards import assemble

# The loaded model's loss (one device, eval mode) against the engine's on the same batch at tp=2 x
# pp=2: the same fp32 weights, bitwise (asserted through the export); the ranks only sum the same
# terms in another order (split matmuls, all-reduces, the vocabulary-parallel cross-entropy), so the
# two agree to fp32 rounding of a loss near log(V) ~ 5.8.
LOSS_TOLERANCE = {"rtol": 1e-5, "atol": 1e-6}
VOCAB = 320


def _hf_gpt_neox(vocab: int = VOCAB, layers: int = 2):
    import transformers

    cfg = transformers.GPTNeoXConfig(vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
                                     num_attention_heads=4, max_position_embeddings=SEQ, rotary_pct=0.25,
                                     hidden_dropout=0.0, attention_dropout=0.0, bos_token_id=0, eos_token_id=0)
    return transformers.GPTNeoXForCausalLM(cfg)


MODELS = {"gpt-neox": _hf_gpt_neox, "llama": lambda: _hf_llama(VOCAB)}
BROKEN = ("truncated", "not-json", "bad-offsets")


def _hub_batch():
    """One global batch: 2 microbatches of BATCH rows."""
    return batches(VOCAB, steps=1, seed=5, rows=BATCH * 2)[0]


def _header(path: Path) -> tuple[int, dict]:
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        return n, json.loads(f.read(n))


def _break(source: Path, root: Path) -> dict[str, Path]:
    """Three damaged copies of ``source``'s directory, each under its kind's name."""
    out = {}
    for kind in BROKEN:
        shutil.copytree(source, root / kind)
        out[kind] = root / kind
    file = root / "truncated" / "model.safetensors"
    file.write_bytes(file.read_bytes()[:-100])
    file = root / "not-json" / "model.safetensors"
    data = bytearray(file.read_bytes())
    data[8:9] = b"#"  # the header's opening brace
    file.write_bytes(bytes(data))
    file = root / "bad-offsets" / "model.safetensors"
    n, header = _header(file)
    key = next(k for k in sorted(header) if k != "__metadata__")
    header[key]["data_offsets"][1] += 4  # one element more than its shape holds
    text = json.dumps(header, separators=(",", ":")).encode()
    assert len(text) <= n
    data = bytearray(file.read_bytes())
    data[8:8 + n] = text + b" " * (n - len(text))
    file.write_bytes(bytes(data))
    return out


@pytest.fixture(scope="module")
def hub_dirs(tmp_path_factory) -> dict[str, Path]:
    """Each model written by transformers' save_pretrained, and the damaged copies of GPT-NeoX's."""
    root = tmp_path_factory.mktemp("hub")
    out = {}
    for name, factory in MODELS.items():
        torch.manual_seed(11)
        factory().save_pretrained(root / name, max_shard_size="60KB" if name == "llama" else "100MB")
        out[name] = root / name
    out.update(_break(out["gpt-neox"], root))
    return out


def _hub_program(paths: dict[str, Path], name: str) -> autopar.ParallelProgram:
    """The model of ``paths[name]``'s config on the meta device, compiled at tp=2 x pp=2 (once per test and
    process)."""
    (x,), (y,) = _hub_batch()
    return compiled(meta_model_from(paths[name]), tp=2, pp=2, example_inputs=(x[:BATCH],), example_targets=y[:BATCH])


def _load_evaluate_and_export(paths: dict[str, Path], out_root: Path, programs: dict) -> dict:
    """On each rank: ``programs`` (compiled in the test process, inherited by the fork) loaded from
    their checkpoints, evaluated and exported; the damaged copies loaded into GPT-NeoX's."""
    (x,), (y,) = _hub_batch()
    out = {}
    for name in MODELS:
        program = programs[name]
        engine = program.materialize(checkpoint=paths[name])
        out[name] = engine.eval_step(x, y)
        engine.save_pretrained(str(out_root / name))
        if name == "gpt-neox":
            for kind in BROKEN:
                try:
                    program.materialize(checkpoint=paths[kind])
                    out[kind] = ""
                except Exception as e:  # noqa: BLE001 - every rank's error is checked
                    out[kind] = f"{type(e).__name__}: {e}"
    return out


@pytest.fixture(scope="module")
def hub_runs(hub_dirs, tmp_path_factory) -> tuple[Path, list[dict]]:
    root = tmp_path_factory.mktemp("exported")
    programs = {name: _hub_program(hub_dirs, name) for name in MODELS}  # compiled once, here
    return root, spawn_ranks(_load_evaluate_and_export, 4, hub_dirs, root, programs, timeout_s=600)


def _stored(path: Path) -> dict[str, tuple[int, ...]]:
    """Every tensor's name and shape in a HuggingFace directory (one file or an index)."""
    index = path / "model.safetensors.index.json"
    files = set(json.loads(index.read_text())["weight_map"].values()) if index.exists() else {"model.safetensors"}
    out = {}
    for file in files:
        with safe_open(path / file, "pt") as f:
            out.update({k: tuple(f.get_slice(k).get_shape()) for k in f.keys()})
    return out


def test_gpt_neox_is_stored_under_transformers_names(hub_dirs):
    """What makes this case: the file has ``embed_out.weight``, the model ``lm_head.weight``."""
    stored = _stored(hub_dirs["gpt-neox"])
    assert "embed_out.weight" in stored and "lm_head.weight" not in stored
    assert "lm_head.weight" in meta_model_from(hub_dirs["gpt-neox"]).state_dict()


@pytest.mark.multiprocess
@pytest.mark.parametrize("name", MODELS)
def test_loads_and_evaluates_like_from_pretrained(hub_dirs, hub_runs, name):
    import transformers

    _, ranks = hub_runs
    model = transformers.AutoModelForCausalLM.from_pretrained(hub_dirs[name]).eval()
    (x,), (y,) = _hub_batch()
    with torch.no_grad():
        want = autopar.lm_cross_entropy(model(x).logits, y)
    for rank, r in enumerate(ranks):
        torch.testing.assert_close(torch.tensor(r[name]), want, **LOSS_TOLERANCE, msg=f"{name} rank {rank}")


@pytest.mark.multiprocess
@pytest.mark.parametrize("name", MODELS)
def test_export_is_what_save_pretrained_writes(hub_dirs, hub_runs, name):
    import transformers

    root, _ = hub_runs
    assert _stored(root / name) == _stored(hub_dirs[name])  # transformers' own names and shapes (embed_out)
    want = transformers.AutoModelForCausalLM.from_pretrained(hub_dirs[name]).state_dict()
    got, info = transformers.AutoModelForCausalLM.from_pretrained(root / name, output_loading_info=True)
    problems = {k: v for k, v in info.items() if k != "conversion_errors" and v}
    assert not problems and not info.get("conversion_errors"), problems
    got = got.state_dict()
    assert got.keys() == want.keys()
    for key, value in want.items():
        assert torch.equal(got[key], value), key


@pytest.mark.multiprocess
def test_damaged_files_are_named_on_every_rank(hub_dirs, hub_runs):
    _, ranks = hub_runs
    file = hub_dirs["truncated"] / "model.safetensors"
    n, header = _header(hub_dirs["gpt-neox"] / "model.safetensors")
    need = max(v["data_offsets"][1] for k, v in header.items() if k != "__metadata__")
    found = file.stat().st_size - 8 - n
    assert need - found == 100
    for rank, r in enumerate(ranks):
        for kind in BROKEN:
            assert r[kind].startswith("CheckpointError: ") and str(hub_dirs[kind] / "model.safetensors") in r[kind], \
                (rank, kind, r[kind])
        assert f"truncated: its header's tensors need {need} bytes of data, found {found}" in r["truncated"], \
            (rank, r["truncated"])
        assert "corrupt header" in r["not-json"] and "not JSON" in r["not-json"], (rank, r["not-json"])
        assert "corrupt header" in r["bad-offsets"] and "bad offsets" in r["bad-offsets"], (rank, r["bad-offsets"])


# ------------------------------------------------------------------ in this process
def _hf_bert_decoder():
    import transformers

    cfg = transformers.BertConfig(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                                  intermediate_size=128, max_position_embeddings=SEQ, is_decoder=True,
                                  hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    return transformers.BertLMHeadModel(cfg)


def test_legacy_gamma_beta_names_load(tmp_path):
    """LayerNorms stored as ``gamma``/``beta`` (older checkpoints): transformers' ``legacy`` renames
    apply, as in ``from_pretrained``; the weights are the original's, the eval loss from_pretrained's."""
    import transformers

    torch.manual_seed(3)
    original = _hf_bert_decoder()
    original.save_pretrained(tmp_path / "new")
    tensors = load_file(tmp_path / "new" / "model.safetensors")
    legacy = {k.replace("LayerNorm.weight", "LayerNorm.gamma").replace("LayerNorm.bias", "LayerNorm.beta"): v
              for k, v in tensors.items()}
    renamed = sorted(set(legacy) - set(tensors))
    assert len(renamed) == 2 * 6 and all(k.endswith(("LayerNorm.gamma", "LayerNorm.beta")) for k in renamed)
    (tmp_path / "legacy").mkdir()
    shutil.copy(tmp_path / "new" / "config.json", tmp_path / "legacy" / "config.json")
    save_file(legacy, tmp_path / "legacy" / "model.safetensors", metadata={"format": "pt"})

    (x,), (y,) = _hub_batch()
    program = autopar.parallelize(meta_model_from(tmp_path / "legacy"), example_inputs=(x,), example_targets=y)
    engine = program.materialize(checkpoint=tmp_path / "legacy")
    got = engine.full_state_dict()
    for key, value in original.state_dict().items():
        assert torch.equal(got[key], value), key
    reference = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "legacy").eval()
    with torch.no_grad():
        want = autopar.lm_cross_entropy(reference(x).logits, y)
    torch.testing.assert_close(torch.tensor(engine.eval_step(x, y)), want, **LOSS_TOLERANCE)


def _mixtral():
    return tiny_mixtral(seed=None)  # the caller's random state decides the weights


def test_stacked_experts_read_as_slices_of_each_expert(tmp_path, monkeypatch):
    """Mixtral's checkpoint holds ``experts.{i}.w1/w3/w2`` per expert; the model one stacked
    ``gate_up_proj`` [E, 2I, H] (w1 and w3 concatenated) and ``down_proj``. A shard along any dim
    is read as slices of the expert tensors, exactly the shard's bytes, and equals
    ``from_pretrained``'s parameter's shard."""
    import transformers

    torch.manual_seed(5)
    _mixtral().save_pretrained(tmp_path)
    want = transformers.AutoModelForCausalLM.from_pretrained(tmp_path).state_dict()
    with torch.device("meta"):
        meta = _mixtral()
    log = []
    original = weights_in.safe_open

    class Logged:
        def __init__(self, handle):
            self.handle = handle

        def get_slice(self, key):
            piece = self.handle.get_slice(key)

            class Slice:
                def __getitem__(self, index):
                    t = piece[index]
                    log.append((key, t.numel() * t.element_size()))
                    return t

            return Slice()

        def get_tensor(self, key):  # an expert's whole tensor, where the shard needs all of it
            t = self.handle.get_tensor(key)
            log.append((key, t.numel() * t.element_size()))
            return t

    ckpt = HFCheckpoint.open(tmp_path)
    view = ckpt.view(meta)
    assert any("gate_up_proj" in c for c in ckpt.conversions)
    monkeypatch.setattr(weights_in, "safe_open", lambda file, **kw: Logged(original(file, **kw)))
    for name in ("model.layers.0.mlp.experts.gate_up_proj", "model.layers.0.mlp.experts.down_proj"):
        source = view[name]
        assert source.sliceable and len(source.leaves()) == 4 * (2 if "gate_up" in name else 1)
        for dim in range(3):
            for rank in range(2):
                log.clear()
                spec = Shard(dim)
                with ckpt.opened(torch.device("cpu")):
                    shard = assemble(ckpt.reader(source, spec, torch.float32, name), tuple(source.shape), spec,
                                     rank, 2, torch.float32, torch.device("cpu"))
                assert torch.equal(shard, want[name].chunk(2, dim)[rank]), (name, dim, rank)
                assert sum(nbytes for _, nbytes in log) == shard.numel() * 4, (name, dim, rank, log)
                assert {key for key, _ in log} <= {leaf.key for leaf in source.leaves()}


def test_an_operation_that_cannot_be_sliced_reads_whole_and_says_so(caplog):
    """A conversion outside re-arrangements (here a flip): its shape from the meta device, its value
    from its source read whole, once per shard, and a log line naming the parameter and the op."""
    value = torch.arange(24.0).reshape(6, 4)
    leaf = Leaf("stored.weight", value.to("meta"))
    flipped = torch.flip(leaf, dims=[0])
    both = torch.cat([flipped, leaf], dim=1)
    assert tuple(both.shape) == (6, 8) and not both.sliceable and both.deferred() == ["flip"]
    reads_log = []
    reads = Reads(lambda lf, region: reads_log.append(region) or (value if region is None else
                                                                  value[tuple(slice(a, b) for a, b in region)]))
    assert torch.equal(both.read(((2, 5), (3, 6)), reads), torch.cat([value.flip(0), value], 1)[2:5, 3:6])
    assert reads_log == [None, ((2, 5), (0, 2))]  # the flip's input whole, the plain one as a slice

    ckpt = HFCheckpoint(Path("ckpt"), {})
    ckpt._reads = reads
    with caplog.at_level(logging.WARNING, logger="autopar.runtime.hf.weights_in"):
        ckpt.reader(both, Shard(0), torch.float32, "layer.weight")
    assert "'layer.weight' is made by transformers' conversion with flip" in caplog.text
    assert "['stored.weight'] are read whole" in caplog.text


def test_a_damaged_file_fails_before_any_read(tmp_path):
    """The header check in one process: a file shorter than its 8-byte length field, and a header
    length past the end of the file."""
    (tmp_path / "model.safetensors").write_bytes(b"\x01\x02")
    with pytest.raises(CheckpointError, match=r"model.safetensors: truncated: .* expected at least 8 bytes, found 2"):
        HFCheckpoint.open(tmp_path)
    (tmp_path / "model.safetensors").write_bytes(struct.pack("<Q", 1000) + b"{}")
    with pytest.raises(CheckpointError, match=r"the header length says 1000 bytes of header, found 2 bytes"):
        HFCheckpoint.open(tmp_path)


def test_cli_export_writes_what_save_pretrained_writes(tmp_path):
    """``autopar export CKPT --to-hf DIR`` of a GPT-NeoX checkpoint: transformers' own names
    (``embed_out``) and shapes, and ``from_pretrained`` of it holds the checkpoint's weights."""
    import transformers

    from autopar.runtime.hf.export_checkpoint import export_checkpoint

    torch.manual_seed(2)
    model = _hf_gpt_neox()
    saved_tensors = write_contract_checkpoint(model, tmp_path / "ckpt")
    export_checkpoint(str(tmp_path / "ckpt"), str(tmp_path / "hf"))
    model.save_pretrained(tmp_path / "own")
    assert _stored(tmp_path / "hf") == _stored(tmp_path / "own") and "embed_out.weight" in _stored(tmp_path / "hf")
    got = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf").state_dict()
    assert got.keys() == saved_tensors.keys() and all(torch.equal(got[k], v) for k, v in saved_tensors.items())
