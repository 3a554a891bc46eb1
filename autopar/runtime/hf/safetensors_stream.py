"""A ``.safetensors`` file written one tensor at a time, so memory holds one tensor, not the file.

The format is a little-endian u64 header length, a JSON header (each tensor's
dtype, shape and byte range; ``__metadata__``), padded with spaces to 8 bytes,
then the tensors' bytes back to back. Every name, shape and dtype is known
before any value is (they are the model's), so the header is written first and
each tensor's bytes are appended as it arrives: ``safetensors.torch.save_file``
would need the whole file in memory. The file is written under a temporary
name and renamed when complete, so a reader never sees half a file.
"""

from __future__ import annotations

import json
import math
import os
import struct
import sys
from dataclasses import dataclass

import torch

from autopar.runtime.checkpoint.errors import CheckpointError
from autopar.runtime.hf.errors import ExportError

__all__ = ["TensorEntry", "SafetensorsStream", "SAFETENSORS_DTYPES", "check_dtype"]

SAFETENSORS_DTYPES: dict[torch.dtype, str] = {
    torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
    torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8",
    torch.uint8: "U8", torch.bool: "BOOL",
    torch.float8_e4m3fn: "F8_E4M3", torch.float8_e5m2: "F8_E5M2",
    torch.uint16: "U16", torch.uint32: "U32", torch.uint64: "U64",
}
"""torch dtype -> the safetensors name of it."""


@dataclass(frozen=True)
class TensorEntry:
    """One tensor of a file, before its value exists."""

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize


def check_dtype(name: str, dtype: torch.dtype) -> None:
    """A ``CheckpointError`` unless safetensors can store ``dtype``."""
    if dtype not in SAFETENSORS_DTYPES:
        raise CheckpointError(f"'{name}' is {dtype}, which safetensors cannot store; safetensors stores "
                              f"{', '.join(sorted(str(d).removeprefix('torch.') for d in SAFETENSORS_DTYPES))}")


class SafetensorsStream:
    """Writes ``path``: the header from ``entries`` at once, then ``write(name, tensor)`` in
    ``entries``' order; ``close()`` checks every entry came and renames the file into place.

    Use as a context manager: on an exception the partial file is removed.
    """

    def __init__(self, path: str, entries: list[TensorEntry], metadata: dict[str, str] | None = None):
        if sys.byteorder != "little":
            raise ExportError("safetensors files are little-endian; this machine is big-endian")
        for e in entries:
            check_dtype(e.name, e.dtype)
        self.path = path
        self.entries = list(entries)
        self._next = 0
        self._tmp = f"{path}.partial"
        self._file = open(self._tmp, "wb")  # noqa: SIM115 - closed by close() or __exit__
        self._file.write(_header(self.entries, metadata or {}))

    def write(self, name: str, tensor: torch.Tensor) -> None:
        """Append ``tensor``'s bytes: it must be the next entry, with its shape and dtype."""
        if self._next >= len(self.entries):
            raise CheckpointError(f"{self.path}: '{name}' written after the {len(self.entries)} declared tensors")
        want = self.entries[self._next]
        got = (name, tuple(tensor.shape), tensor.dtype)
        if got != (want.name, want.shape, want.dtype):
            raise CheckpointError(f"{self.path}: expected tensor #{self._next} to be '{want.name}' {list(want.shape)} "
                                  f"{want.dtype}, got '{name}' {list(got[1])} {got[2]}")
        data = tensor.detach().to("cpu").contiguous().reshape(-1).view(torch.uint8)
        self._file.write(data.numpy().data)
        self._next += 1

    def close(self) -> None:
        """Finish the file: every declared tensor must have been written. On a failure the
        partial file is removed."""
        try:
            self._file.close()
            if self._next != len(self.entries):
                raise CheckpointError(f"{self.path}: {len(self.entries) - self._next} declared tensor(s) never "
                                      f"written, from '{self.entries[self._next].name}' on")
            os.replace(self._tmp, self.path)
        except BaseException:
            self.abort()
            raise

    def abort(self) -> None:
        """Drop the partial file."""
        self._file.close()
        if os.path.exists(self._tmp):
            os.remove(self._tmp)

    def __enter__(self) -> "SafetensorsStream":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            self.close()
        else:
            self.abort()


def _header(entries: list[TensorEntry], metadata: dict[str, str]) -> bytes:
    """The length prefix and the JSON header, padded with spaces to a multiple of 8 bytes."""
    names = [e.name for e in entries]
    if len(set(names)) != len(names):
        raise CheckpointError(f"duplicate tensor names in one safetensors file: "
                              f"{sorted({n for n in names if names.count(n) > 1})}")
    header: dict = {"__metadata__": dict(metadata)} if metadata else {}
    offset = 0
    for e in entries:
        header[e.name] = {"dtype": SAFETENSORS_DTYPES[e.dtype], "shape": list(e.shape),
                          "data_offsets": [offset, offset + e.nbytes]}
        offset += e.nbytes
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    return struct.pack("<Q", len(text)) + text
