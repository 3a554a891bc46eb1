"""``autopar export CKPT --to-hf DIR``: a saved autopar checkpoint as a HuggingFace directory.

One process, no process group: each tensor is read through DCP
(``torch.distributed.checkpoint.load(..., no_dist=True)``) into a tensor of its
full shape and streamed into its safetensors file, one at a time, so memory
grows by a few copies of the largest parameter (DCP reads the bytes,
deserialises them, copies into ours), never by the model.

The checkpoint contract read here (the checkpoint writer's):

- ``CKPT`` is a checkpoint root (a ``latest`` file naming its newest complete
  step directory) or one step directory; ``*.partial`` directories are saves
  in progress and are refused;
- the step directory holds DCP's files and ``autopar.json``:
  ``{"format": 1, "params": {name: full shape}, "aliases": {name: [every name
  the model uses for it]}, "buffers": {name: shape}, "hf_config": dict | null}``;
- DCP key ``model.<name>`` holds each parameter, ``buffer.<name>`` each
  persistent buffer, whole, with the model's shapes (``optim.*`` is not read).

The file layout and the rules for tied weights and ignored keys are
``hf_layout``'s. For them, for ``config.json``, and for the names and layout
``save_pretrained`` writes (transformers' checkpoint conversion reversed,
``hf_conversion.saved_view``: GPT-NeoX's ``lm_head`` as ``embed_out``), the
model is built from ``hf_config`` on the meta device (no memory); files are cut
by size, as ``save_pretrained``'s ``max_shard_size`` does.
"""

from __future__ import annotations

import json
import math
import os
import warnings
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed.checkpoint as dcp
import torch.nn as nn
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from autopar.runtime.hf.layout import (
    FILE_METADATA,
    HFFile,
    check_output_dir,
    ignored_on_save,
    remove_stale_weight_files,
    tied_duplicates,
    tied_weight_patterns,
    weight_file_name,
    write_configs,
    write_index,
)
from autopar.runtime.checkpoint.errors import CheckpointError
from autopar.runtime.hf.conversion import Lazy, Leaf, Reads, Region, saved_view
from autopar.runtime.hf.safetensors_stream import SafetensorsStream, TensorEntry, check_dtype

__all__ = ["CheckpointError", "Manifest", "resolve_checkpoint", "read_manifest", "export_checkpoint"]

MANIFEST = "autopar.json"
LATEST = "latest"
FORMAT = 1
DEFAULT_MAX_SHARD_BYTES = 5 * 10**9
"""5 GB per file, the size the HuggingFace Hub serves best."""


@dataclass(frozen=True)
class Manifest:
    """``autopar.json`` of one step, checked."""

    step_dir: str
    params: dict[str, tuple[int, ...]]
    aliases: dict[str, list[str]]
    """Parameter -> every name the model gives it, its own first."""
    buffers: dict[str, tuple[int, ...]]
    hf_config: dict | None


def export_checkpoint(checkpoint: str, out: str, max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
                      progress: Callable[[str], None] = lambda line: None) -> list[str]:
    """Write the HuggingFace directory ``out`` from the checkpoint ``checkpoint``; the files written.
    ``progress`` gets one line per file (and a note when the model cannot be built)."""
    manifest = read_manifest(resolve_checkpoint(checkpoint))
    reader = dcp.FileSystemReader(manifest.step_dir)
    sources = _dcp_sources(manifest, reader.read_metadata())
    model, note = _model_skeleton(manifest)
    if note:
        progress(note)
    files, read_as = _files(manifest, sources, model, max_shard_bytes)
    problem = check_output_dir(out)
    if problem:
        raise CheckpointError(problem)
    remove_stale_weight_files(out, [f.name for f in files])
    progress(f"{manifest.step_dir}: {sum(len(f.entries) for f in files)} tensors, "
             f"{_size(sum(f.nbytes for f in files))} -> {out}, {len(files)} file(s)")
    reads = _Reads(reader)
    for k, file in enumerate(files, 1):
        with SafetensorsStream(os.path.join(out, file.name), list(file.entries), FILE_METADATA) as stream:
            for entry in file.entries:
                stream.write(entry.name, read_as[entry.name].whole(reads).contiguous())
        progress(f"[{k}/{len(files)}] {file.name}: {len(file.entries)} tensors, {_size(file.nbytes)}")
    return [f.name for f in files] + _directory_files(out, manifest, files, model)


def _size(nbytes: int) -> str:
    return f"{nbytes / 2**30:.2f} GiB" if nbytes >= 2**30 else f"{nbytes / 2**20:.1f} MiB"


