"""What a HuggingFace model directory holds, and the rules ``transformers.save_pretrained`` follows.

- Weights: ``model.safetensors``, or ``model-0000k-of-0000n.safetensors`` with
  ``model.safetensors.index.json`` (``weight_map``: tensor name -> file;
  ``metadata``: ``total_size`` in bytes, ``total_parameters``). Each file's
  safetensors metadata is ``{"format": "pt"}``.
- Tied weights are written once (safetensors has no aliases). Which name stays
  is HuggingFace's rule (``remove_tied_weights_from_state_dict``): of the names
  sharing one tensor, those matching the model's tied-weights declaration
  (``_tied_weights_keys`` of the model and its submodules) are dropped, keeping
  the last in sorted order when all match; a tie nothing declares keeps its
  first name. ``_keys_to_ignore_on_save`` are not written.
- ``config.json`` (``architectures`` and ``dtype`` set, as ``save_pretrained``
  does) and ``generation_config.json`` for a model that can generate.

Weight files of an earlier save that this one does not rewrite are removed, so
a directory never mixes two saves' files.

``saved_tensors`` applies these rules and transformers' conversion for saving
to a model's state_dict names, and ``write_directory_files`` writes what
comes beside the weights: both exports (a running program's, a saved
checkpoint's) go through them.
"""

from __future__ import annotations

import copy
import json
import os
import re
import sys
from collections.abc import Iterable
from dataclasses import dataclass

import torch
import torch.nn as nn

from autopar.runtime.hf.conversion import Lazy, Leaf, saved_view
from autopar.runtime.hf.safetensors_stream import TensorEntry, check_dtype

__all__ = ["HFFile", "WEIGHTS_NAME", "INDEX_NAME", "FILE_METADATA", "weight_file_name", "tied_weight_patterns",
           "tied_duplicates", "ignored_on_save", "saved_tensors", "hf_config_of", "write_index", "write_configs",
           "write_directory_files", "remove_stale_weight_files", "check_output_dir"]

WEIGHTS_NAME = "model.safetensors"
INDEX_NAME = "model.safetensors.index.json"
FILE_METADATA = {"format": "pt"}
"""The safetensors metadata ``transformers`` writes (and older versions require on load)."""
_SHARD_FILE = re.compile(r"model-\d{5}-of-\d{5}\.safetensors")


@dataclass(frozen=True)
class HFFile:
    """One weight file of the directory: its name and its tensors in order."""

    name: str
    entries: tuple[TensorEntry, ...]

    @property
    def nbytes(self) -> int:
        return sum(e.nbytes for e in self.entries)


def weight_file_name(k: int, n: int) -> str:
    """The name of file ``k`` (1-based) of ``n``: ``model.safetensors`` when there is one."""
    return WEIGHTS_NAME if n == 1 else f"model-{k:05d}-of-{n:05d}.safetensors"


def tied_weight_patterns(model: nn.Module | None) -> list[str]:
    """The model's tied-weights declaration: each submodule's ``_tied_weights_keys`` (a dict of
    target -> source in transformers 5, a list of names before), prefixed with the submodule's path."""
    if model is None:
        return []
    out = []
    for path, module in model.named_modules():
        declared = getattr(module, "_tied_weights_keys", None) or ()
        out.extend(f"{path}.{k}" if path else k for k in declared)
    return out


def tied_duplicates(names: list[str], patterns: Iterable[str]) -> list[str]:
    """Of ``names`` (every name of one tied tensor, canonical first), those not to write."""
    if len(names) < 2:
        return []
    patterns = list(patterns)
    declared = [n for n in sorted(names) if any(re.search(p, n) for p in patterns)]
    drop = set(declared[:-1] if len(declared) == len(names) else declared)
    kept = [n for n in names if n not in drop]
    drop.update(kept[1:])  # a tie nothing declares keeps its first name
    return [n for n in names if n in drop]


def ignored_on_save(model: nn.Module | None) -> set[str]:
    """The keys ``save_pretrained`` leaves out (``_keys_to_ignore_on_save``)."""
    return set(getattr(model, "_keys_to_ignore_on_save", None) or ())


