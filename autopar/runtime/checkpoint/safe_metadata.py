"""DCP's ``.metadata`` read as data: loading a checkpoint never runs code stored in it.

torch's ``FileSystemReader.read_metadata`` (torch 2.13) reads the file with
``pickle.load``: a checkpoint from elsewhere could run any code in every rank
that loads it (a pickle's ``__reduce__`` calls whatever global it names).
``SafeReader`` is DCP's file reader with that one method replaced: its
unpickler finds only the classes DCP's metadata is made of (``ALLOWED``: the
metadata dataclasses, ``torch.Size``, the dtypes, the layout lookup, the
memory-format enum, paths) and refuses any other global (``os.system``,
``builtins.eval``, ...) before anything is called, with a ``CheckpointError``
naming it.

The rest of a load reads data only: tensors and stored Python values with
``torch.load(weights_only=True)`` (DCP's reader; ``PieceLoadPlanner.load_bytes``),
``autopar.json`` with ``json``, HuggingFace weights with safetensors.
"""

from __future__ import annotations

import os
import pickle
from pathlib import Path

import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta

from autopar.runtime.checkpoint.errors import CheckpointError

__all__ = ["SafeReader", "ALLOWED", "METADATA", "load_metadata"]

METADATA = ".metadata"
"""The name of DCP's metadata file in a checkpoint directory."""
_DCP = "torch.distributed.checkpoint.metadata"
ALLOWED: frozenset[tuple[str, str]] = frozenset({
    (_DCP, "Metadata"), (_DCP, "TensorStorageMetadata"), (_DCP, "BytesStorageMetadata"),
    (_DCP, "ChunkStorageMetadata"), (_DCP, "TensorProperties"), (_DCP, "MetadataIndex"), (_DCP, "StorageMeta"),
    (_DCP, "_MEM_FORMAT_ENCODING"),
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("torch", "Size"), ("torch.serialization", "_get_layout"),
    ("pathlib", "PosixPath"), ("pathlib", "WindowsPath"), ("pathlib", "PurePosixPath"),
    ("pathlib", "PureWindowsPath"), ("pathlib", "Path"),
    ("pathlib._local", "PosixPath"), ("pathlib._local", "WindowsPath"),  # Python 3.13's pathlib package
    ("collections", "OrderedDict"),
})
"""(module, name) of every global DCP's metadata pickle may name (besides ``torch.<dtype>``): classes
built from plain values, and ``torch.serialization._get_layout``, a lookup of a layout by name."""


class _MetadataUnpickler(pickle.Unpickler):
    """An unpickler that finds only ``ALLOWED`` globals and torch's dtypes."""

    def __init__(self, file, where: str) -> None:
        super().__init__(file)
        self.where = where

    def find_class(self, module: str, name: str):
        if (module, name) in ALLOWED:
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        raise CheckpointError(
            f"{self.where} names {module}.{name}, which is not part of DCP's metadata: the file holds code a "
            f"plain unpickler would run. Refused before running anything; autopar reads checkpoints as data "
            f"only (docs/fault-tolerance.md). Load only checkpoints you or your job wrote; this one was "
            f"altered or is not a checkpoint")


def load_metadata(path: str | os.PathLike) -> Metadata:
    """The DCP ``Metadata`` pickled at ``path``, read with an unpickler that runs no code."""
    with open(path, "rb") as f:
        metadata = _MetadataUnpickler(f, str(path)).load()
    if not isinstance(metadata, Metadata):
        raise CheckpointError(f"{path} holds a {type(metadata).__name__}, not DCP's Metadata: the checkpoint is "
                              f"damaged")
    return metadata


class SafeReader(FileSystemReader):
    """DCP's ``FileSystemReader`` whose ``read_metadata`` runs no code from the file (``load_metadata``)."""

    def read_metadata(self, *args, **kwargs) -> Metadata:
        rank = kwargs.get("rank")  # DCP's file names: one metadata file, or one per rank when asked so
        metadata = load_metadata(Path(self.path) / (METADATA if rank is None else f"__{rank}{METADATA}"))
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata
