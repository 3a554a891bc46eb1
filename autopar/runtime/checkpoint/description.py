"""The checkpoint directory and its description: a save is never visible half-written.

::

    ROOT/
      latest                   the name of the newest complete checkpoint ("step-00000120")
      step-00000120/           complete: DCP's files (.metadata, *.distcp) and autopar.json
      step-00000130.partial/   a save in progress or interrupted: never loaded, never "latest"

Every rank writes its files into ``step-N.partial/``. DCP's coordinator calls
``PublishingWriter.finish`` (``publishing.py``) only once every rank has
reported its writes done (also for an asynchronous save, in its write thread);
there the metadata is written, then ``publish`` writes ``autopar.json``,
renames the directory to ``step-N/`` and replaces ``latest`` atomically (a
temporary file, ``os.replace``).
A rank killed mid-save leaves only ``step-N.partial/``, which ``resolve``
never picks: ``latest`` still names the previous checkpoint.

``autopar.json`` (``FORMAT`` 1) is ``{"format", "step", "params": {name: full
shape}, "aliases": {name: [every name the model uses for it]}, "buffers":
{name: shape}, "hf_config": dict | null, "layout": {"tp", "pp", "dp",
"virtual_stages"}}`` (and ``"cp"`` when a run splits its sequences, cp > 1,
and ``"ep"`` when a run splits its experts, ep > 1; ``"stacked": {name: [the
model's names, one per expert]}`` when the compiler stacked a list of expert
modules into parameter ``name``, entry e of its first dim the e-th name; the
stored tensors depend on none of them: a stacked expert weight is stored whole,
E experts, each expert-parallel rank writing its own at their offsets on dim
0); beside it, DCP's key ``model.<name>`` is each parameter
and ``buffer.<name>`` each persistent buffer, with those shapes (``optim.*``
the optimizer's state). ``read_description`` gives it as written, format checked;
``read_model_description`` the part a reader of the weights alone needs (the
HuggingFace export), each field checked.
"""

from __future__ import annotations

import json
import os
import shutil
from dataclasses import dataclass, field
from pathlib import Path

from autopar.runtime.checkpoint.errors import CheckpointError, CheckpointNotFoundError

__all__ = ["CheckpointError", "FORMAT", "DESCRIPTION", "LATEST", "PARTIAL", "step_dir_name", "resolve",
           "save_errors", "clear_partial", "publish", "read_description", "ModelDescription",
           "read_model_description"]

FORMAT = 1
"""Version of the layout of ``autopar.json`` and of the DCP keys (``docs/training.md``)."""
DESCRIPTION = "autopar.json"
LATEST = "latest"
PARTIAL = ".partial"


def step_dir_name(step: int) -> str:
    """``step-00000120``: zero-padded so names sort by step."""
    return f"step-{step:08d}"


def resolve(path: str | os.PathLike) -> Path:
    """The complete checkpoint ``path`` names: a root's ``latest``, or a ``step-N/`` directory itself."""
    path = Path(path)
    if path.name.endswith(PARTIAL):
        raise CheckpointError(f"{path} is an unfinished or interrupted save ('{PARTIAL}'), never loadable: "
                              f"name its root {path.parent} for the newest complete checkpoint")
    if (path / LATEST).is_file():
        name = (path / LATEST).read_text().strip()
        target = path / name
        if not name or not (target / DESCRIPTION).is_file():
            raise CheckpointError(f"{path / LATEST} names '{name}', but {target} is not a complete checkpoint "
                                  f"(no {DESCRIPTION}): it was removed or moved; name one of the step "
                                  f"directories instead")
        return target
    if (path / DESCRIPTION).is_file():
        return path
    if path.is_dir():
        partial = sorted(p.name for p in path.glob(f"*{PARTIAL}"))
        seen = f"; only interrupted saves: {partial}" if partial else ""
        raise CheckpointError(f"no complete checkpoint in {path}: neither {DESCRIPTION} (a step directory) "
                              f"nor a '{LATEST}' file (a checkpoint root){seen}")
    fix = f"name a checkpoint root (with a '{LATEST}' file) or one of its step directories"
    if path.exists():
        raise CheckpointError(f"checkpoint {path} is a file, not a directory: {fix}")
    raise CheckpointNotFoundError(f"checkpoint {path} does not exist: {fix}")


