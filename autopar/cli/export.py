"""``autopar export CKPT --to-hf DIR``: a saved autopar checkpoint as a HuggingFace directory."""

from __future__ import annotations

import argparse
import re

from rich.console import Console

from autopar.cli.errors import CliError

__all__ = ["run_export", "size_bytes"]

_SIZE_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
               "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}


def size_bytes(text: str) -> int:
    """``5GB``, ``500MB``, ``2GiB`` or a number of bytes, as bytes (HuggingFace's units)."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([A-Za-z]*)\s*", text)
    unit = match.group(2).upper() if match else None
    if match is None or unit not in _SIZE_UNITS or float(match.group(1)) <= 0:
        raise CliError(f"--max-shard-size {text!r} is not a size: give e.g. 5GB, 500MB, 2GiB or a number of bytes")
    return int(float(match.group(1)) * _SIZE_UNITS[unit])


def run_export(args: argparse.Namespace, console: Console) -> int:
    """``autopar export CKPT --to-hf DIR``: one line per file written."""
    from autopar.runtime.hf.export_checkpoint import export_checkpoint  # noqa: PLC0415  (loads torch's DCP)

    written = export_checkpoint(args.checkpoint, args.to_hf, size_bytes(args.max_shard_size),
                                progress=lambda line: console.print(line, highlight=False))
    console.print(f"wrote {len(written)} file(s) to {args.to_hf}: {', '.join(written)}", highlight=False)
    return 0
