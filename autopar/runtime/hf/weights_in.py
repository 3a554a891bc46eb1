"""A HuggingFace safetensors checkpoint, read one rank's slices at a time.

``HFCheckpoint.open(path)`` takes a directory holding ``model.safetensors`` or
a sharded ``model.safetensors.index.json`` (or either file itself) and reads
only the files' headers: every tensor's file, shape and dtype.
``match(program)`` maps each of the program's parameters to its tensor in the
files, and fails before any work, naming the file, the parameter and both
shapes, when one is missing or of another shape.

Names are the HF model's ``state_dict`` names after transformers' own
checkpoint conversion mapping for the model (``conversion.load_view``: what
``from_pretrained`` applies, e.g. GPT-NeoX's stored ``embed_out`` is
``lm_head``, a legacy ``LayerNorm.gamma`` is ``LayerNorm.weight``, per-expert
tensors are stacked into one). A parameter is found under any of its names in
the model (a tied LM head absent from the file is the embedding it is tied
to), and, for a model with a ``base_model_prefix`` (HF's convention), with that
prefix added or dropped (a checkpoint of the base model loaded into a model
with a head, and back).

``reader`` gives a ``Reader`` (``read(start, stop)``, as ``weights.shards``
assembles) over one parameter: a sharded parameter is read as
``safe_open(...).get_slice(name)[..., start:stop]`` per piece of the rank's
shard, never whole (of a fused one, the rows it needs of each stored tensor);
a replicated one whole. A stacked expert weight at expert parallelism is read
for the rank's experts only (of a checkpoint with one tensor per expert, only
those experts' tensors). A parameter made by a conversion that cannot
be sliced reads its stored tensors whole, and says so in the log. Values are
cast to the model's dtype.

Every file's header is checked against the file's size before anything is
read: a truncated file or a corrupt header is a ``CheckpointError`` naming the
file and what is wrong, raised by every rank (they all read the same files);
a missing file, a ``CheckpointNotFoundError`` (a ``FileNotFoundError`` too).
"""

from __future__ import annotations

import contextlib
import json
import math
import struct
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from safetensors import safe_open

from autopar.core.log import get_logger
from autopar.core.tensor_placement import Replicate, Shard
from autopar.runtime.checkpoint.errors import CheckpointError, CheckpointNotFoundError
from autopar.runtime.hf.conversion import (
    Lazy,
    Leaf,
    Reads,
    Region,
    full_region,
    is_hf_model,
    load_view,
    region_slices,
)
from autopar.runtime.hf.layout import INDEX_NAME, WEIGHTS_NAME
from autopar.runtime.hf.safetensors_stream import SAFETENSORS_DTYPES

if TYPE_CHECKING:
    from autopar.compiler.program import Program

__all__ = ["HFCheckpoint", "CheckpointError", "Entry", "check_safetensors_file"]

_log = get_logger(__name__)
_DTYPE_BYTES = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U8": 1, "BOOL": 1,
                "F8_E4M3": 1, "F8_E5M2": 1, "F8_E8M0": 1, "U16": 2, "U32": 4, "U64": 8, "C64": 8, "C128": 16}
"""Bytes per element of the safetensors dtypes (a sub-byte or unknown one is not size-checked)."""
_FIX_DAMAGED = "fix: the file is damaged (an interrupted download, copy or save): fetch or save it again"


@dataclass(frozen=True)
class Entry:
    """One tensor of a checkpoint: where it is and what its header says."""

    file: Path
    key: str
    shape: tuple[int, ...]
    dtype: str


