"""The main job: train a small GPT with 3D parallelism on local CPU ranks, the whole life of a run.

    python examples/train_gpt.py                 # 8 ranks: tp=2 x pp=2 (interleaved, v=2) x dp=2,
                                                 # sequence parallelism where it fits, AdamW sharded over dp
    python examples/train_gpt.py --schedule zbv  # the zero-bubble V schedule (B and W split)
    python examples/train_gpt.py --resume        # continue from the newest checkpoint, exactly
    python examples/train_gpt.py --tp 2 --pp 1 --dp 1 --steps 100
    python examples/train_gpt.py --model moe     # a mixture of experts (8 experts, top-2, a shared
                                                 # expert), expert parallelism ep=2 inside dp
    autopar run --nproc 8 examples/train_gpt.py  # or torchrun --nproc-per-node 8 examples/train_gpt.py
    autopar run --nproc 8 --max-restarts 3 examples/train_gpt.py --crash-at-step 30
                                                 # a rank dies at step 30; the launcher restarts the
                                                 # ranks, which resume from the newest checkpoint

The model is compiled first (bad layouts fail here, before any process
starts) and its plan printed; the local CPU ranks are forked from this
process and run that same program (GPU ranks start fresh and compile their
own). Each data-parallel replica reads its own batches
of the training text (its 1/dp of each global batch, read from one order of the
corpus per epoch that no layout changes); every --eval-every steps the model is evaluated on held-out
text; every --save-every steps a checkpoint is saved asynchronously (training
goes on while the files are written; it becomes ``latest`` once every rank has
finished). A step whose loss or gradient norm is NaN or infinite is skipped
and logged (engine.optimizer_step); three in a row stop the run, and a
checkpoint is never written with non-finite weights. --resume continues from
the newest complete checkpoint: parameters, AdamW moments, learning-rate
schedule, random streams and data position, so the losses are those of an
uninterrupted run. A job restarted by its launcher (``autopar run
--max-restarts``, torchrun's ``--max-restarts``: the restart count
``autopar.restart_count()`` > 0) resumes the same way without the flag; one
started on another number of ranks than its layout asks for takes the
planner's layout for that world and the same global batch, and reads on in
the same global order of samples. A run from step 0 checks its
first step against single-device training (same loss, same gradients). The
last line reports the final training loss, the one the progress bar shows,
and the throughput as the bar shows it (``throughput``): global tokens per
second, the tokens of one step over all replicas divided by the median step
time of the steps run so far (optimizer step included; evaluation and
checkpoint saves not).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import statistics
import time
from pathlib import Path

import torch

import autopar
from autopar.core.config import SCHEDULE_NAMES
from autopar.reference.data import CorpusWindows
from autopar.reference.models import ModelConfig, MoEConfig, build, moe_outputs
from autopar.reference.parity import FP32_TOLERANCE, assert_parity, single_device_run
from autopar.runtime.launch import default_backend

CFG = ModelConfig(vocab_size=256, seq_len=64, n_layer=4, n_head=4, d_model=128, dropout=0.0)
MOE_CFG = MoEConfig(vocab_size=256, seq_len=64, n_layer=4, n_head=4, d_model=128, dropout=0.0, n_experts=8, top_k=2,
                    d_expert=128, d_shared=128)
"""``--model moe``: the GPT with a mixture of experts in every layer (E=8, top-2, a shared expert), the
load-balancing and z auxiliary losses in the training loss."""
EVAL_BATCHES = 2
SEQUENCE_PARALLEL = {"auto": None, "on": True, "off": False}
"""``--sequence-parallel`` -> ``parallelize(sequence_parallel=...)``."""
"""Held-out batches per evaluation (per replica)."""


def make_model(kind: str = "gpt") -> torch.nn.Module:
    torch.manual_seed(0)
    return build("gpt-moe", MOE_CFG) if kind == "moe" else build("gpt", CFG)


def losses(kind: str, model: torch.nn.Module) -> dict:
    """``parallelize``'s loss options: the token-mean cross-entropy (the default), or for the mixture of
    experts the model's own loss over its (logits, auxiliary loss) output."""
    return dict(loss_fn=model.loss, output_fn=moe_outputs) if kind == "moe" else {}


