"""HuggingFace safetensors checkpoints loaded slice by slice: ``materialize(checkpoint=path)``.

A tiny Llama (saved with a small ``max_shard_size``: a sharded index of
several files) and a tiny GPT-2 (one ``model.safetensors``; a tied LM head
absent from the file, a vocabulary of 257 padded to 258, a fused QKV whose
three segments are each split) are saved with ``save_pretrained``, rebuilt on
the meta device from their config and compiled at tp=2 x pp=2. In one spawn of
four ranks, each loads its slices and trains one step: the loss and every
gradient equal ``AutoModelForCausalLM.from_pretrained(path)``'s on one device
(fp32: the parallel run only reorders sums, FP32_TOLERANCE). Every read goes
through a counting wrapper of ``safe_open``: a rank reads exactly the
parameters its stage holds, a sharded one only as slices and never more bytes
than its shard, a replicated one whole. A checkpoint missing a tensor, or
holding one of another shape, fails on every rank before any work, naming the
file, the parameter and both shapes.

In this process: a checkpoint of the base model (``GPT2Model``, names without
the ``transformer.`` prefix) loads into the model with a head; a directory
without a checkpoint and parameters passed twice are refused.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from families import BATCH, SEQ, _hf_gpt2, _hf_llama, batches, train_steps
from helpers import assert_ranks_match, compiled, meta_model_from, reference_run, spawn_ranks
from safetensors.torch import load_file, save_file

import autopar
from autopar.core.errors import AutoparError
from autopar.core.tensor_placement import Shard
import autopar.runtime.hf.weights_in as weights_in

MODELS = {"llama": (lambda: _hf_llama(320), 320), "gpt2": (lambda: _hf_gpt2(257), 257)}


def _one_step_batches(vocab: int):
    return batches(vocab, steps=1, seed=3, rows=BATCH * 2)  # tp=2 x pp=2: 2 microbatches of BATCH rows


@pytest.fixture(scope="module")
def pretrained_dirs(tmp_path_factory) -> dict[str, Path]:
    """The checkpoints: llama (sharded index), gpt2 (one file), and two broken copies of gpt2's."""
    root = tmp_path_factory.mktemp("checkpoints")
    out = {}
    for name, (factory, _) in MODELS.items():
        torch.manual_seed(7)
        model = factory()
        model.save_pretrained(root / name, max_shard_size="60KB" if name == "llama" else "100MB")
        out[name] = root / name
    tensors = load_file(root / "gpt2" / "model.safetensors")
    missing = {k: v for k, v in tensors.items() if k != "transformer.h.1.mlp.c_proj.weight"}
    reshaped = {**tensors, "transformer.h.0.attn.c_attn.weight": tensors["transformer.h.0.attn.c_attn.weight"][:, :96]}
    for name, content in (("missing", missing), ("reshaped", reshaped)):
        (root / name).mkdir()
        save_file({k: v.contiguous() for k, v in content.items()}, root / name / "model.safetensors")
        out[name] = root / name
    return out


class _Counting:
    """``safe_open`` whose reads are logged as (tensor, 'slice' | 'whole', bytes)."""

    def __init__(self, handle, log: list):
        self.handle, self.log = handle, log

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return self.handle.__exit__(*exc) if hasattr(self.handle, "__exit__") else None

    def keys(self):
        return self.handle.keys()

    def get_tensor(self, key):
        t = self.handle.get_tensor(key)
        self.log.append((key, "whole", t.numel() * t.element_size()))
        return t

    def get_slice(self, key):
        piece, log = self.handle.get_slice(key), self.log

        class Slice:
            get_shape, get_dtype = piece.get_shape, piece.get_dtype

            def __getitem__(self, index):
                t = piece[index]
                log.append((key, "slice", t.numel() * t.element_size()))
                return t

        return Slice()


def _load_counting(program, path: Path) -> tuple:
    log: list = []
    original = weights_in.safe_open
    weights_in.safe_open = lambda file, **kwargs: _Counting(original(file, **kwargs), log)
    try:
        engine = program.materialize(checkpoint=path)
    finally:
        weights_in.safe_open = original
    return engine, log


def _hf_load_program(paths: dict[str, Path], name: str):
    """The model of ``paths[name]``'s config on the meta device, compiled at tp=2 x pp=2 (once per test and
    process); its one-step batches."""
    data = _one_step_batches(MODELS[name][1])
    x = data[0][0][0][:BATCH]
    return compiled(meta_model_from(paths[name]), tp=2, pp=2, example_inputs=(x,), example_targets=x), data


def _load_and_train_every_model(paths: dict[str, Path], programs: dict):
    """On each rank: ``programs`` (compiled in the test process, inherited by the fork) loaded from
    their checkpoints and trained; every read logged."""
    out = {}
    for name in MODELS:
        program, data = programs[name]
        engine, log = _load_counting(program, paths[name])
        local = {n: p.numel() * p.element_size() for n, p in engine.named_local_parameters()}
        full = {n: program.full_shape(n) for n in program.param_names}
        sharded = {n for n in program.param_names if isinstance(program.param_spec(n), Shard)}
        out[name] = {"log": log, "local": local, "sharded": sharded, "full": full,
                     "steps": train_steps(engine, data, lr=1e-3)}
        if name == "gpt2":
            out["errors"] = {}
            for broken in ("missing", "reshaped"):
                try:
                    program.materialize(checkpoint=paths[broken])
                except Exception as e:  # noqa: BLE001 - every rank's error is checked
                    out["errors"][broken] = f"{type(e).__name__}: {e}"
    return out


