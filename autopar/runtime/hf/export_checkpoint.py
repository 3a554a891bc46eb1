"""``autopar export CKPT --to-hf DIR``: a saved autopar checkpoint as a HuggingFace directory.

One process, no process group: each tensor is read through DCP
(``torch.distributed.checkpoint.load(..., no_dist=True)``) into a tensor of its
full shape and streamed into its safetensors file, one at a time, so memory
grows by a few copies of the largest parameter (DCP reads the bytes,
deserialises them, copies into ours), never by the model.

The checkpoint is found and its ``autopar.json`` read by the checkpoint's own
``description`` (``resolve``: a root's ``latest`` step or a step directory,
never a ``*.partial`` save; ``read_model_description``: parameters with their
full shapes and every name the model gives them, persistent buffers, the
HuggingFace config). DCP key ``model.<name>`` holds each parameter,
``buffer.<name>`` each persistent buffer, whole (``optim.*`` is not read).

The file layout and the rules for tied weights and ignored keys are
``layout``'s. For them, for ``config.json``, and for the names and layout
``save_pretrained`` writes (transformers' checkpoint conversion reversed,
``conversion.saved_view``: GPT-NeoX's ``lm_head`` as ``embed_out``), the
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
from typing import TYPE_CHECKING

import torch
import torch.nn as nn

from autopar.runtime.checkpoint.description import (DESCRIPTION, CheckpointError, ModelDescription,
                                                    read_model_description, resolve)
from autopar.runtime.hf.conversion import Lazy, Leaf, Reads, Region, region_slices
from autopar.runtime.hf.layout import (FILE_METADATA, HFFile, check_output_dir, remove_stale_weight_files,
                                       saved_tensors, weight_file_name, write_directory_files)
from autopar.runtime.hf.safetensors_stream import SafetensorsStream, TensorEntry

if TYPE_CHECKING:  # torch.distributed.checkpoint is imported where a checkpoint is read: it brings in DTensor,
    import torch.distributed.checkpoint as dcp  # a second of start-up that a training rank does not need

__all__ = ["export_checkpoint"]

DEFAULT_MAX_SHARD_BYTES = 5 * 10**9
"""5 GB per file, the size the HuggingFace Hub serves best."""


def export_checkpoint(checkpoint: str, out: str, max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
                      progress: Callable[[str], None] = lambda line: None) -> list[str]:
    """Write the HuggingFace directory ``out`` from the checkpoint ``checkpoint``; the files written.
    ``progress`` gets one line per file (and a note when the model cannot be built)."""
    from autopar.runtime.checkpoint.safe_metadata import SafeReader

    saved = read_model_description(resolve(checkpoint))
    reader = SafeReader(saved.step_dir)  # DCP's reader, its metadata read as data (no code run)
    sources = _dcp_sources(saved, reader.read_metadata())
    model, note = _model_skeleton(saved)
    if note:
        progress(note)
    files, read_as = _files(saved, sources, model, max_shard_bytes)
    problem = check_output_dir(out)
    if problem:
        raise CheckpointError(problem)
    remove_stale_weight_files(out, [f.name for f in files])
    progress(f"{saved.step_dir}: {sum(len(f.entries) for f in files)} tensors, "
             f"{_size(sum(f.nbytes for f in files))} -> {out}, {len(files)} file(s)")
    reads = _Reads(reader)
    for k, file in enumerate(files, 1):
        with SafetensorsStream(os.path.join(out, file.name), list(file.entries), FILE_METADATA) as stream:
            for entry in file.entries:
                stream.write(entry.name, read_as[entry.name].whole(reads).contiguous())
        progress(f"[{k}/{len(files)}] {file.name}: {len(file.entries)} tensors, {_size(file.nbytes)}")
    return [f.name for f in files] + _directory_files(out, saved, files, model)


def _size(nbytes: int) -> str:
    return f"{nbytes / 2**30:.2f} GiB" if nbytes >= 2**30 else f"{nbytes / 2**20:.1f} MiB"


@dataclass(frozen=True)
class _Source:
    """A tensor to export: its DCP key, shape and dtype."""

    key: str
    shape: tuple[int, ...]
    dtype: torch.dtype


def _dcp_sources(saved: ModelDescription, metadata) -> dict[str, _Source]:
    """Canonical name -> its DCP tensor, for every parameter and buffer described; every one must
    be in the checkpoint, with the described shape."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    wanted = {name: (f"model.{name}", shape) for name, shape in saved.params.items()}
    wanted.update({name: (f"buffer.{name}", shape) for name, shape in saved.buffers.items()})
    stored = metadata.state_dict_metadata
    problems, out = [], {}
    for name, (key, shape) in wanted.items():
        meta = stored.get(key)
        if not isinstance(meta, TensorStorageMetadata):
            problems.append(f"'{key}' is missing")
        elif tuple(meta.size) != shape:
            problems.append(f"'{key}' has shape {list(meta.size)}, {DESCRIPTION} says {list(shape)}")
        else:
            out[name] = _Source(key, shape, meta.properties.dtype)
    if problems:
        raise CheckpointError(f"{saved.step_dir}: the DCP files and {DESCRIPTION} disagree on {len(problems)} "
                              f"tensor(s): {'; '.join(problems[:5])}")
    return out