def resolve_checkpoint(path: str) -> str:
    """The step directory ``path`` names: itself (it holds ``autopar.json``) or, for a checkpoint
    root, the step its ``latest`` file names."""
    if not os.path.isdir(path):
        raise CheckpointError(f"'{path}' is not a directory: name a checkpoint root (with a '{LATEST}' file) "
                              f"or one of its step directories")
    if os.path.basename(os.path.normpath(path)).endswith(".partial"):
        raise CheckpointError(f"'{path}' is a save in progress or an interrupted one (.partial): export a "
                              f"complete step, or the root to take the one '{LATEST}' names")
    if os.path.isfile(os.path.join(path, MANIFEST)):
        return path
    latest = os.path.join(path, LATEST)
    if not os.path.isfile(latest):
        raise CheckpointError(f"'{path}' is not an autopar checkpoint: it has neither {MANIFEST} (a step "
                              f"directory) nor a '{LATEST}' file (a checkpoint root)")
    with open(latest, encoding="utf-8") as f:
        step = f.read().strip()
    step_dir = os.path.join(path, step)
    if not step or not os.path.isfile(os.path.join(step_dir, MANIFEST)):
        raise CheckpointError(f"'{latest}' names '{step}', but {os.path.join(step_dir, MANIFEST)} does not "
                              f"exist: the checkpoint root is damaged; export a step directory directly")
    return step_dir


def read_manifest(step_dir: str) -> Manifest:
    """``step_dir/autopar.json``, checked: format, parameters, aliases, buffers, HF config."""
    where = os.path.join(step_dir, MANIFEST)
    try:
        with open(where, encoding="utf-8") as f:
            raw = json.load(f)
    except (OSError, json.JSONDecodeError) as e:
        raise CheckpointError(f"cannot read {where}: {e}") from None
    if raw.get("format") != FORMAT:
        raise CheckpointError(f"{where} has format {raw.get('format')!r}; this autopar reads format {FORMAT}")
    if not isinstance(raw.get("params"), dict) or not raw["params"]:
        raise CheckpointError(f"{where} lists no parameters ('params': {{name: shape}})")
    params = {name: tuple(shape) for name, shape in raw["params"].items()}
    listed = raw.get("aliases") or {}
    if not isinstance(listed, dict):
        raise CheckpointError(f"{where}: 'aliases' is a {type(listed).__name__}, not {{name: [names]}}")
    aliases = {name: [name] + [n for n in listed.get(name) or () if n != name] for name in params}
    hf_config = raw.get("hf_config")
    if hf_config is not None and not isinstance(hf_config, dict):
        raise CheckpointError(f"{where}: 'hf_config' is a {type(hf_config).__name__}, not a dict or null")
    buffers = {name: tuple(shape) for name, shape in (raw.get("buffers") or {}).items()}
    return Manifest(step_dir, params, aliases, buffers, hf_config)


@dataclass(frozen=True)
class _Source:
    """A tensor to export: its DCP key, shape and dtype."""

    key: str
    shape: tuple[int, ...]
    dtype: torch.dtype


def _dcp_sources(manifest: Manifest, metadata) -> dict[str, _Source]:
    """Canonical name -> its DCP tensor, for every parameter and buffer of the manifest; every
    one must be in the checkpoint, with the manifest's shape."""
    wanted = {name: (f"model.{name}", shape) for name, shape in manifest.params.items()}
    wanted.update({name: (f"buffer.{name}", shape) for name, shape in manifest.buffers.items()})
    stored = metadata.state_dict_metadata
    problems, out = [], {}
    for name, (key, shape) in wanted.items():
        meta = stored.get(key)
        if not isinstance(meta, TensorStorageMetadata):
            problems.append(f"'{key}' is missing")
        elif tuple(meta.size) != shape:
            problems.append(f"'{key}' has shape {list(meta.size)}, {MANIFEST} says {list(shape)}")
        else:
            out[name] = _Source(key, shape, meta.properties.dtype)
    if problems:
        raise CheckpointError(f"{manifest.step_dir}: the DCP files and {MANIFEST} disagree on {len(problems)} "
                              f"tensor(s): {'; '.join(problems[:5])}")
    return out


