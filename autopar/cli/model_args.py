"""The model the flags describe: a preset (``--model``), a HuggingFace config (``--hf-config``)
or its dimensions (``--layers --hidden --heads ...``), as a planning ``ModelSpec``."""

from __future__ import annotations

import argparse
from dataclasses import replace

from autopar.cli.arguments import FEATURES
from autopar.cli.hf_models import hf_model_spec
from autopar.planning.cost.models import ModelSpec, get_model

__all__ = ["model_spec"]


def _feature_flags(args: argparse.Namespace) -> dict[str, bool]:
    """The ``FEATURES`` flags given on the command line, as ``ModelSpec`` fields."""
    given = {flag.replace("-", "_"): getattr(args, flag.replace("-", "_"), None) for flag, _, _ in FEATURES}
    return {k: v for k, v in given.items() if v is not None}


_MOE_FLAGS = ("experts", "top_k", "expert_ffn", "shared_expert_ffn", "moe_every")
"""The mixture-of-experts flags, named as ``ModelSpec``'s fields."""


def _moe_flags(args: argparse.Namespace) -> dict[str, int]:
    """The mixture-of-experts flags given on the command line, as ``ModelSpec`` fields."""
    return {k: getattr(args, k) for k in _MOE_FLAGS if getattr(args, k, None) is not None}


def model_spec(args: argparse.Namespace) -> ModelSpec | None:
    """The model of ``args``, or None when no flag describes one."""
    if getattr(args, "hf_config", None):
        given = [f"--{a.replace('_', '-')}" for a in ("layers", "hidden", "heads", "vocab", "ffn", "kv_heads")
                 if getattr(args, a) is not None]
        given += ["--gated-mlp"] * args.gated_mlp + [f"--{k.replace('_', '-')}" for k in _feature_flags(args)]
        given += [f"--{k.replace('_', '-')}" for k in _moe_flags(args)]
        if given:
            raise SystemExit(f"autopar: --hf-config reads the model from its graph; {', '.join(given)} would be "
                             f"ignored: drop them, or describe the model by its dimensions instead")
        return hf_model_spec(args.hf_config, args.seq_len or 2048)
    if args.model:
        spec = get_model(args.model)
        over = {k: getattr(args, a) for k, a in (("seq_len", "seq_len"), ("vocab", "vocab"))
                if getattr(args, a) is not None}
        over |= _feature_flags(args) | _moe_flags(args)
        if over:
            spec = replace(spec, **over)
        return spec
    dims = (args.layers, args.hidden, args.heads)
    if all(x is None for x in dims):
        return None
    if any(x is None for x in dims):
        raise SystemExit("autopar: give --model, or all of --layers --hidden --heads")
    features = {flag.replace("-", "_"): default for flag, default, _ in FEATURES} | _feature_flags(args)
    return ModelSpec(layers=args.layers, hidden=args.hidden, heads=args.heads,
                     seq_len=args.seq_len or 2048, vocab=args.vocab or 51200, ffn=args.ffn,
                     kv_heads=args.kv_heads, gated_mlp=args.gated_mlp, **features, **_moe_flags(args))
