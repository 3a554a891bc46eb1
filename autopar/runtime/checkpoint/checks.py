"""Checks before a checkpoint is read or written, and the agreement that makes every rank fail together.

A load reads nothing before the checks pass: the checkpoint's DCP metadata
against this program (every parameter present, in its full shape; no parameter
of another model), each data file long enough for every chunk it indexes (a
file cut short by an interrupted copy), each requested value present in its
shape. Each rank checks what it will read; ``agree`` gathers every rank's
findings over the checkpoint's process group so that all ranks raise the same
``CheckpointError``, and none waits forever in a collective the others left.
Before a save, every parameter must be finite (``nonfinite_param_errors``): a
checkpoint is never written with NaN or infinite weights.
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.metadata import BytesStorageMetadata, Metadata

from autopar.runtime.checkpoint.description import CheckpointError
from autopar.runtime.checkpoint.safe_metadata import SafeReader

__all__ = ["read_metadata", "param_errors", "truncation_errors", "target_errors", "nonfinite_param_errors", "agree"]

_SHOWN = 12
"""Problems listed in full in one error; the rest are counted."""


def read_metadata(step_dir: Path) -> Metadata:
    """DCP's ``.metadata`` of a checkpoint directory, read as data (``safe_metadata``: a file naming
    anything else is refused, unrun)."""
    try:
        return SafeReader(step_dir).read_metadata()
    except CheckpointError:
        raise
    except Exception as e:  # noqa: BLE001 - any failure to read it means the same thing
        raise CheckpointError(f"checkpoint {step_dir}: its DCP metadata (.metadata) is unreadable "
                              f"({type(e).__name__}: {e}); the checkpoint is damaged") from e


def _what(key: str) -> str:
    """A DCP key in words: ``model.h.0.w`` -> ``parameter h.0.w``."""
    kind, _, name = key.partition(".")
    if not name:
        return {"scheduler": "LR scheduler state", "extra": "extra dict"}.get(key, f"value {key}")
    return {"model": "parameter", "buffer": "buffer", "optim": "optimizer state", "rng": "random stream"}.get(
        kind, "value") + f" {name}"


def param_errors(program, metadata: Metadata) -> list[str]:
    """Every parameter of the program in the checkpoint, in its full shape; no parameter the program
    lacks. Shape mismatches first: they say most about what went wrong."""
    saved = {k[len("model."):]: md for k, md in metadata.state_dict_metadata.items() if k.startswith("model.")}
    shapes, missing = [], []
    for name in program.param_names:
        want = tuple(program.full_shape(name))
        if name not in saved:
            missing.append(f"has no parameter {name} (shape {want} in this program)")
        elif tuple(saved[name].size) != want:
            shapes.append(f"parameter {name} has shape {tuple(saved[name].size)} in the checkpoint but {want} "
                          f"in this program")
    extra = sorted(set(saved) - set(program.param_names))
    if extra:
        missing.append(f"holds {len(extra)} parameter(s) this program does not have, e.g. "
                       f"{[(n, tuple(saved[n].size)) for n in extra[:3]]}: a checkpoint of another model?")
    return shapes + missing


def truncation_errors(step_dir: Path, metadata: Metadata) -> list[str]:
    """Each data file at least as long as the furthest byte its chunks are stored at."""
    needed: dict[str, tuple[int, object]] = {}
    for index, info in (metadata.storage_data or {}).items():
        end = info.offset + info.length
        if end > needed.get(info.relative_path, (0, None))[0]:
            needed[info.relative_path] = (end, index)
    errors = []
    for file, (end, index) in sorted(needed.items()):
        path = step_dir / file
        size = path.stat().st_size if path.exists() else None
        if size is None or size < end:
            md = metadata.state_dict_metadata.get(index.fqn)
            shape = f" of full shape {tuple(md.size)}" if md is not None and hasattr(md, "size") else ""
            offsets = f" (the chunk at offsets {tuple(index.offset)}{shape})" if index.offset is not None else ""
            have = "is missing" if size is None else f"has {size} bytes"
            errors.append(f"file {file} {have}, but {_what(index.fqn)}{offsets} is stored up to byte {end}: "
                          f"the file was cut short (an interrupted copy?)")
    return errors


def target_errors(metadata: Metadata, targets: dict) -> list[str]:
    """Every value a load asks for in the checkpoint, tensors in the shape asked for."""
    errors = []
    for key, target in targets.items():
        md = metadata.state_dict_metadata.get(key)
        if md is None:
            errors.append(f"has no {_what(key)}")
        elif isinstance(md, BytesStorageMetadata) != (target is None):
            errors.append(f"holds {_what(key)} as {'an object' if target is None else 'a tensor'}, not as "
                          f"{'a tensor' if target is None else 'an object'}")
        elif target is not None and tuple(md.size) != tuple(target.size()):
            errors.append(f"{_what(key)} has shape {tuple(md.size)} in the checkpoint but "
                          f"{tuple(target.size())} here")
    return errors


def nonfinite_param_errors(holdings, step: int) -> list[str]:
    """The parameters of this rank (``holdings``: ``engine.holdings``) holding a NaN or an infinity,
    as one problem (empty when all are finite): a save of ``step`` refuses them."""
    params = list(holdings.named_local_parameters())
    if not params:
        return []
    finite = torch.stack([torch.isfinite(p.detach()).all() for _, p in params]).tolist()  # one transfer
    bad = [name for (name, _), ok in zip(params, finite) if not ok]
    if not bad:
        return []
    shown = ", ".join(bad[:6]) + (f" and {len(bad) - 6} more" if len(bad) > 6 else "")
    return [f"parameter(s) {shown} hold NaN or infinite values at step {step}: a checkpoint is never written with "
            f"non-finite weights, and the previous one stays 'latest'. Fix: find the step that made them "
            f"(engine.last_step; engine.optimizer_step skips such steps instead of applying them) and resume "
            f"from the last checkpoint"]


def agree(errors: list[str], group, what: str) -> None:
    """Raise ``CheckpointError`` on every rank when any rank found a problem.

    ``what`` starts the message (the checkpoint and the operation); each problem
    follows once, with the ranks that found it when not all did. Collective over
    ``group`` (all ranks); without a process group, this rank's own problems.
    """
    if dist.is_initialized():
        found: list = [None] * dist.get_world_size(group)
        dist.all_gather_object(found, errors, group=group)
    else:
        found = [errors]
    by_problem: dict[str, list[int]] = {}
    for rank, problems in enumerate(found):
        for problem in problems:
            by_problem.setdefault(problem, []).append(rank)
    if not by_problem:
        return
    lines = [p if len(r) == len(found) else f"{p} [ranks {r}]" for p, r in by_problem.items()]
    more = f"\n  ... and {len(lines) - _SHOWN} more" if len(lines) > _SHOWN else ""
    raise CheckpointError(f"{what}:\n  " + "\n  ".join(lines[:_SHOWN]) + more)