def check_safetensors_file(path: Path) -> dict:
    """The JSON header of the safetensors file ``path``, checked against the file's size and
    itself: a ``CheckpointError`` naming the file for a truncated file (fewer bytes than its
    header or its tensors need) or a corrupt header (not JSON, not a table of tensors, offsets
    outside the data or not the size of the tensor's shape and dtype)."""
    size = path.stat().st_size
    if size < 8:
        raise CheckpointError(f"{path}: truncated: a safetensors file starts with an 8-byte header length; "
                              f"expected at least 8 bytes, found {size}. {_FIX_DAMAGED}")
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        if n > size - 8:
            raise CheckpointError(f"{path}: truncated or corrupt: the header length says {n} bytes of header, "
                                  f"found {size - 8} bytes after it. {_FIX_DAMAGED}")
        raw = f.read(n)
    try:
        header = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{path}: corrupt header: its {n} bytes are not JSON ({e}). {_FIX_DAMAGED}") from None
    if not isinstance(header, dict):
        raise CheckpointError(f"{path}: corrupt header: a JSON {type(header).__name__}, not a table of tensors. "
                              f"{_FIX_DAMAGED}")
    data, end, problems = size - 8 - n, 0, []
    for key, info in header.items():
        if key == "__metadata__":
            continue
        try:
            dtype, shape, (start, stop) = info["dtype"], [int(d) for d in info["shape"]], info["data_offsets"]
            if not (isinstance(start, int) and isinstance(stop, int)) or min(shape, default=0) < 0:
                raise ValueError
        except (TypeError, KeyError, ValueError):
            problems.append(f"'{key}': {json.dumps(info)[:120]} is not {{dtype, shape, data_offsets: [start, stop]}}")
            continue
        want = math.prod(shape) * _DTYPE_BYTES[dtype] if dtype in _DTYPE_BYTES else None
        if not 0 <= start <= stop or (want is not None and stop - start != want):
            problems.append(f"'{key}': bad offsets [{start}, {stop}] for {dtype} {shape}"
                            + (f" ({want} bytes)" if want is not None else ""))
        end = max(end, stop)
    if problems:
        raise CheckpointError(f"{path}: corrupt header: {len(problems)} tensor(s) with bad entries: "
                              + "; ".join(problems[:3]) + f". {_FIX_DAMAGED}")
    if end > data:
        raise CheckpointError(f"{path}: truncated: its header's tensors need {end} bytes of data, found {data} "
                              f"(the file has {size} bytes, {8 + n} of them length and header). {_FIX_DAMAGED}")
    return header


def _safe_open(file: Path, **kwargs):
    """``safe_open``, its own errors (a file the header check let through) naming the file."""
    try:
        return safe_open(str(file), framework="pt", **kwargs)
    except Exception as e:  # safetensors raises its own SafetensorError
        raise CheckpointError(f"{file}: safetensors cannot open it: {type(e).__name__}: {e}. {_FIX_DAMAGED}") from None


def _weight_files(path: str | Path) -> dict[str, Path]:
    """Tensor name -> the safetensors file holding it (from the index, or the one file's header)."""
    path = Path(path)
    if path.is_dir():
        found = [path / f for f in (INDEX_NAME, WEIGHTS_NAME) if (path / f).exists()]
        if not found:
            raise CheckpointNotFoundError(f"checkpoint directory {path} holds neither {INDEX_NAME} nor "
                                          f"{WEIGHTS_NAME} (save the model with save_pretrained(..., "
                                          "safe_serialization=True))")
        path = found[0]
    if not path.exists():
        raise CheckpointNotFoundError(f"checkpoint {path} does not exist")
    if path.suffix == ".json":
        try:
            weight_map = json.loads(path.read_text()).get("weight_map")
        except (UnicodeDecodeError, json.JSONDecodeError, AttributeError) as e:
            raise CheckpointError(f"{path}: corrupt index: not a JSON object ({e}). {_FIX_DAMAGED}") from None
        if not isinstance(weight_map, dict):
            raise CheckpointError(f"{path} has no 'weight_map': not a safetensors index")
        return {key: path.parent / file for key, file in weight_map.items()}
    return {key: path for key in check_safetensors_file(path) if key != "__metadata__"}


