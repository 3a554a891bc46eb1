"""What the cluster and layout flags ask the planner: the hardware, the search space, the
schedules ``--schedule`` and ``--vp`` allow, a layout fixed by the flags, and the ``--vs-*``
layout of ``autopar plan``.

``schedule_choices`` is the one reading of ``--schedule`` and ``--vp`` (and of ``--vs-vp``):
a schedule given by name is the only choice; otherwise ``--vp`` v chunks per stage allow the
schedules that run v chunks (v = 1: 1F1B and ZB-H1; v = 2: interleaved and ZB-V's V; more:
interleaved), the first of them the one to take when one is needed; without either, every
schedule the planner searches.
"""

from __future__ import annotations

import argparse
from dataclasses import replace

from autopar.cli.arguments import FEATURE_FLAG, RECOMPUTE_FLAG
from autopar.cli.errors import CliError
from autopar.planning.cost.hardware import Hardware
from autopar.planning.cost.hardware_profile import resolve_hardware
from autopar.planning.cost.layout import Cluster, Layout
from autopar.planning.cost.models import ModelSpec
from autopar.planning.cost.op_times import measured_this_layer
from autopar.planning.cost.step_estimate import Estimate
from autopar.planning.search.planner import SearchSpace, search

__all__ = ["schedule_choices", "chunks_per_stage", "hardware", "cluster", "search_space", "fixed_layout",
           "versus_estimate"]

_SCHEDULES_OF_V: dict[int, tuple[str, ...]] = {1: ("1f1b", "zb-h1"), 2: ("interleaved", "zbv")}
"""v chunks per stage -> the schedules that run them, the plain one first (more than 2: interleaved)."""


def schedule_choices(schedule: str | None, vp: int | None) -> tuple[str, ...]:
    """The schedules ``--schedule`` and ``--vp`` allow, the one to take first."""
    if schedule is not None:
        return (schedule,)
    if vp is None:
        return SearchSpace.schedules
    return _SCHEDULES_OF_V.get(vp, ("interleaved",))


def chunks_per_stage(schedule: str | None, vp: int | None) -> int:
    """v of a layout the flags fix: ``--vp``, else ZB-V's 2 or one chunk per stage."""
    return vp or (2 if schedule == "zbv" else 1)


def hardware(args: argparse.Namespace) -> Hardware:
    """``--hardware``'s preset or tuned profile, with ``--memory-headroom`` when given."""
    hw = resolve_hardware(args.hardware)
    if args.memory_headroom is None:
        return hw
    if not 0 < args.memory_headroom <= 1:
        raise SystemExit(f"autopar: --memory-headroom must be in (0, 1], got {args.memory_headroom} "
                         f"(a fraction of the {hw.hbm_bytes / 2**30:.0f} GiB of a {hw.gpu})")
    return replace(hw, memory_headroom=args.memory_headroom)


def cluster(args: argparse.Namespace) -> Cluster:
    """``--gpus`` GPUs of ``--hardware`` training a global batch of ``--batch`` sequences."""
    return Cluster(args.gpus, hardware(args), args.batch)


_DISPATCH_FLAG: dict[str, tuple[str, ...]] = {"allgather": ("allgather",), "alltoall": ("alltoall",),
                                              "search": ("allgather", "alltoall")}
"""``--expert-dispatch`` -> the dispatchers the planner tries with ep > 1."""


def search_space(args: argparse.Namespace, spec: ModelSpec | None = None, hw: Hardware | None = None) -> SearchSpace:
    """The layouts the flags allow. Without ``--kernels``: fused kernels (Megatron's, autopar compiled),
    or op by op (autopar's eager chunks) where ``hw`` measured ``spec``'s layer on them."""
    kernels = getattr(args, "kernels", None) or (
        "op-by-op" if spec is not None and hw is not None and measured_this_layer(spec, hw) else "fused")
    one = (lambda x: None if x is None else (x,))
    return SearchSpace(
        t=one(args.tp), p=one(args.pp), v=one(args.vp), b=one(args.micro_batch),
        schedules=schedule_choices(args.schedule, args.vp),
        include_unrunnable=args.tp is not None and args.pp is not None,  # a layout the user fixes
        recompute=RECOMPUTE_FLAG[args.recompute],
        dp_overlap=args.dp_overlap, pipeline_dp_overlap=args.dp_overlap_pipelined,
        scatter_gather=not args.no_scatter_gather,
        divisible_layers=not args.uneven_layers,
        sequence_parallel=FEATURE_FLAG[args.sequence_parallel],
        distributed_optimizer=FEATURE_FLAG[args.distributed_optimizer],
        fused_kernels=kernels == "fused",
        ep=one(getattr(args, "ep", None)),
        cp=_context_degrees(args),
        expert_dispatch=_DISPATCH_FLAG[getattr(args, "expert_dispatch", "search")],
    )


def _context_degrees(args: argparse.Namespace) -> tuple[int, ...] | None:
    """``--cp``'s degrees; without it 1 when ``--tp`` and ``--pp`` fix the layout (so that d is
    n / (t p), as they say), else None: the planner's own choice."""
    named = getattr(args, "cp", None)
    if named is not None:
        return named
    return (1,) if args.tp is not None and args.pp is not None else None


def fixed_layout(args: argparse.Namespace, space: SearchSpace) -> Layout:
    """The layout ``--tp --pp --micro-batch`` (and ``--vp``, ``--schedule``, ``--ep``, ``--expert-dispatch``:
    the all-gather one unless 'alltoall' is asked for; ``--cp``: its first degree) fix on ``--gpus`` GPUs."""
    cp = (space.cp or (1,))[0]
    return Layout(t=args.tp, p=args.pp, d=args.gpus // (args.tp * args.pp * cp), b=args.micro_batch, cp=cp,
                  v=chunks_per_stage(args.schedule, args.vp), schedule=args.schedule or "",
                  recompute=RECOMPUTE_FLAG[args.recompute][0], scatter_gather=not args.no_scatter_gather,
                  dp_overlap=space.overlap_for(args.pp), fused_kernels=space.fused_kernels,
                  ep=getattr(args, "ep", None) or 1, expert_dispatch=space.expert_dispatch[0])


def versus_estimate(args: argparse.Namespace, spec: ModelSpec, cluster: Cluster,
                    space: SearchSpace) -> Estimate | None:
    """The fastest layout of ``space`` with the ``--vs-*`` flags replacing its restrictions, or
    None without them; its search's own error when no layout is valid or fits."""
    flags = {"t": args.vs_tp, "p": args.vs_pp, "v": args.vs_vp, "b": args.vs_micro_batch}
    if all(x is None for x in flags.values()):
        return None
    over = {k: (x,) for k, x in flags.items() if x is not None}
    if args.vs_vp is not None:
        over["schedules"] = schedule_choices(None, args.vs_vp)[:1]
    other = replace(space, **over, include_unrunnable=True)
    plan = search(spec, cluster, other, top=1)
    if plan.ranked:
        return plan.ranked[0]
    if plan.too_big:
        return plan.too_big[0]
    raise CliError(f"--vs-*: {plan.no_fit_message()}")
