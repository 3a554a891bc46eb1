"""DCP's file writer that publishes a checkpoint once every rank's files are written.

``PublishingWriter`` writes into ``step-N.partial/``; its ``finish``, which
DCP's coordinator calls only after every rank reported its writes done, makes
the checkpoint visible (``description.publish``). Kept apart from the
description so that reading a checkpoint's description (the HuggingFace
export does, and so every training rank imports it) does not import
torch.distributed.checkpoint and DTensor.
"""

from __future__ import annotations

from pathlib import Path

from torch.distributed.checkpoint import FileSystemWriter

from autopar.runtime.checkpoint.description import PARTIAL, publish, step_dir_name

__all__ = ["PublishingWriter"]


class PublishingWriter(FileSystemWriter):
    """DCP's file writer into ``step-N.partial/`` that publishes the checkpoint once complete.

    ``finish`` runs on the coordinator after every rank's writes succeeded: DCP's
    metadata is written, then the checkpoint published (``description.publish``).
    """

    def __init__(self, root: Path, step: int, description: dict) -> None:
        super().__init__(root / (step_dir_name(step) + PARTIAL), overwrite=False)
        self.final = root / step_dir_name(step)
        self.description = description

    def finish(self, metadata, results) -> None:
        super().finish(metadata, results)
        publish(Path(self.path), self.final, self.description)