def lr_factor(step: int, steps: int) -> float:
    """Linear warm-up over the first tenth of the steps, then cosine decay to a tenth."""
    warmup = max(1, steps // 10)
    if step < warmup:
        return (step + 1) / warmup
    progress = (step - warmup) / max(1, steps - warmup)
    return 0.1 + 0.45 * (1 + math.cos(math.pi * min(progress, 1.0)))


class ReplicaData:
    """One data-parallel replica's rows of each global batch. Every epoch has one order of the corpus
    windows (a permutation seeded by the epoch, the same whatever the layout); global batch ``b`` of an
    epoch is the ``global_rows`` windows at ``b * global_rows`` of that order, and replica ``r`` of ``d``
    reads its ``r``-th 1/d of them. ``batch(step)`` is a pure function of the step, and which samples a
    step reads does not depend on d: a run resumed on another number of replicas sees every sample
    once, as the uninterrupted run does."""

    def __init__(self, split: str, global_rows: int, dp_size: int, dp_rank: int, shuffle: bool = True):
        if global_rows % dp_size:
            raise SystemExit(f"a global batch of {global_rows} sequences does not split over {dp_size} replicas")
        self.data = CorpusWindows(CFG.seq_len, split)
        self.global_rows, self.rows, self.dp_rank, self.shuffle = global_rows, global_rows // dp_size, dp_rank, shuffle
        self.per_epoch = len(self.data) // global_rows

    def position(self, step: int) -> dict:
        """Where step ``step`` reads: the epoch, the global batch within it and its size (saved with
        checkpoints: a position in the global order, not in a replica's)."""
        return {"epoch": step // self.per_epoch, "batch": step % self.per_epoch, "global_rows": self.global_rows}

    def samples(self, step: int) -> list[int]:
        """The corpus windows of step ``step``'s global batch, every replica's, in replica order."""
        at = self.position(step)
        order = (torch.randperm(len(self.data), generator=torch.Generator().manual_seed(at["epoch"]))
                 if self.shuffle else torch.arange(len(self.data)))
        return order[at["batch"] * self.global_rows: (at["batch"] + 1) * self.global_rows].tolist()

    def batch(self, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        indices = self.samples(step)[self.dp_rank * self.rows: (self.dp_rank + 1) * self.rows]
        xs, ys = zip(*(self.data[i] for i in indices))
        return torch.stack(xs), torch.stack(ys)


def compile_program(args, world_size=None) -> autopar.ParallelProgram:
    x, y = ReplicaData("train", args.micro_batch, 1, 0).batch(0)  # one microbatch: the shapes
    model = make_model(args.model)
    return autopar.parallelize(model, tp=args.tp, pp=args.pp, dp=args.dp, virtual_stages=args.vp,
                               ep=args.ep, **losses(args.model, model),
                               microbatches=args.microbatches, schedule=args.schedule, recompute=args.recompute,
                               precision=args.precision, sequence_parallel=SEQUENCE_PARALLEL[args.sequence_parallel],
                               example_inputs=(x,), example_targets=y, world_size=world_size,
                               compile=None if args.compile == "none" else args.compile)


def global_rows(args) -> int:
    """Sequences of one step over every replica."""
    return args.micro_batch * args.microbatches * args.dp


def global_batch(args, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Every replica's batch of ``step``, in replica order: what one device would train on."""
    return ReplicaData("train", global_rows(args), 1, 0).batch(step)


def evaluate(engine, heldout: ReplicaData) -> float:
    return statistics.mean(engine.eval_step(*heldout.batch(i)) for i in range(EVAL_BATCHES))


def step_tokens(args) -> int:
    """Tokens of one training step over all data-parallel replicas."""
    return args.micro_batch * args.microbatches * args.dp * CFG.seq_len


def throughput(tokens_per_step: int, step_times: list[float]) -> str:
    """Global tokens per second of the steps run so far, as the progress bar and the last line
    print it: ``tokens_per_step`` over the median of ``step_times`` (seconds), e.g.
    ``12,345 tokens/s``; ``- tokens/s`` before the first step."""
    if not step_times:
        return "- tokens/s"
    return f"{tokens_per_step / statistics.median(step_times):,.0f} tokens/s"


def _bar(main: bool):
    from rich.progress import BarColumn, Progress, TextColumn, TimeRemainingColumn

    columns = [TextColumn("[bold]step {task.completed}/{task.total}"), BarColumn(),
               TextColumn("loss {task.fields[loss]:.3f}  eval {task.fields[eval]:.3f}  {task.fields[tps]}"),
               TimeRemainingColumn()]
    return Progress(*columns, disable=not main, transient=False)


def train(args, program: autopar.ParallelProgram | None = None):
    """One rank's run: ``program`` is the one compiled before the ranks started (None: compile it here)."""
    import torch.distributed as dist

    engine = (program or compile_program(args)).materialize()
    if args.distributed_optimizer:  # AdamW's state sharded over the data-parallel replicas
        opt = engine.distributed_optimizer(torch.optim.AdamW, lr=args.lr, weight_decay=0.01)
    else:
        opt = torch.optim.AdamW(engine.parameters(), lr=args.lr, weight_decay=0.01)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: lr_factor(step, args.steps))
    rows = global_rows(args)  # every replica's sequences per step
    data = ReplicaData("train", rows, engine.dp_size, engine.dp_rank)
    heldout = ReplicaData("heldout", rows, engine.dp_size, engine.dp_rank, shuffle=False)
    start, root = 0, Path(args.ckpt_dir)
    if _resuming(args) and (root / "latest").exists():
        start, _ = engine.load(str(root), opt, sched)
    out = {"start": start, "losses": [], "evals": [], "times": [], "grads": None, "load": {}}
    stop, pending, eval_loss = min(args.steps, args.stop_at or args.steps), None, float("nan")
    tokens = step_tokens(args)  # rows * engine.dp_size * CFG.seq_len: the last line's count too
    with _bar(dist.get_rank() == 0) as bar:
        task = bar.add_task("train", total=args.steps, completed=start, loss=float("nan"), eval=eval_loss,
                            tps=throughput(tokens, []))
        for step in range(start, stop):
            t0 = time.perf_counter()
            if step == start and args.compile != "none" and dist.get_rank() == 0:
                bar.console.print(f"compiling each chunk with {args.compile} at its first run "
                                  "(Inductor: tens of seconds per chunk on CPU ranks)...")
            if step == args.crash_at_step and autopar.restart_count() == 0:
                # the fault drill: the last rank dies at this step of the first start, as a lost node would,
                # once the checkpoint in flight has landed on every rank (so that the restart resumes from it
                # whatever the machine's load; a real fault can lose the one in flight, and resumes from the
                # one before)
                if pending is not None:
                    pending.wait()
                    pending = None
                if dist.get_rank() == dist.get_world_size() - 1:
                    os._exit(17)
            out["losses"].append(engine.train_step(*data.batch(step)))
            if step == start and args.compile != "none" and dist.get_rank() == 0:
                for (mode, chunk), report in sorted(engine.compiled().items()):
                    bar.console.print(f"  chunk {chunk} ({mode}) on rank 0: {report.describe()}")
            engine.clip_grad_norm_(args.clip)
            if step == 0:
                out["grads"] = engine.full_grads()
            engine.optimizer_step(opt, sched)  # skips a step whose loss or gradient norm is not finite
            out["times"].append(time.perf_counter() - t0)
            if (step + 1) % args.eval_every == 0 or step + 1 == stop:
                eval_loss = evaluate(engine, heldout)
                out["evals"].append((step + 1, eval_loss))
            if (step + 1) % args.save_every == 0 or step + 1 == stop:
                if pending is not None:
                    pending.wait()
                pending = engine.save(str(root), opt, step=step + 1, scheduler=sched,
                                      extra={"data": data.position(step + 1)}, async_save=True)
            if args.loss_log and dist.get_rank() == 0:  # every step's loss, appended as it is known
                Path(args.loss_log).parent.mkdir(parents=True, exist_ok=True)
                with open(args.loss_log, "a") as log:
                    log.write(json.dumps({"step": step + 1, "loss": out["losses"][-1], "restart": autopar.restart_count(),
                                          "world": dist.get_world_size(), "samples": data.samples(step)}) + "\n")
            bar.update(task, advance=1, loss=out["losses"][-1], eval=eval_loss, tps=throughput(tokens, out["times"]))
            out["load"] = engine.expert_load()  # rows routed to each expert this step (layers of this stage)
    if pending is not None:
        pending.wait()
    return out


def _args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="gpt", choices=["gpt", "moe"],
                    help="the GPT, or the GPT with a mixture of experts in every layer (8 experts, top-2)")
    ap.add_argument("--ep", type=int, default=None,
                    help="expert parallelism inside dp (--model moe): each rank holds 8/ep experts; default 2 "
                         "when dp is even, else 1")
    ap.add_argument("--tp", type=int, default=2)
    ap.add_argument("--pp", type=int, default=2)
    ap.add_argument("--dp", type=int, default=2)
    ap.add_argument("--vp", type=int, default=2, help="virtual stages per pipeline stage (interleaved)")
    ap.add_argument("--microbatches", type=int, default=4)
    ap.add_argument("--schedule", default=None, choices=SCHEDULE_NAMES,
                    help="pipeline schedule (default: interleaved when --vp > 1, else 1f1b; zbv needs --vp 2)")
    ap.add_argument("--sequence-parallel", default="auto", choices=sorted(SEQUENCE_PARALLEL),
                    help="norms, dropout and residuals split over the tensor-parallel ranks (auto: where they fit)")
    ap.add_argument("--distributed-optimizer", action=argparse.BooleanOptionalAction, default=True,
                    help="shard AdamW's state over the data-parallel replicas (default on)")
    ap.add_argument("--micro-batch", type=int, default=2, help="sequences per microbatch")
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--clip", type=float, default=1.0)
    ap.add_argument("--recompute", default="none", choices=["none", "layer", "chunk"])
    ap.add_argument("--precision", default="fp32", choices=["fp32", "bf16"])
    ap.add_argument("--compile", default="none", choices=["none", "inductor", "aot_eager"],
                    help="compile each chunk with torch.compile (Inductor: fused kernels) at its first run")
    ap.add_argument("--eval-every", type=int, default=20, help="evaluate on held-out text every N steps")
    ap.add_argument("--save-every", type=int, default=20, help="save a checkpoint every N steps (asynchronously)")
    ap.add_argument("--ckpt-dir", default="runs/train_gpt", help="where checkpoints go (step-N/ and latest)")
    ap.add_argument("--resume", action="store_true", help="continue from the newest checkpoint in --ckpt-dir")
    ap.add_argument("--stop-at", type=int, default=None,
                    help="stop after this step, as an interrupted run would (the schedule still spans --steps)")
    ap.add_argument("--loss-log", default=None,
                    help="append each step's loss to this file as a JSON line ({step, loss, restart, world, samples: "
                         "the corpus windows of the global batch}), rank 0")
    ap.add_argument("--crash-at-step", type=int, default=None,
                    help="a fault drill: the last rank dies (exit code 17) at this step of the job's first start; "
                         "run under autopar run --max-restarts (or torchrun --max-restarts) to see it resume")
    args = ap.parse_args()
    if args.pp == 1:
        args.vp = 1
    if args.ep is None:
        args.ep = 2 if args.model == "moe" and args.dp % 2 == 0 else 1
    return args


def _resuming(args) -> bool:
    """Continue from the newest checkpoint: asked for (--resume), or a restart by the launcher
    (``autopar run --max-restarts`` or torchrun's), which resumes without a flag."""
    return args.resume or autopar.restart_count() > 0


def check_parity(args, out) -> None:
    """Step 0 against single-device training on every replica's batch: the same loss and gradients."""
    x, y = global_batch(args, 0)
    first_lr = args.lr * lr_factor(0, args.steps)  # the schedule's lr at step 0
    optimizer = lambda ps: torch.optim.AdamW(ps, lr=first_lr, weight_decay=0.01)  # noqa: E731
    model = make_model(args.model)
    loss = losses(args.model, model)  # a mixture of experts' auxiliary losses are per microbatch, as trained:
    chunks = args.dp * args.microbatches if args.model == "moe" else 1  # the batch in the engine's microbatches
    ref_losses, ref_grads = single_device_run(model, [((x,), (y,))], loss.get("loss_fn", autopar.lm_cross_entropy),
                                              optimizer=optimizer, clip_grad_norm=args.clip,
                                              precision=args.precision, output_fn=loss.get("output_fn"),
                                              chunks=chunks)
    tol = FP32_TOLERANCE if args.precision == "fp32" else {"rtol": 2e-2, "atol": 1e-3, "rel_norm": 5e-2}
    assert_parity(ref_losses, ref_grads[0], out["losses"][:1], out["grads"], label="step 0", **tol)
    print(f"parity: step 0's loss ({ref_losses[0]:.6f}) and all {len(ref_grads[0])} gradients match "
          f"single-device training (rtol {tol['rtol']:g}, atol {tol['atol']:g})")


def fit_layout(args, world: int) -> str | None:
    """Started on another number of ranks than ``--tp x --pp x --dp`` (a job resumed on fewer or more
    machines): the planner's fastest layout of ``world`` ranks that fits in memory, for the same global
    batch (so the run continues the same optimisation, and the global sample order reads on where it
    stopped), written into ``args``; what changed, or None when the layout stays."""
    if world == args.tp * args.pp * args.dp:
        return None
    from autopar.planning.search.planner import SearchSpace

    rows = global_rows(args)
    x, _ = ReplicaData("train", args.micro_batch, 1, 0).batch(0)
    space = SearchSpace(schedules=("1f1b", "interleaved"), cp=(1,), ep=None if args.model == "moe" else (1,),
                        distributed_optimizer=(args.distributed_optimizer,))
    best = autopar.plan(make_model(args.model), (x,), gpus=world, global_batch=rows, space=space, top=3).best
    lay, before = best.layout, f"tp={args.tp} x pp={args.pp} x dp={args.dp}"
    args.tp, args.pp, args.dp, args.vp = lay.t, lay.p, lay.d, lay.v
    args.micro_batch, args.microbatches = lay.b, rows // (lay.d * lay.b)
    args.schedule, args.recompute = lay.schedule or None, str(getattr(lay.recompute, "value", lay.recompute))
    args.ep = lay.ep
    args.sequence_parallel = "on" if lay.sequence_parallel else "off"
    return (f"{world} ranks, not the {before} asked for: the planner's layout for {world} ranks and the same "
            f"{rows} sequences a step is tp={lay.t} x pp={lay.p} x dp={lay.d} (v={lay.v}, {args.microbatches} "
            f"microbatches of {lay.b}, {lay.schedule or '1f1b'}), {best.memory.total / 2**30:.2f} GiB per rank "
            f"predicted")


def main() -> None:
    args = _args()
    latest = Path(args.ckpt_dir) / "latest"
    if latest.exists() and not _resuming(args):  # before any work: a new run would collide with its saves
        raise SystemExit(f"{args.ckpt_dir} holds a run (newest checkpoint {latest.read_text().strip()}): add "
                         f"--resume to continue it, or --ckpt-dir DIR for a new run")
    launched = "RANK" in os.environ  # under torchrun / autopar run this process is one rank
    refit = fit_layout(args, int(os.environ["WORLD_SIZE"])) if launched else None
    world = args.tp * args.pp * args.dp
    is_main = os.environ.get("RANK", "0") == "0"
    program = compile_program(args, world_size=world)
    if is_main:
        if refit:
            print(f"elastic: {refit}")
        print(program.summary())
        print(program.schedule.wrapped(min(shutil.get_terminal_size().columns, 120)))
        tokens = step_tokens(args)
        print(f"\ntraining on {world} {'ranks' if launched else 'local CPU ranks (gloo)'}: "
              f"{args.steps} steps of {tokens} tokens; checkpoints in {args.ckpt_dir}")
    # The ranks run the program compiled above: forked from this process (CPU ranks), or this process
    # itself under a launcher. Fresh GPU ranks compile their own (a compiled program is not picklable).
    shared = launched or default_backend(world) == "gloo"
    out = autopar.spawn(train, world, (args, program if shared else None), inherit=shared and not launched)[0]
    if not is_main:
        return
    if out["start"]:
        print(f"resumed from {args.ckpt_dir} at step {out['start']}")
    if out["grads"] is not None:
        check_parity(args, out)
    if not out["losses"]:
        print(f"nothing to do: the checkpoint is at step {out['start']} of {args.steps}")
        return
    median = statistics.median(out["times"])
    evals = ", ".join(f"{loss:.3f} (step {s})" for s, loss in out["evals"])
    print(f"held-out loss: {evals}")
    for layer, rows in out["load"].items():  # rank 0's stage: its layers' experts
        print(f"expert load at the last step, {layer}: {rows} rows per expert (max/mean "
              f"{max(rows) / statistics.mean(rows):.2f})")
    print(f"final loss {out['losses'][-1]:.3f} at step {out['start'] + len(out['losses'])} "
          f"(first {out['losses'][0]:.3f}); median step {median * 1e3:.0f} ms, "
          f"{throughput(step_tokens(args), out['times'])}")


if __name__ == "__main__":
    main()
