"""A HuggingFace safetensors checkpoint, read one rank's slices at a time.

``HFCheckpoint.open(path)`` takes a directory holding ``model.safetensors`` or
a sharded ``model.safetensors.index.json`` (or either file itself) and reads
only the files' headers: every tensor's file, shape and dtype.
``match(program)`` maps each of the program's parameters to its tensor in the
files, and fails before any work, naming the file, the parameter and both
shapes, when one is missing or of another shape.

Names are the HF model's ``state_dict`` names. A parameter is found under any
of its names in the model (a tied LM head absent from the file is the
embedding it is tied to), and, for a model with a ``base_model_prefix`` (HF's
convention), with that prefix added or dropped (a checkpoint of the base
model loaded into a model with a head, and back).

``reader`` gives a ``shards.Reader`` over one tensor: a sharded parameter is
read as ``safe_open(...).get_slice(name)[..., start:stop]`` per piece of the
rank's shard, never whole; a replicated one whole. Values are cast to the
model's dtype.
"""

from __future__ import annotations

import contextlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from safetensors import safe_open

from autopar.core.placement import Replicate, Shard
from autopar.runtime.shards import Reader
from autopar.runtime.errors import CheckpointError

if TYPE_CHECKING:
    from autopar.compiler.program import Program

__all__ = ["HFCheckpoint", "CheckpointError", "Entry"]

INDEX, SINGLE = "model.safetensors.index.json", "model.safetensors"


@dataclass(frozen=True)
class Entry:
    """One tensor of a checkpoint: where it is and what its header says."""

    file: Path
    key: str
    shape: tuple[int, ...]
    dtype: str


def _weight_files(path: str | Path) -> dict[str, Path]:
    """Tensor name -> the safetensors file holding it (from the index, or the one file's header)."""
    path = Path(path)
    if path.is_dir():
        found = [path / f for f in (INDEX, SINGLE) if (path / f).exists()]
        if not found:
            raise FileNotFoundError(f"checkpoint directory {path} holds neither {INDEX} nor {SINGLE} "
                                    "(save the model with save_pretrained(..., safe_serialization=True))")
        path = found[0]
    if not path.exists():
        raise FileNotFoundError(f"checkpoint {path} does not exist")
    if path.suffix == ".json":
        weight_map = json.loads(path.read_text()).get("weight_map")
        if not isinstance(weight_map, dict):
            raise CheckpointError(f"{path} has no 'weight_map': not a safetensors index")
        return {key: path.parent / file for key, file in weight_map.items()}
    with safe_open(str(path), framework="pt") as f:
        return {key: path for key in f.keys()}


class HFCheckpoint:
    """The tensors of a safetensors checkpoint by name, from the headers alone."""

    def __init__(self, root: Path, entries: dict[str, Entry]):
        self.root = root
        self.entries = entries
        self._open: dict[Path, object] = {}
        self._device = torch.device("cpu")
        """Where reads land (``opened(device)``)."""

    @classmethod
    def open(cls, path: str | Path) -> HFCheckpoint:
        """The checkpoint at ``path`` (a directory, ``model.safetensors`` or its index), from the
        headers of its files; a missing file is an error."""
        files = _weight_files(path)
        entries = {}
        for file in sorted(set(files.values())):
            if not file.exists():
                raise FileNotFoundError(f"checkpoint file {file} (named by the index) does not exist")
            with safe_open(str(file), framework="pt") as f:
                for key in f.keys():
                    if files.get(key) == file:
                        piece = f.get_slice(key)
                        entries[key] = Entry(file, key, tuple(piece.get_shape()), piece.get_dtype())
        missing = sorted(set(files) - set(entries))
        if missing:
            raise CheckpointError(f"the index of {path} names {len(missing)} tensor(s) its files lack, "
                                  f"e.g. {missing[:3]}")
        return cls(Path(path), entries)

    # ---------------------------------------------------------------- names
    def find(self, names: list[str], prefix: str = "") -> Entry | None:
        """The first of ``names`` (then each with ``prefix.`` added or dropped) in the checkpoint."""
        tries = list(names)
        if prefix:
            tries += [n[len(prefix) + 1:] if n.startswith(prefix + ".") else f"{prefix}.{n}" for n in names]
        return next((self.entries[n] for n in tries if n in self.entries), None)

    def match(self, program: Program) -> dict[str, Entry]:
        """Parameter -> its tensor; a ``CheckpointError`` listing every one missing or mis-shaped."""
        prefix = getattr(program.model, "base_model_prefix", "") or ""
        found, problems = {}, []
        for name in program.param_names:
            names = program.traced.aliases.get(name, [name])
            entry = self.find(names, prefix)
            want = program.full_shape(name)
            if entry is None:
                problems.append(f"  {name}: in no file (looked for {names})")
            elif entry.shape != want:
                problems.append(f"  {name}: shape {entry.shape} in {entry.file.name} (as '{entry.key}'), "
                                f"the model's is {want}")
            else:
                found[name] = entry
        if problems:
            raise CheckpointError(
                f"checkpoint {self.root}: {len(problems)} of the model's {len(program.param_names)} parameter(s) "
                f"missing or mis-shaped:\n" + "\n".join(problems[:20]) +
                (f"\n  ... and {len(problems) - 20} more" if len(problems) > 20 else "") +
                "\nfix: load a checkpoint saved from a model of the same configuration (save_pretrained), "
                "or pass the weights as materialize(state_dict=...)")
        return found

    def buffer(self, name: str, shape: tuple[int, ...]) -> Entry | None:
        """The checkpoint's tensor for buffer ``name``, if it has one; of another shape: an error."""
        entry = self.entries.get(name)
        if entry is not None and entry.shape != shape:
            raise CheckpointError(f"checkpoint {self.root}: buffer {name} has shape {entry.shape} in "
                                  f"{entry.file.name}, the model's is {shape}; fix: pass the buffer as "
                                  f"materialize(state_dict={{'{name}': tensor}})")
        return entry

    # ---------------------------------------------------------------- reads
    @contextlib.contextmanager
    def opened(self, device: torch.device):
        """Keep the files open while reading (each opened once, on first use), reads landing on
        ``device`` (safetensors copies each slice there)."""
        self._device = device
        try:
            yield self
        finally:
            self._open.clear()

    def _file(self, entry: Entry):
        if entry.file not in self._open:
            self._open[entry.file] = safe_open(str(entry.file), framework="pt", device=str(self._device))
        return self._open[entry.file]

    def read(self, entry: Entry, dtype: torch.dtype) -> torch.Tensor:
        """The whole tensor (a buffer or a replicated parameter), as ``dtype``."""
        return self._file(entry).get_tensor(entry.key).to(dtype)

    def reader(self, entry: Entry, spec: Replicate | Shard, dtype: torch.dtype) -> Reader:
        """Rows ``[start, stop)`` along the sharded dim, read as a slice (the whole tensor when replicated)."""
        if not isinstance(spec, Shard) or not entry.shape:
            return lambda start, stop: self.read(entry, dtype)
        piece = self._file(entry).get_slice(entry.key)
        lead = (slice(None),) * spec.dim
        return lambda start, stop: piece[lead + (slice(start, stop),)].to(dtype)