class HFCheckpoint:
    """The tensors of a safetensors checkpoint by name, from the headers alone."""

    def __init__(self, root: Path, entries: dict[str, Entry]):
        self.root = root
        self.entries = entries
        """Stored name -> the stored tensor."""
        self._open: dict[Path, object] = {}
        self._device = torch.device("cpu")
        """Where reads land (``opened(device)``)."""
        self._reads = Reads(self._fetch)
        self._view: dict[str, Lazy] | None = None
        self._view_of: int | None = None
        self.conversions: list[str] = []
        """transformers' conversions that mapped a stored name (``view``)."""
        self._logged: set[str] = set()

    @classmethod
    def open(cls, path: str | Path) -> HFCheckpoint:
        """The checkpoint at ``path`` (a directory, ``model.safetensors`` or its index), from the
        headers of its files, each checked (``check_safetensors_file``); a missing file is an error."""
        files = _weight_files(path)
        entries = {}
        for file in sorted(set(files.values())):
            if not file.exists():
                raise CheckpointNotFoundError(f"checkpoint file {file} (named by the index) does not exist")
            check_safetensors_file(file)
            with _safe_open(file) as f:
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
    def view(self, model) -> dict[str, Lazy]:
        """Model name -> the tensor ``from_pretrained`` makes of the stored ones (``conversion.load_view``)."""
        if self._view is None or self._view_of != id(model):
            leaves = {k: Leaf.of_shape(k, e.shape, _torch_dtype(e.dtype), e) for k, e in self.entries.items()}
            try:
                self._view, self.conversions = load_view(model, leaves)
            except CheckpointError as e:
                raise CheckpointError(f"checkpoint {self.root}: {e}") from None
            self._view_of = id(model)
        return self._view

    def find(self, view: dict[str, Lazy], names: list[str], prefix: str = "") -> Lazy | None:
        """The first of ``names`` (then each with ``prefix.`` added or dropped) in ``view``."""
        tries = list(names)
        if prefix:
            tries += [n[len(prefix) + 1:] if n.startswith(prefix + ".") else f"{prefix}.{n}" for n in names]
        return next((view[n] for n in tries if n in view), None)

    def match(self, program: Program) -> dict[str, Lazy]:
        """Parameter -> its tensor; a ``CheckpointError`` listing every one missing or mis-shaped."""
        model = program.model
        prefix = getattr(model, "base_model_prefix", "") or ""
        view = self.view(model)
        found, problems = {}, []
        for name in program.param_names:
            members = program.traced.stacked.get(name)
            if members:  # experts of a list, stacked: each expert's own tensor, read lazily
                names = list(members)
                found_members = [self.find(view, program.traced.aliases.get(m, [m]), prefix) for m in members]
                source = None if any(f is None for f in found_members) else torch.stack(found_members)
            else:
                names = program.traced.aliases.get(name, [name])
                source = self.find(view, names, prefix)
            want = program.full_shape(name)
            if source is None:
                mapped = f", after transformers' conversion mapping of {type(model).__name__}" \
                    if is_hf_model(model) else ""
                problems.append(f"  {name}: in no file (looked for {names}{mapped})")
            elif tuple(source.shape) != want:
                problems.append(f"  {name}: shape {tuple(source.shape)} {self.where(source)}, the model's is {want}")
            else:
                found[name] = source
        if problems:
            raise CheckpointError(
                f"checkpoint {self.root}: {len(problems)} of the model's {len(program.param_names)} parameter(s) "
                f"missing or mis-shaped:\n" + "\n".join(problems[:20]) +
                (f"\n  ... and {len(problems) - 20} more" if len(problems) > 20 else "") +
                "\nfix: load a checkpoint saved from a model of the same configuration (save_pretrained), "
                "or pass the weights as materialize(state_dict=...)")
        return found

    @staticmethod
    def where(source: Lazy) -> str:
        """Where a tensor comes from, for messages: its file and stored name, or the stored tensors
        transformers' conversion makes it of."""
        if isinstance(source, Leaf):
            return f"in {source.info.file.name} (as '{source.key}')"
        leaves = source.leaves()
        files = sorted({leaf.info.file.name for leaf in leaves})
        return (f"as transformers' conversion makes it of {len(leaves)} stored tensor(s) "
                f"({', '.join(repr(leaf.key) for leaf in leaves[:3])}{' ...' if len(leaves) > 3 else ''}) "
                f"in {', '.join(files)}")

    def buffer(self, name: str, shape: tuple[int, ...], model=None) -> Lazy | None:
        """The checkpoint's tensor for buffer ``name``, if it has one; of another shape: an error."""
        source = (self.view(model) if model is not None else self._view or {}).get(name)
        if source is not None and tuple(source.shape) != shape:
            raise CheckpointError(f"checkpoint {self.root}: buffer {name} has shape {tuple(source.shape)} "
                                  f"{self.where(source)}, the model's is {shape}; fix: pass the buffer as "
                                  f"materialize(state_dict={{'{name}': tensor}})")
        return source

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
            self._reads = Reads(self._fetch)  # a deferred conversion's result is not kept

    def _file(self, entry: Entry):
        if entry.file not in self._open:
            self._open[entry.file] = _safe_open(entry.file, device=str(self._device))
        return self._open[entry.file]

    def _fetch(self, leaf: Leaf, region: Region | None) -> torch.Tensor:
        """A stored tensor whole, or a region of it read as a slice."""
        entry: Entry = leaf.info
        if region is None:
            return self._file(entry).get_tensor(entry.key)
        return self._file(entry).get_slice(entry.key)[region_slices(region)]

    def _say_whole(self, name: str, source: Lazy) -> None:
        """Log, once per tensor, that a conversion makes this rank read stored tensors whole."""
        if source.sliceable or name in self._logged:
            return
        self._logged.add(name)
        _log.warning("%s: '%s' is made by transformers' conversion with %s, which cannot be read in slices: "
                     "its stored tensors %s are read whole", self.root, name, ", ".join(source.deferred()),
                     [leaf.key for leaf in source.leaves()])

    def read(self, source: Lazy, dtype: torch.dtype, name: str = "") -> torch.Tensor:
        """The whole tensor (a buffer or a replicated parameter), as ``dtype``."""
        self._say_whole(name, source)
        return source.whole(self._reads).to(dtype)

    def reader(self, source: Lazy, spec: Replicate | Shard, dtype: torch.dtype,
               name: str = "", experts: tuple[int, int] | None = None) -> Callable[[int, int], torch.Tensor]:
        """Rows ``[start, stop)`` along the sharded dim, read as slices of the stored tensors (the
        whole tensor when replicated).

        ``experts`` (first, count): a stacked expert weight (E, ...) at expert parallelism, read as
        the (count, ...) tensor of those experts only: every read is cut to them on dim 0, so of a
        checkpoint storing one tensor per expert (Mixtral's ``experts.{i}.w1``) the other experts'
        tensors are never opened."""
        if experts is not None:
            return self._expert_reader(source, spec, dtype, name, *experts)
        if not isinstance(spec, Shard) or not source.shape:
            return lambda start, stop: self.read(source, dtype, name)
        self._say_whole(name, source)
        full = full_region(source.shape)

        def read(start: int, stop: int) -> torch.Tensor:
            region = list(full)
            region[spec.dim] = (start, stop)
            return source.read(tuple(region), self._reads).to(dtype)

        return read

    def _expert_reader(self, source: Lazy, spec: Replicate | Shard, dtype: torch.dtype, name: str, first: int,
                       count: int) -> Callable[[int, int], torch.Tensor]:
        """``reader`` over experts ``[first, first + count)`` of ``source``: rows ``[start, stop)`` of
        the tp split's dim (never dim 0) of that (count, ...) tensor; all of it when replicated."""
        if isinstance(spec, Shard) and spec.dim == 0:
            raise CheckpointError(f"{name}: a stacked expert weight split by tp along its expert dim ({spec}): "
                                  f"expert parallelism owns dim 0")
        self._say_whole(name, source)
        experts = list(full_region(source.shape))
        experts[0] = (first, first + count)

        def read(start: int, stop: int) -> torch.Tensor:
            region = list(experts)
            if isinstance(spec, Shard):
                region[spec.dim] = (start, stop)
            return source.read(tuple(region), self._reads).to(dtype)

        return read


def _torch_dtype(name: str) -> torch.dtype:
    """The torch dtype of a safetensors dtype name (uint8 for one torch lacks: only shapes matter here)."""
    return {v: k for k, v in SAFETENSORS_DTYPES.items()}.get(name, torch.uint8)