@pytest.fixture(scope="module")
def loaded_runs(pretrained_dirs):
    programs = {name: _hf_load_program(pretrained_dirs, name) for name in MODELS}  # compiled once, here
    return spawn_ranks(_load_and_train_every_model, 4, pretrained_dirs, programs, timeout_s=600)


@pytest.mark.multiprocess
@pytest.mark.parametrize("name", MODELS)
def test_loaded_slices_train_like_from_pretrained(pretrained_dirs, loaded_runs, name):
    import transformers

    if name == "llama":  # the small max_shard_size made a sharded checkpoint
        assert (pretrained_dirs[name] / "model.safetensors.index.json").exists()
        assert len(list(pretrained_dirs[name].glob("model-*.safetensors"))) > 2
    model = transformers.AutoModelForCausalLM.from_pretrained(pretrained_dirs[name])
    reference = reference_run(model, _one_step_batches(MODELS[name][1]), lr=1e-3)
    # fp32; the ranks only sum the same terms in another order (split matmuls, all-reduces, the
    # vocabulary-parallel cross-entropy): FP32_TOLERANCE, rtol 1e-5 and atol 1e-6
    assert_ranks_match(reference, [r[name]["steps"] for r in loaded_runs],
                       label=f"hf-{name} from {pretrained_dirs[name].name}")


@pytest.mark.multiprocess
@pytest.mark.parametrize("name", MODELS)
def test_each_rank_reads_only_its_slices(loaded_runs, name):
    for rank, r in enumerate(loaded_runs):
        log, local, sharded = r[name]["log"], r[name]["local"], r[name]["sharded"]
        read = {}
        for key, kind, nbytes in log:
            read.setdefault(key, []).append((kind, nbytes))
        assert set(read) == set(local), (rank, sorted(set(read) ^ set(local)))  # exactly its stage's parameters
        for key, reads in read.items():
            total = sum(nbytes for _, nbytes in reads)
            full = 4 * torch.Size(r[name]["full"][key]).numel()
            if key in sharded:  # slices only, at most the shard (padding rows are not read), less than whole
                assert all(kind == "slice" for kind, _ in reads), (rank, key, reads)
                assert 0 < total <= local[key] < full, (rank, key, total, local[key], full)
            else:
                assert reads == [("whole", local[key])] and local[key] == full, (rank, key, reads)
        assert sum(nbytes for _, _, nbytes in log) <= sum(local.values())
    assert any(key in r[name]["sharded"] for r in loaded_runs for key in r[name]["local"])


@pytest.mark.multiprocess
def test_a_broken_checkpoint_fails_every_rank_before_any_work(loaded_runs):
    for rank, r in enumerate(loaded_runs):
        errors = r["errors"]
        assert errors["missing"].startswith("CheckpointError") and \
            "transformer.h.1.mlp.c_proj.weight: in no file" in errors["missing"], (rank, errors["missing"])
        assert "transformer.h.0.attn.c_attn.weight: shape (64, 96) in model.safetensors" in errors["reshaped"] \
            and "the model's is (64, 192)" in errors["reshaped"], (rank, errors["reshaped"])


@pytest.fixture(scope="module")
def meta_gpt2_program() -> autopar.ParallelProgram:
    """GPT-2 (vocabulary 257) on the meta device compiled for one device: one compile for the tests that
    load into it."""
    x = torch.randint(0, 257, (BATCH, SEQ))
    return autopar.parallelize(_meta_from_model(), example_inputs=(x,), example_targets=x)


def test_a_base_model_checkpoint_loads_into_the_model_with_a_head(tmp_path, meta_gpt2_program):
    torch.manual_seed(7)
    full = _hf_gpt2(257)
    full.transformer.save_pretrained(tmp_path)  # GPT2Model: 'wte.weight', no 'transformer.' prefix, no head
    program = meta_gpt2_program
    got = program.materialize(checkpoint=tmp_path).full_state_dict()
    for key, value in full.named_parameters(remove_duplicate=False):
        assert torch.equal(got[key], value), key


def _meta_from_model():
    with torch.device("meta"):
        return _hf_gpt2(257)


def test_bad_checkpoint_arguments_are_refused(tmp_path, meta_gpt2_program):
    program = meta_gpt2_program
    with pytest.raises(FileNotFoundError, match="holds neither model.safetensors.index.json nor model.safetensors") \
            as missing:
        program.materialize(checkpoint=tmp_path)
    assert isinstance(missing.value, autopar.CheckpointError)  # CheckpointNotFoundError: both kinds
    weights = {n: torch.zeros(program.full_shape(n)) for n in program.param_names}
    with pytest.raises(ValueError, match="pass the parameters once") as twice:
        program.materialize(state_dict=weights, checkpoint=tmp_path)
    assert isinstance(twice.value, AutoparError)