def saved_tensors(model: nn.Module | None, stored: dict[str, Leaf], ties: Iterable[list[str]]) -> dict[str, Lazy]:
    """Name written -> its value over ``stored`` (each state_dict name of ``model`` -> its tensor), as
    ``save_pretrained`` writes them: tied duplicates (of each group of names in ``ties``, canonical
    first) and ignored keys left out, transformers' conversion for saving applied
    (``conversion.saved_view``); every dtype one safetensors stores."""
    skip = ignored_on_save(model)
    patterns = tied_weight_patterns(model)
    for names in ties:
        skip.update(tied_duplicates(names, patterns))
    kept = {}
    for name, leaf in stored.items():
        if name not in skip:
            check_dtype(name, leaf.dtype)
            kept[name] = leaf
    values = saved_view(model, kept)
    for name, value in values.items():
        check_dtype(name, value.dtype)
    return values


def hf_config_of(model: nn.Module | None):
    """The model's ``PretrainedConfig``, or None (not a HuggingFace model)."""
    transformers = sys.modules.get("transformers")  # a model with a HF config has imported it
    config = getattr(model, "config", None)
    if transformers is None or not isinstance(config, transformers.PretrainedConfig):
        return None
    return config


def write_index(path: str, files: list[HFFile], total_parameters: int) -> None:
    """``model.safetensors.index.json`` for ``files`` (more than one)."""
    index = {"metadata": {"total_parameters": total_parameters, "total_size": sum(f.nbytes for f in files)},
             "weight_map": {e.name: f.name for f in files for e in f.entries}}
    with open(os.path.join(path, INDEX_NAME), "w", encoding="utf-8") as out:
        out.write(json.dumps(index, indent=2, sort_keys=True) + "\n")


def write_configs(path: str, model: nn.Module, dtype: torch.dtype | None) -> list[str]:
    """``config.json`` (and ``generation_config.json`` when the model generates) for a HuggingFace
    ``model``, as ``save_pretrained`` writes them; the names of the files written ([] for a model
    without a HuggingFace config). The model's own config is left unchanged."""
    config = hf_config_of(model)
    if config is None:
        return []
    config = copy.deepcopy(config)
    config.architectures = [type(model).__name__]
    if dtype is not None:
        config.dtype = str(dtype).removeprefix("torch.")
    config.save_pretrained(path)
    written = ["config.json"]
    can_generate = getattr(model, "can_generate", None)
    generation = getattr(model, "generation_config", None)
    if callable(can_generate) and can_generate() and generation is not None:
        generation.save_pretrained(path)
        written.append("generation_config.json")
    return written


def write_directory_files(path: str, files: list[HFFile], total_parameters: int, model: nn.Module | None
                          ) -> list[str]:
    """What stands beside the weight ``files``: the index (more than one file) and, for a HuggingFace
    ``model`` (None: none), its configs (``write_configs``, with the dtype of the first
    floating-point tensor written); the names of the files written."""
    written = []
    if len(files) > 1:
        write_index(path, files, total_parameters)
        written.append(INDEX_NAME)
    dtypes = [e.dtype for f in files for e in f.entries if e.dtype.is_floating_point]
    return written + write_configs(path, model, dtypes[0] if dtypes else None)


def check_output_dir(path: str) -> str | None:
    """Why ``path`` cannot receive an export (a file, not writable), or None; creates it."""
    if os.path.isfile(path):
        return f"'{path}' is a file: a HuggingFace export is a directory; name a directory"
    try:
        os.makedirs(path, exist_ok=True)
    except OSError as e:
        return f"cannot create the directory '{path}': {e}"
    if not os.access(path, os.W_OK):
        return f"the directory '{path}' is not writable"
    return None


def remove_stale_weight_files(path: str, keep: Iterable[str]) -> None:
    """Remove weight files and index of an earlier save in ``path`` that this save does not write."""
    keep = set(keep)
    for name in os.listdir(path):
        stale = name in (WEIGHTS_NAME, INDEX_NAME) or _SHARD_FILE.fullmatch(name)
        if stale and name not in keep and os.path.isfile(os.path.join(path, name)):
            os.remove(os.path.join(path, name))
