"""What ``torch.distributed.checkpoint`` (DCP) needs to store a rank's shards as pieces of full tensors.

A parameter a rank holds is, in the checkpoint, one or more *pieces* of the
full tensor at their global offsets: a fused segment split over tp is one
piece per segment, a padded vocabulary's last rank holds fewer in-range rows,
a replicated tensor is one piece at offset 0. ``Pieces`` carries them; DCP's
own extension points take it the rest of the way:

- ``Pieces.__create_write_items__`` / ``__create_chunk_list__``: DCP's
  checkpointable protocol (the one DTensor implements), so the default plans
  write each piece as a chunk of the full tensor, drop identical chunks other
  ranks write too (dp replicas, tied stages), and on load read exactly the
  saved chunks that overlap each piece (resharding);
- ``PieceSavePlanner`` / ``PieceLoadPlanner``: the default planners, with the
  lookup of a chunk in a ``Pieces`` added, the state dict kept flat (keys are
  already dotted names), and stored Python objects read with
  ``torch.load(weights_only=True)``;
- ``HostStager``: the staging of an asynchronous save, a host-memory copy of
  every piece taken before training moves on.
"""

from __future__ import annotations

import copy
import io
from dataclasses import dataclass

import torch
from torch.distributed.checkpoint import DefaultLoadPlanner, DefaultSavePlanner
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex, TensorProperties
from torch.distributed.checkpoint.planner import ReadItem, TensorWriteData, WriteItem, WriteItemType
from torch.distributed.checkpoint.staging import AsyncStager

from autopar.runtime.checkpoint.errors import CheckpointError

__all__ = ["Pieces", "PieceSavePlanner", "PieceLoadPlanner", "HostStager"]


@dataclass
class Pieces:
    """This rank's pieces of a full tensor of shape ``shape``: (global offsets, local tensor) each.

    The local tensors are views of the rank's own tensors (a shard, an optimizer
    moment): saving reads them, loading writes into them.
    """

    shape: torch.Size
    pieces: list[tuple[torch.Size, torch.Tensor]]

    def size(self) -> torch.Size:
        """The full tensor's shape (DCP compares it with the checkpoint's on load)."""
        return self.shape

    def at(self, offsets: torch.Size | None) -> torch.Tensor:
        """The piece that starts at ``offsets``."""
        for start, tensor in self.pieces:
            if offsets is None or start == offsets:
                return tensor
        raise CheckpointError(f"no piece at offsets {tuple(offsets)} of a tensor of shape {tuple(self.shape)}")

    def __create_write_items__(self, fqn: str, obj: "Pieces") -> list[WriteItem]:
        return [WriteItem(index=MetadataIndex(fqn, start), type=WriteItemType.SHARD,
                          tensor_data=TensorWriteData(chunk=ChunkStorageMetadata(start, tensor.size()),
                                                      properties=TensorProperties.create_from_tensor(tensor),
                                                      size=self.shape))
                for start, tensor in self.pieces]

    def __create_chunk_list__(self) -> list[ChunkStorageMetadata]:
        return [ChunkStorageMetadata(start, tensor.size()) for start, tensor in self.pieces]

    def to_host(self) -> "Pieces":
        """A copy in host memory, independent of the tensors it was made from."""
        return Pieces(self.shape, [(start, _host_copy(t)) for start, t in self.pieces])


def _host_copy(t: torch.Tensor) -> torch.Tensor:
    return t.detach().to("cpu", copy=True)


class PieceSavePlanner(DefaultSavePlanner):
    """DCP's default save planner over a flat state dict whose values may be ``Pieces``."""

    def __init__(self) -> None:
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)

    def lookup_object(self, index: MetadataIndex):
        value = self.state_dict[index.fqn]
        if isinstance(value, Pieces):
            return value.at(index.offset)
        return super().lookup_object(index)


class PieceLoadPlanner(DefaultLoadPlanner):
    """DCP's default load planner over a flat state dict whose values may be ``Pieces``.

    Stored Python objects (the step's extra dict, the scheduler state, the
    optimizer's hyperparameters) are read with ``torch.load(weights_only=True)``:
    plain containers, numbers and strings, nothing executable.
    """

    def __init__(self) -> None:
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)

    def set_up_planner(self, state_dict: dict, metadata=None, is_coordinator: bool = False) -> None:
        """The default set-up without its pass that allocates meta-device tensors: that pass
        rebuilds the state dict and drops what it does not know (``Pieces``); ours holds
        real tensors only."""
        self.original_state_dict = state_dict
        self.state_dict = state_dict
        self.metadata = metadata
        self.is_coordinator = is_coordinator

    def lookup_tensor(self, index: MetadataIndex) -> torch.Tensor:
        value = self.state_dict[index.fqn]
        if isinstance(value, Pieces):
            return value.at(index.offset)
        return super().lookup_tensor(index)

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        self.state_dict[read_item.dest_index.fqn] = torch.load(value, weights_only=True)


class HostStager(AsyncStager):
    """Stages an asynchronous save: every tensor and piece copied to host memory, synchronously.

    When ``stage`` returns, training may change the parameters and the optimizer
    state: the write thread reads only the copies. (These copies are the one
    place the checkpoint puts tensors off the engine's device: host memory is
    what staging is for.)
    """

    _synchronize_after_execute = False

    def stage(self, state_dict: dict) -> dict:
        staged = {}
        for key, value in state_dict.items():
            if isinstance(value, Pieces):
                staged[key] = value.to_host()
            elif isinstance(value, torch.Tensor):
                staged[key] = _host_copy(value)
            else:  # the step's extra dict may be changed in place by the caller right after
                staged[key] = copy.deepcopy(value)
        return staged

    def synchronize_staging(self) -> None:
        """Nothing to wait for: ``stage`` copies before it returns."""

    def close(self) -> None:
        """Nothing held between saves."""