def _files(saved: ModelDescription, sources: dict[str, _Source], model: nn.Module | None,
           max_shard_bytes: int) -> tuple[list[HFFile], dict[str, Lazy]]:
    """The weight files: every name the model gives each tensor, less tied duplicates and ignored
    keys, in the described order, under the names ``save_pretrained`` writes (``saved_tensors``),
    cut into files of at most ``max_shard_bytes`` (a larger tensor alone in its file); and written
    name -> its value over the DCP tensors (``Leaf.info``: the ``_Source``)."""
    groups = {name: saved.aliases[name] for name in saved.params if name not in saved.stacked}
    groups.update({member: [member] for name in saved.stacked for member in saved.stacked[name]})
    groups.update({name: [name] for name in saved.buffers})
    stored = {}
    for canonical, names in groups.items():
        source = sources.get(canonical)
        for name in names:
            stored[name] = Leaf.of_shape(name, source.shape, source.dtype, source) if source is not None else None
    for name, members in saved.stacked.items():  # a list of experts stacked by the compiler: entry e each
        whole = Leaf.of_shape(name, sources[name].shape, sources[name].dtype, sources[name])
        stored.update((member, whole[e]) for e, member in enumerate(members))
    read_as = saved_tensors(model, stored, groups.values())
    entries = [TensorEntry(name, tuple(value.shape), value.dtype) for name, value in read_as.items()]
    runs = _cut_by_size(entries, max_shard_bytes)
    return [HFFile(weight_file_name(k, len(runs)), tuple(run)) for k, run in enumerate(runs, 1)], read_as


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
        return value if region is None else value[region_slices(region)]


def _read(reader: dcp.FileSystemReader, source: _Source) -> torch.Tensor:
    """One tensor, whole, read through DCP without a process group."""
    import torch.distributed.checkpoint as dcp

    value = torch.empty(source.shape, dtype=source.dtype)
    with warnings.catch_warnings():  # DCP warns that it runs in one process, which is the intent here
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.load({source.key: value}, storage_reader=reader, no_dist=True)
    return value


def _directory_files(out: str, saved: ModelDescription, files: list[HFFile], model: nn.Module | None) -> list[str]:
    """The index (more than one file) and the configs: the built model's, else ``hf_config`` as saved."""
    total_parameters = sum(math.prod(shape) for shape in saved.params.values())
    written = write_directory_files(out, files, total_parameters, model)
    if model is not None or saved.hf_config is None:
        return written
    with open(os.path.join(out, "config.json"), "w", encoding="utf-8") as f:
        f.write(json.dumps(saved.hf_config, indent=2, sort_keys=True) + "\n")
    return written + ["config.json"]


def _model_skeleton(saved: ModelDescription) -> tuple[nn.Module | None, str | None]:
    """The HuggingFace model of ``hf_config`` on the meta device, for its tied-weights declaration,
    ignored keys and configs; (None, why) when it cannot be built or its state_dict differs from
    the checkpoint's tensors (tied weights then keep their first name; config.json is hf_config)."""
    if saved.hf_config is None:
        return None, None
    try:
        import transformers  # only a checkpoint of a HuggingFace model needs it

        fields = dict(saved.hf_config)
        config = transformers.AutoConfig.for_model(fields.pop("model_type"), **fields)
        arch = (config.architectures or [None])[0]
        cls = getattr(transformers, arch, None) if arch else None
        with torch.device("meta"):
            model = cls(config) if cls is not None else transformers.AutoModelForCausalLM.from_config(config)
    except Exception as e:  # any failure to build: the export goes on without the model, and says so
        return None, (f"note: cannot build the model from hf_config ({type(e).__name__}: {e}); tied weights "
                      "keep their first name and config.json is hf_config as saved")
    expected = {alias: shape for name, shape in saved.params.items() for alias in saved.aliases[name]}
    expected.update(saved.buffers)
    built = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    if built != expected:
        diff = sorted(set(built.items()) ^ set(expected.items()))[:3]
        return None, (f"note: {type(model).__name__} built from hf_config does not have the checkpoint's "
                      f"tensors (e.g. {diff}); tied weights keep their first name and config.json is hf_config "
                      "as saved")
    return model, None