def read_description(step_dir: Path) -> dict:
    """``autopar.json`` of a complete checkpoint, as written; its format checked."""
    try:
        description = json.loads((step_dir / DESCRIPTION).read_text())
    except (OSError, ValueError) as e:
        raise CheckpointError(f"checkpoint {step_dir}: {DESCRIPTION} is unreadable ({e}); the checkpoint is "
                              f"damaged") from e
    if not isinstance(description, dict):
        raise CheckpointError(f"checkpoint {step_dir}: {DESCRIPTION} holds a JSON "
                              f"{type(description).__name__}, not an object; the checkpoint is damaged")
    if description.get("format") != FORMAT:
        raise CheckpointError(f"checkpoint {step_dir} has format {description.get('format')!r}; this autopar "
                              f"reads format {FORMAT}")
    return description


@dataclass(frozen=True)
class ModelDescription:
    """What ``autopar.json`` says of the saved model's tensors, checked."""

    step_dir: Path
    params: dict[str, tuple[int, ...]]
    """Parameter -> its full shape, in the model's order."""
    aliases: dict[str, list[str]]
    """Parameter -> every name the model gives it, its own first."""
    buffers: dict[str, tuple[int, ...]]
    """Persistent buffer -> its shape."""
    hf_config: dict | None
    """The HuggingFace config of the model, when it had one."""
    stacked: dict[str, list[str]] = field(default_factory=dict)
    """Parameter stacked from a list of experts -> the model's name of each expert's entry ({} if none)."""


def read_model_description(step_dir: Path) -> ModelDescription:
    """``read_description`` of ``step_dir``, its parameters, aliases, buffers and HuggingFace config checked."""
    description = read_description(step_dir)
    where = step_dir / DESCRIPTION
    if not isinstance(description.get("params"), dict) or not description["params"]:
        raise CheckpointError(f"{where} lists no parameters ('params': {{name: shape}})")
    params = {name: tuple(shape) for name, shape in description["params"].items()}
    listed = description.get("aliases") or {}
    if not isinstance(listed, dict):
        raise CheckpointError(f"{where}: 'aliases' is a {type(listed).__name__}, not {{name: [names]}}")
    aliases = {name: [name] + [n for n in listed.get(name) or () if n != name] for name in params}
    buffers = {name: tuple(shape) for name, shape in (description.get("buffers") or {}).items()}
    hf_config = description.get("hf_config")
    if hf_config is not None and not isinstance(hf_config, dict):
        raise CheckpointError(f"{where}: 'hf_config' is a {type(hf_config).__name__}, not a dict or null")
    stacked = description.get("stacked") or {}
    if not isinstance(stacked, dict) or any(n not in params or len(m) != params[n][0] for n, m in stacked.items()):
        raise CheckpointError(f"{where}: 'stacked' must map stacked parameters to one name per entry of their "
                              f"first dim; got {stacked!r:.200}")
    return ModelDescription(step_dir, params, aliases, buffers, hf_config, stacked)


def save_errors(root: Path, step: int) -> list[str]:
    """Why ``step`` cannot be saved under ``root`` (empty when it can)."""
    if root.exists() and not root.is_dir():
        return [f"checkpoint root {root} is a file, not a directory"]
    final = root / step_dir_name(step)
    if final.exists():
        return [f"{final} already exists: a step is saved once. Remove it, or save under another step"]
    return []


def clear_partial(root: Path, step: int) -> Path:
    """Make ``root`` and an empty ``step-N.partial/`` (what an interrupted save left is removed)."""
    partial = root / (step_dir_name(step) + PARTIAL)
    if partial.exists():
        shutil.rmtree(partial)
    partial.mkdir(parents=True)
    return partial


def publish(partial: Path, final: Path, description: dict) -> None:
    """Make the complete save in ``partial`` the checkpoint ``final``: ``autopar.json`` written,
    the directory renamed, the new ``latest``, each durable (fsync) before the next."""
    _write_durably(partial / DESCRIPTION, json.dumps(description, indent=1))
    os.rename(partial, final)
    _sync_dir(final.parent)
    _write_durably(final.parent / LATEST, final.name + "\n")


def _write_durably(path: Path, text: str) -> None:
    """Replace ``path`` atomically by ``text``: a temporary file, fsync, ``os.replace``, fsync of the directory."""
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    _sync_dir(path.parent)


def _sync_dir(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
