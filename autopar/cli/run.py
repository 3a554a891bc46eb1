"""``autopar run``: start N local ranks of a training script (torchrun-style)."""

from __future__ import annotations

import argparse
import sys

__all__ = ["run_ranks"]


def run_ranks(args: argparse.Namespace) -> int:
    """``autopar run --nproc N SCRIPT ...``: the ranks' exit status (130 when stopped while torch loads)."""
    try:
        from autopar.runtime.launch import run_script  # noqa: PLC0415  (loads torch)
    except KeyboardInterrupt:  # Ctrl-C while torch loads: no rank started yet
        print("autopar run: interrupted: stopped 0 ranks", file=sys.stderr)
        return 130
    return run_script(args.nproc, args.script, args.script_args, args.timeout, args.max_restarts)
