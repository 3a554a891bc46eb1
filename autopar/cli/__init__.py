"""The ``autopar`` command line.

    autopar plan --model gpt-39b --gpus 512 --batch 1536 --hardware dgx-a100-80gb
    autopar plan --hf-config path/to/config.json --gpus 64 --batch 512 --seq-len 4096
    autopar plan --layers 48 --hidden 8192 --heads 64 --gpus 512 --batch 1536 --tp 8 --pp 2 --vp 4 --micro-batch 4
    autopar plan ... --json          # the same results as JSON
    autopar plan ... --explain       # the paper's formulas, symbolic and with values
    autopar plan ... --tp 8 --pp 8 --vs-tp 16 --vs-pp 4   # two layouts' terms side by side
    autopar simulate --model gpt-76b --gpus 1024 --batch 1792 --tp 8 --pp 4 --vp 3 --micro-batch 2 --svg step.svg
    autopar simulate --pp 4 --vp 2 --microbatches 8         # unit costs (F = 1, B = 2)
    autopar simulate ... --eager     # draw the planner's eager-send model instead of the lowered schedule
    autopar simulate --measured step.json   # a trace engine.write_trace wrote, beside its simulation
    autopar export checkpoints/ --to-hf hf-model/   # a saved checkpoint as a HuggingFace directory
    autopar tune --model gpt-1.7b --nproc 2          # measure these machines: a hardware profile (JSON)
    autopar plan --model gpt-1.7b --gpus 2 --batch 16 --hardware autopar-hardware.json   # priced with it

``--recompute`` takes 'layer' (Megatron's "full" recomputation; 'full' is accepted as an
alias), 'none' or 'any' (the default: try both).

One module per job: ``arguments.py`` (the parsers), ``model_args.py`` and ``hf_models.py``
(the model the flags describe), ``layout_args.py`` (the cluster, the search space, the
schedules ``--schedule`` and ``--vp`` allow), ``render.py`` (the console and the tables), and
one module per command: ``plan.py``, ``simulate.py``, ``tune.py``, ``run.py``, ``export.py``.
"""

from __future__ import annotations

import sys

from autopar.cli.arguments import build_parser
from autopar.cli.export import run_export
from autopar.cli.plan import run_plan
from autopar.cli.render import make_console
from autopar.cli.run import run_ranks
from autopar.cli.simulate import run_simulate
from autopar.cli.tune import run_tune

__all__ = ["main", "build_parser"]


def main(argv: list[str] | None = None) -> int:
    """Run the command ``argv`` (default: the process's arguments) names; its exit status. A
    ``ValueError`` (a refusal of autopar's) prints as ``autopar <command>: <message>``, status 2."""
    argv = list(argv) if argv is not None else sys.argv[1:]
    args = build_parser().parse_args(argv)
    console = make_console()
    try:
        if args.command == "plan":
            return run_plan(args, console)
        if args.command == "simulate":
            return run_simulate(args, console)
        if args.command == "run":
            return run_ranks(args)
        if args.command == "export":
            return run_export(args, console)
        if args.command == "tune":
            return run_tune(args, console, argv)
    except ValueError as e:
        console.print(f"[red]autopar {args.command}: {e}[/red]", highlight=False)
        return 2
    return 1