def _files(manifest: Manifest, sources: dict[str, _Source], model: nn.Module | None,
           max_shard_bytes: int) -> tuple[list[HFFile], dict[str, Lazy]]:
    """The weight files: every name the model gives each tensor, less tied duplicates and ignored
    keys, in the manifest's order, under the names ``save_pretrained`` writes, cut into files of
    at most ``max_shard_bytes`` (a larger tensor alone in its file); and written name -> its
    value over the DCP tensors (``Leaf.info``: the ``_Source``)."""
    skip, patterns = ignored_on_save(model), tied_weight_patterns(model)
    names = {name: manifest.aliases[name] for name in manifest.params}
    names.update({name: [name] for name in manifest.buffers})
    entries, read_as = [], {}
    for canonical, group in names.items():
        dropped = set(tied_duplicates(group, patterns))
        for name in group:
            if name not in dropped and name not in skip:
                source = sources[canonical]
                check_dtype(name, source.dtype)
                read_as[name] = Leaf(name, torch.empty(source.shape, dtype=source.dtype, device="meta"), source)
    read_as = saved_view(model, read_as)
    for name, value in read_as.items():
        check_dtype(name, value.dtype)
        entries.append(TensorEntry(name, tuple(value.shape), value.dtype))
    groups = _cut_by_size(entries, max_shard_bytes)
    return [HFFile(weight_file_name(k, len(groups)), tuple(g)) for k, g in enumerate(groups, 1)], read_as


def _cut_by_size(entries: list[TensorEntry], max_bytes: int) -> list[list[TensorEntry]]:
    """Consecutive runs of at most ``max_bytes`` each; a larger tensor alone in its run."""
    groups: list[list[TensorEntry]] = [[]]
    size = 0
    for entry in entries:
        if groups[-1] and size + entry.nbytes > max_bytes:
            groups.append([])
            size = 0
        groups[-1].append(entry)
        size += entry.nbytes
    return groups


class _Reads(Reads):
    """Reads of DCP tensors, whole; the last one kept (several written tensors may be made of it)."""

    def __init__(self, reader: dcp.FileSystemReader):
        super().__init__(self._fetch)
        self.reader = reader
        self._held: tuple[str | None, torch.Tensor | None] = (None, None)

    def _fetch(self, leaf: Leaf, region: Region | None) -> torch.Tensor:
        if self._held[0] != leaf.info.key:
            self._held = (None, None)
            self._held = (leaf.info.key, _read(self.reader, leaf.info))
        value = self._held[1]
        return value if region is None else value[tuple(slice(a, b) for a, b in region)]


def _read(reader: dcp.FileSystemReader, source: _Source) -> torch.Tensor:
    """One tensor, whole, read through DCP without a process group."""
    value = torch.empty(source.shape, dtype=source.dtype)
    with warnings.catch_warnings():  # DCP warns that it runs in one process, which is the intent here
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.load({source.key: value}, storage_reader=reader, no_dist=True)
    return value


def _directory_files(out: str, manifest: Manifest, files: list[HFFile], model: nn.Module | None) -> list[str]:
    """The index (more than one file) and ``config.json`` (and the generation config)."""
    written = []
    if len(files) > 1:
        write_index(out, files, sum(math.prod(shape) for shape in manifest.params.values()))
        written.append("model.safetensors.index.json")
    if manifest.hf_config is None:
        return written
    if model is not None:
        dtypes = [e.dtype for f in files for e in f.entries if e.dtype.is_floating_point]
        return written + write_configs(out, model, dtypes[0] if dtypes else None)
    with open(os.path.join(out, "config.json"), "w", encoding="utf-8") as f:
        f.write(json.dumps(manifest.hf_config, indent=2, sort_keys=True) + "\n")
    return written + ["config.json"]


def _model_skeleton(manifest: Manifest) -> tuple[nn.Module | None, str | None]:
    """The HuggingFace model of ``hf_config`` on the meta device, for its tied-weights declaration,
    ignored keys and configs; (None, why) when it cannot be built or its state_dict differs from
    the checkpoint's tensors (tied weights then keep their first name; config.json is hf_config)."""
    if manifest.hf_config is None:
        return None, None
    try:
        import transformers  # only a checkpoint of a HuggingFace model needs it

        fields = dict(manifest.hf_config)
        config = transformers.AutoConfig.for_model(fields.pop("model_type"), **fields)
        arch = (config.architectures or [None])[0]
        cls = getattr(transformers, arch, None) if arch else None
        with torch.device("meta"):
            model = cls(config) if cls is not None else transformers.AutoModelForCausalLM.from_config(config)
    except Exception as e:  # any failure to build: the export goes on without the model, and says so
        return None, (f"note: cannot build the model from hf_config ({type(e).__name__}: {e}); tied weights "
                      "keep their first name and config.json is hf_config as saved")
    expected = {alias: shape for name, shape in manifest.params.items() for alias in manifest.aliases[name]}
    expected.update(manifest.buffers)
    built = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    if built != expected:
        diff = sorted(set(built.items()) ^ set(expected.items()))[:3]
        return None, (f"note: {type(model).__name__} built from hf_config does not have the checkpoint's "
                      f"tensors (e.g. {diff}); tied weights keep their first name and config.json is hf_config "
                      "as saved")
    return model, None
