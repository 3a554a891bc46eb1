"""The fault drill: the main job, killed or stopped at a random rank and moment, restarts and resumes exactly.

    .venv/bin/python bench/chaos.py [--runs 50] [--seed 0] [--quick] [--dir DIR] [--keep] [--budget-min M]
    .venv/bin/python bench/chaos.py --runs 1 --only SIGSTOP:3:save:2 --py-spy PATH   # one fault, stacks if late

The job is ``examples/train_gpt.py`` (its GPT: 4 layers, d_model 128,
vocabulary 256) on 4 CPU ranks at tp=1 x pp=2 (interleaved, v=2) x dp=2,
``STEPS`` steps, a checkpoint every 2 steps (asynchronous), each step's loss
in a ``--loss-log``. First one uninterrupted run, the reference: its losses,
and its checkpoints loaded once each (see below). Then ``--runs`` chaos runs,
each in a fresh checkpoint directory:

1. ``autopar run --nproc 4 --max-restarts 1`` starts the job with
   ``AUTOPAR_FAILURE_TIMEOUT=10`` (a rank that stops answering is failed by
   the others after 10 s instead of 300 s).
2. The drill finds the 4 rank processes (the launcher's children, by
   ``RANK`` in ``/proc/<pid>/environ``), waits for the moment drawn for the
   run and sends one random rank SIGKILL (a lost process) or SIGSTOP (a hung
   one: alive, answering nothing), half each. The moment: during a training
   step (``step``: after the loss log reached a random step, plus a random
   part of a step), or during a checkpoint save (``save``: once a random
   ``step-N.partial/`` directory appears, plus up to 50 ms).
3. It watches the processes every 10 ms: when the other ranks of that start
   (the survivors) have all exited, when the stopped rank is gone (the
   launcher sends SIGTERM, then SIGKILL after its grace of 10 s), and when
   the job ends. Survivors still running
   ``FAILURE_TIMEOUT_S + SLACK_S`` after the fault are late; a stopped rank
   still there ``STOP_GRACE_S + SLACK_S`` after the survivors left was left
   behind by the launcher (the drill kills it). A job not ended
   ``HANG_AFTER_FAULT_S`` after the fault, or ``DEADLINE_S`` after its start,
   hangs: every process of it is killed (SIGCONT, SIGKILL).
4. Once the job has ended (the launcher restarted all ranks, which resumed
   from ``latest``): every loss in the log, the first start's and the
   restart's, must equal the reference run's at the same step bitwise, and
   the steps after the resume point must all be there up to the last. Every
   published ``step-N/`` must load, through ``engine.load`` into a
   one-process engine of the same model (resharded from the job's layout),
   to weights, AdamW moments, learning-rate schedule and data position
   bitwise equal to the reference checkpoint of step N loaded the same way;
   ``latest`` must name the newest of them. ``step-N.partial/`` directories
   (saves interrupted by the fault) are counted; the loader never reads them.

Printed: one line per run (the fault, what happened, the counts so far),
then the table of counts and medians. A run's directory (checkpoints, loss
log, the job's output) is removed when the run passed, kept when it did not
(or with ``--keep``).
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import json
import os
import random
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "examples" / "train_gpt.py"
WORLD = 4
STEPS, SAVE_EVERY = 10, 2
JOB_FLAGS = ["--tp", "1", "--pp", "2", "--dp", "2", "--steps", str(STEPS), "--save-every", str(SAVE_EVERY),
             "--eval-every", "1000"]
"""The job at 4 ranks: two pipeline stages (interleaved, v=2, 4 microbatches) times two replicas."""
FAILURE_TIMEOUT_S = 10.0
"""``AUTOPAR_FAILURE_TIMEOUT`` of the chaos runs."""
SLACK_S = 5.0
"""What survivors may take past the failure timeout to exit (a loaded 2-core machine), and a stopped
rank past the launcher's grace."""
STOP_GRACE_S = 10.0
"""The launcher's grace between SIGTERM and SIGKILL when a rank failed (``_run_once``)."""
DEADLINE_S = 180.0
"""A job not finished this long after its start hangs."""
HANG_AFTER_FAULT_S = 90.0
"""A job not finished this long after the fault hangs: the failure timeout, the launcher's grace and a
whole restart (~20 s here) take under 60 s."""
POLL_S = 0.01
FAULTS = (("step", 0.6), ("save", 0.4))
"""Where faults land, and how often."""


# ---------------------------------------------------------------- processes
def _stat(pid: int) -> tuple[str, int] | None:
    """(state letter, parent pid) of ``pid``, or None when it is gone."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = text[text.rindex(")") + 2:].split()
    return fields[0], int(fields[1])


def alive(pid: int) -> bool:
    """Running or stopped: neither gone nor a zombie waiting to be reaped."""
    stat = _stat(pid)
    return stat is not None and stat[0] not in "ZX"


def _environ(pid: int) -> dict[str, str]:
    try:
        raw = Path(f"/proc/{pid}/environ").read_bytes()
    except OSError:
        return {}
    return dict(item.split("=", 1) for item in raw.decode(errors="replace").split("\0") if "=" in item)


def children(pid: int) -> list[int]:
    out = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            stat = _stat(int(entry))
            if stat is not None and stat[1] == pid:
                out.append(int(entry))
    return out


def descendants(pid: int) -> list[int]:
    found, todo = [], [pid]
    while todo:
        kids = children(todo.pop())
        found += kids
        todo += kids
    return found


def rank_pids(launcher: int, restart: int) -> dict[int, int]:
    """Rank -> pid of the launcher's rank processes of start ``restart`` (alive ones)."""
    out = {}
    for pid in children(launcher):
        env = _environ(pid)
        if "RANK" in env and env.get("TORCHELASTIC_RESTART_COUNT") == str(restart) and alive(pid):
            out[int(env["RANK"])] = pid
    return out


def kill_all(proc: subprocess.Popen) -> None:
    """The launcher and every process under it: continued (a stopped one) and killed."""
    for pid in [*descendants(proc.pid), proc.pid]:
        for sig in (signal.SIGCONT, signal.SIGKILL):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, sig)
    proc.wait()


# ----------------------------------------------------------------- the job
def job_command(ckpt: Path, loss_log: Path, max_restarts: int) -> list[str]:
    return [sys.executable, "-m", "autopar.cli", "run", "--nproc", str(WORLD), "--max-restarts", str(max_restarts),
            str(SCRIPT), *JOB_FLAGS, "--ckpt-dir", str(ckpt), "--loss-log", str(loss_log)]


def start_job(run_dir: Path, max_restarts: int) -> subprocess.Popen:
    run_dir.mkdir(parents=True)
    env = dict(os.environ, PYTHONPATH=str(ROOT), AUTOPAR_FAILURE_TIMEOUT=str(int(FAILURE_TIMEOUT_S)))
    out = open(run_dir / "job.log", "w")
    return subprocess.Popen(job_command(run_dir / "ckpt", run_dir / "loss.jsonl", max_restarts), cwd=ROOT, env=env,
                            stdout=out, stderr=subprocess.STDOUT, start_new_session=True)


def read_losses(path: Path) -> tuple[list[dict], int]:
    """The loss log's lines, and how many could not be read (a line torn by the fault)."""
    lines, torn = [], 0
    if path.exists():
        for text in path.read_text().splitlines():
            try:
                lines.append(json.loads(text))
            except ValueError:
                torn += 1
    return lines, torn


# -------------------------------------------------------------- checkpoints
def _train_gpt():
    spec = importlib.util.spec_from_file_location("train_gpt", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


class CheckpointReader:
    """Loads a checkpoint the way a resumed job does (``engine.load`` with AdamW and the learning-rate
    schedule), into a one-process engine of the job's model, and keeps what it loaded."""

    def __init__(self) -> None:
        self.job = _train_gpt()
        argv, sys.argv = sys.argv, ["train_gpt.py", "--tp", "1", "--pp", "1", "--dp", "1"]
        try:
            self.args = self.job._args()
        finally:
            sys.argv = argv
        self.program = self.job.compile_program(self.args, world_size=1)

    def load(self, step_dir: Path) -> dict:
        engine = self.program.materialize()
        optimizer = torch.optim.AdamW(engine.parameters(), lr=self.args.lr, weight_decay=0.01)
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: self.job.lr_factor(s, STEPS))
        step, extra = engine.load(str(step_dir), optimizer, scheduler)
        state = optimizer.state_dict()["state"]
        return {"step": step, "extra": extra, "weights": engine.full_state_dict(),
                "optimizer": {f"{i}.{k}": v for i, s in state.items() for k, v in s.items()},
                "scheduler": {k: v for k, v in scheduler.state_dict().items() if k != "lr_lambdas"}}


def differences(loaded: dict, reference: dict) -> list[str]:
    """What differs, bitwise, between two loaded checkpoints."""
    out = [k for k in ("step", "extra", "scheduler") if loaded[k] != reference[k]]
    for part in ("weights", "optimizer"):
        a, b = loaded[part], reference[part]
        if a.keys() != b.keys():
            out.append(f"{part} keys")
        out += [f"{part}.{k}" for k in a.keys() & b.keys() if not torch.equal(a[k], b[k])]
    return out


def step_dirs(ckpt: Path) -> dict[int, Path]:
    return {int(p.name[len("step-"):]): p for p in ckpt.glob("step-*") if not p.name.endswith(".partial")}


# -------------------------------------------------------------- the drill
@dataclass
class Fault:
    where: str
    """'step' or 'save'."""
    at: int
    """The step whose loss was logged before the fault ('step'), or the step being saved ('save')."""
    signal: int
    rank: int


@dataclass
class Run:
    fault: Fault
    landed: str = ""
    """Where the fault landed, as seen (e.g. 'step-00000006.partial seen +12 ms')."""
    fault_t: float | None = None
    survivors_out_s: float | None = None
    stopped_out_s: float | None = None
    finished_s: float | None = None
    """From the fault to the job's end."""
    total_s: float = 0.0
    rc: int | None = None
    hang: bool = False
    late: bool = False
    left_behind: bool = False
    resumed_from: int | None = None
    losses_checked: int = 0
    loss_problems: list[str] = field(default_factory=list)
    torn_lines: int = 0
    checkpoints: int = 0
    partials: int = 0
    bad_checkpoints: list[str] = field(default_factory=list)
    leftovers: int = 0

    @property
    def passed(self) -> bool:
        return (not self.hang and not self.late and not self.left_behind and self.rc == 0 and not self.loss_problems
                and not self.bad_checkpoints and not self.leftovers and self.fault_t is not None)


def draw_fault(rng: random.Random) -> Fault:
    where = rng.choices([w for w, _ in FAULTS], [p for _, p in FAULTS])[0]
    at = rng.randrange(1, STEPS) if where == "step" else rng.randrange(SAVE_EVERY, STEPS + 1, SAVE_EVERY)
    return Fault(where, at, rng.choice([signal.SIGKILL, signal.SIGSTOP]), rng.randrange(WORLD))


def parse_fault(text: str) -> Fault:
    """``SIGSTOP:3:step:4`` -> the fault it names (``--only``)."""
    sig, rank, where, at = text.split(":")
    if where not in dict(FAULTS):
        raise SystemExit(f"--only {text}: WHERE is one of {sorted(dict(FAULTS))}, not {where!r}")
    return Fault(where, int(at), signal.Signals[sig], int(rank))


def wait_for_moment(proc: subprocess.Popen, run_dir: Path, fault: Fault, step_s: float,
                    rng: random.Random) -> str | None:
    """Block until the fault's moment; returns where it landed, None when the job ended first."""
    start = time.monotonic()
    partial = run_dir / "ckpt" / f"step-{fault.at:08d}.partial"
    final = run_dir / "ckpt" / f"step-{fault.at:08d}"
    log = run_dir / "loss.jsonl"
    while proc.poll() is None and time.monotonic() - start < DEADLINE_S:
        if fault.where == "save" and (partial.exists() or final.exists()):
            seen = "partial" if partial.exists() else "published"
            delay = rng.uniform(0.0, 0.05)
            time.sleep(delay)
            return f"save of step {fault.at} ({seen} when seen, +{delay * 1e3:.0f} ms)"
        if fault.where == "step" and log.exists() and len(read_losses(log)[0]) >= fault.at:
            delay = rng.uniform(0.0, step_s)
            time.sleep(delay)
            return f"step {fault.at + 1} (+{delay * 1e3:.0f} ms after step {fault.at}'s loss)"
        time.sleep(POLL_S / 2)
    return None


def dump_stacks(py_spy: str, pids: list[int], out: Path) -> None:
    """Every thread's Python stack of each of ``pids`` (``py-spy dump``), appended to ``out``."""
    with open(out, "a") as f:
        for pid in pids:
            f.write(f"==== pid {pid} (RANK {_environ(pid).get('RANK')})\n")
            f.flush()
            subprocess.run([py_spy, "dump", "--pid", str(pid)], stdout=f, stderr=subprocess.STDOUT, timeout=60)


def watch(proc: subprocess.Popen, run: Run, survivors: list[int], stopped: int | None, t0: float, run_dir: Path,
          py_spy: str | None, seen: set[int]) -> None:
    """Follow the job from the fault to its end (or the deadline): the times of ``Run``. Late survivors'
    stacks go to ``run_dir/stacks.txt`` when ``py_spy`` (the py-spy program) is given; the pids of the
    restart's ranks are added to ``seen``."""
    survivors_out = stopped_out = None
    next_scan = 0.0
    while proc.poll() is None:
        now = time.monotonic()
        if survivors_out is None and not any(alive(p) for p in survivors):
            survivors_out = now
            run.survivors_out_s = now - run.fault_t
        if stopped is not None and stopped_out is None and not alive(stopped):
            stopped_out = now
            run.stopped_out_s = now - run.fault_t
        if survivors_out is None and now - run.fault_t > FAILURE_TIMEOUT_S + SLACK_S and not run.late:
            run.late = True
            if py_spy:
                dump_stacks(py_spy, [p for p in survivors if alive(p)], run_dir / "stacks.txt")
        if (stopped is not None and stopped_out is None and survivors_out is not None
                and now - survivors_out > STOP_GRACE_S + SLACK_S):
            run.left_behind = True  # measured; now out of the way so the restart can run
            for sig in (signal.SIGCONT, signal.SIGKILL):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(stopped, sig)
        if now - t0 > DEADLINE_S or now - run.fault_t > HANG_AFTER_FAULT_S:
            run.hang = True
            kill_all(proc)
            break
        if now >= next_scan:  # the restart's ranks, to find any left running once the job is over
            seen.update(rank_pids(proc.pid, 1).values())
            next_scan = now + 0.5
        time.sleep(POLL_S)
    run.finished_s = time.monotonic() - run.fault_t
    if run.survivors_out_s is None and not run.hang and not any(alive(p) for p in survivors):
        run.survivors_out_s = run.finished_s
    run.rc = proc.wait()


def check_losses(run: Run, lines: list[dict], reference: dict[int, float]) -> None:
    for line in lines:
        if line["loss"] != reference.get(line["step"]):
            run.loss_problems.append(f"step {line['step']} (restart {line['restart']}): {line['loss']!r} "
                                     f"!= {reference.get(line['step'])!r}")
    resumed = sorted(line["step"] for line in lines if line["restart"] == 1)
    run.losses_checked = len(resumed)
    if resumed:
        run.resumed_from = resumed[0] - 1
        if resumed != list(range(resumed[0], STEPS + 1)):
            run.loss_problems.append(f"the restart logged steps {resumed}, not {resumed[0]}..{STEPS}")
    elif not any(line["step"] == STEPS for line in lines):
        run.loss_problems.append("the job never logged its last step")


def check_checkpoints(run: Run, ckpt: Path, reader: CheckpointReader, reference: dict[int, dict]) -> None:
    found = step_dirs(ckpt)
    run.checkpoints = len(found)
    run.partials = len(list(ckpt.glob("step-*.partial")))
    for step, path in sorted(found.items()):
        try:
            problems = differences(reader.load(path), reference[step])
        except Exception as e:  # noqa: BLE001 - a checkpoint that fails to load is what the drill counts
            problems = [f"{type(e).__name__}: {str(e)[:200]}"]
        if problems:
            run.bad_checkpoints.append(f"{path.name}: {', '.join(problems[:4])}")
    latest = ckpt / "latest"
    if found and (not latest.exists() or latest.read_text().strip() != found[max(found)].name):
        run.bad_checkpoints.append(f"latest names {latest.read_text().strip() if latest.exists() else None!r}, "
                                   f"not {found[max(found)].name}")


def chaos_run(run_dir: Path, fault: Fault, step_s: float, rng: random.Random, reader: CheckpointReader,
              ref_losses: dict[int, float], ref_checkpoints: dict[int, dict], py_spy: str | None = None) -> Run:
    run = Run(fault)
    t0 = time.monotonic()
    proc = start_job(run_dir, max_restarts=1)
    try:
        ranks: dict[int, int] = {}
        seen: set[int] = set()
        while len(ranks) < WORLD and proc.poll() is None and time.monotonic() - t0 < DEADLINE_S:
            time.sleep(0.05)
            ranks = rank_pids(proc.pid, 0)
        landed = wait_for_moment(proc, run_dir, fault, step_s, rng) if len(ranks) == WORLD else None
        seen.update(ranks.values())
        victim = ranks.get(fault.rank)
        if landed is None or victim is None or not alive(victim):
            run.landed = "missed: the job ended first"
            run.rc = proc.wait() if proc.poll() is not None else None
        else:
            os.kill(victim, fault.signal)
            run.fault_t = time.monotonic()
            run.landed = landed
            survivors = [p for r, p in ranks.items() if r != fault.rank]
            watch(proc, run, survivors, victim if fault.signal == signal.SIGSTOP else None, t0, run_dir, py_spy,
                  seen)
    finally:
        if proc.poll() is None:
            kill_all(proc)
        run.total_s = time.monotonic() - t0
    time.sleep(0.5)  # a process killed a moment ago may not be reaped yet
    run.leftovers = sum(alive(p) for p in seen)
    lines, run.torn_lines = read_losses(run_dir / "loss.jsonl")
    if not run.hang:
        check_losses(run, lines, ref_losses)
    check_checkpoints(run, run_dir / "ckpt", reader, ref_checkpoints)
    return run


def reference_run(work: Path, reader: CheckpointReader) -> tuple[dict[int, float], dict[int, dict], float, float]:
    """The uninterrupted job: its losses by step, its checkpoints loaded by step, its duration, and the
    median time between its loss lines (a step, as the drill sees it)."""
    t0 = time.monotonic()
    proc = start_job(work / "reference", max_restarts=0)
    stamps: dict[int, float] = {}
    log = work / "reference" / "loss.jsonl"
    while proc.poll() is None:
        n = len(read_losses(log)[0]) if log.exists() else 0
        stamps.setdefault(n, time.monotonic())
        time.sleep(POLL_S)
    took = time.monotonic() - t0
    if proc.returncode != 0:
        raise SystemExit(f"the reference run failed (exit {proc.returncode}): see {work / 'reference' / 'job.log'}")
    losses = {line["step"]: line["loss"] for line in read_losses(log)[0]}
    checkpoints = {step: reader.load(path) for step, path in step_dirs(work / "reference" / "ckpt").items()}
    gaps = [stamps[n + 1] - stamps[n] for n in range(1, STEPS) if n in stamps and n + 1 in stamps]
    return losses, checkpoints, took, statistics.median(gaps) if gaps else 0.2


# ------------------------------------------------------------------ report
@dataclass
class Tally:
    runs: list[Run] = field(default_factory=list)

    def count(self, what) -> int:
        return sum(1 for r in self.runs if what(r))

    def line(self) -> str:
        return (f"hangs {self.count(lambda r: r.hang)}, late {self.count(lambda r: r.late)}, "
                f"bad ckpts {sum(len(r.bad_checkpoints) for r in self.runs)}, "
                f"loss diffs {self.count(lambda r: r.loss_problems)}, failed jobs {self.count(lambda r: r.rc not in (0, None) and not r.hang)}")


def describe(i: int, n: int, run: Run) -> str:
    f = run.fault
    what = f"{signal.Signals(f.signal).name} rank {f.rank} at {run.landed}"
    if run.fault_t is None:
        return f"run {i}/{n}: {what}"
    got = [f"survivors out in {run.survivors_out_s:.1f} s" if run.survivors_out_s is not None else
           "survivors still running at the deadline (killed)"]
    if f.signal == signal.SIGSTOP:
        got.append(f"stopped rank out in {run.stopped_out_s:.1f} s" if run.stopped_out_s is not None
                   else "stopped rank still there at the end (killed by the drill)")
    got.append("HANG" if run.hang else f"exit {run.rc} after {run.finished_s:.1f} s")
    if run.resumed_from is not None:
        got.append(f"resumed at step {run.resumed_from}, {run.losses_checked} losses checked")
    got.append(f"{run.checkpoints} ckpts loaded" + (f", {run.partials} partial" if run.partials else ""))
    problems = run.loss_problems[:2] + run.bad_checkpoints[:2]
    if run.left_behind:
        problems.append("stopped rank left behind by the launcher")
    if run.leftovers:
        problems.append(f"{run.leftovers} rank processes left running")
    return f"run {i}/{n}: {what}: {'; '.join(got)}" + (f"  PROBLEMS: {' | '.join(problems)}" if problems else "")


def _median(values: list[float]) -> str:
    return f"{statistics.median(values):.1f} s (max {max(values):.1f})" if values else "-"


def table(tally: Tally, ref_s: float, wall_s: float) -> str:
    runs = [r for r in tally.runs if r.fault_t is not None]
    kill = [r for r in runs if r.fault.signal == signal.SIGKILL]
    stop = [r for r in runs if r.fault.signal == signal.SIGSTOP]
    rows = [
        ("chaos runs (faulted / missed)", f"{len(runs)} / {len(tally.runs) - len(runs)}"),
        ("SIGKILL / SIGSTOP", f"{len(kill)} / {len(stop)}"),
        ("during a step / during a save", f"{sum(r.fault.where == 'step' for r in runs)} / "
                                          f"{sum(r.fault.where == 'save' for r in runs)}"),
        ("hangs (job past the deadline)", tally.count(lambda r: r.hang)),
        (f"survivors out later than {FAILURE_TIMEOUT_S:.0f} + {SLACK_S:.0f} s", tally.count(lambda r: r.late)),
        ("stopped ranks left behind by the launcher", tally.count(lambda r: r.left_behind)),
        ("jobs that failed (exit != 0, no hang)", tally.count(lambda r: r.rc not in (0, None) and not r.hang)),
        ("rank processes left running after the job", sum(r.leftovers for r in tally.runs)),
        ("checkpoints loaded / loading wrongly", f"{sum(r.checkpoints for r in runs)} / "
                                                 f"{sum(len(r.bad_checkpoints) for r in runs)}"),
        ("interrupted saves left (step-N.partial, never loaded)", sum(r.partials for r in runs)),
        ("resumed runs / losses after the resume compared", f"{sum(r.losses_checked > 0 for r in runs)} / "
                                                             f"{sum(r.losses_checked for r in runs)}"),
        ("runs whose losses differ from the reference (bitwise)", tally.count(lambda r: r.loss_problems)),
        ("torn loss-log lines", sum(r.torn_lines for r in runs)),
        ("survivors out after SIGKILL, median", _median([r.survivors_out_s for r in kill if r.survivors_out_s])),
        ("survivors out after SIGSTOP, median", _median([r.survivors_out_s for r in stop if r.survivors_out_s])),
        ("stopped rank gone after SIGSTOP, median", _median([r.stopped_out_s for r in stop if r.stopped_out_s])),
        ("fault to job's end, median", _median([r.finished_s for r in runs if not r.hang])),
        ("chaos run, whole, median", _median([r.total_s for r in runs])),
        ("reference run (uninterrupted)", f"{ref_s:.1f} s"),
        ("drill's wall time", f"{wall_s / 60:.1f} min"),
    ]
    width = max(len(k) for k, _ in rows)
    return "\n".join(["| what | count |", "|---|---|"] + [f"| {k:<{width}} | {v} |" for k, v in rows])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runs", type=int, default=50)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--quick", action="store_true", help="3 runs: a smoke test of the drill")
    ap.add_argument("--dir", default=None, help="where the runs write (default: a new temporary directory)")
    ap.add_argument("--keep", action="store_true", help="keep every run's directory (default: failed runs' only)")
    ap.add_argument("--py-spy", default=shutil.which("py-spy"),
                    help="py-spy, to dump late survivors' stacks into the run's stacks.txt (default: on PATH)")
    ap.add_argument("--only", default=None, metavar="SIGNAL:RANK:WHERE:AT",
                    help="every run the same fault, e.g. SIGSTOP:3:step:4 (a step after step 4's loss) or "
                         "SIGSTOP:1:save:6 (during step 6's save)")
    ap.add_argument("--budget-min", type=float, default=None,
                    help="start no run after this many minutes (the drill reports the runs made)")
    args = ap.parse_args()
    n = 3 if args.quick else args.runs
    work = Path(args.dir or tempfile.mkdtemp(prefix="autopar-chaos-"))
    work.mkdir(parents=True, exist_ok=True)
    torch.set_num_threads(1)
    rng = random.Random(args.seed)
    t_start = time.monotonic()
    reader = CheckpointReader()
    ref_losses, ref_checkpoints, ref_s, step_s = reference_run(work, reader)
    print(f"reference: {len(ref_losses)} steps, {len(ref_checkpoints)} checkpoints, {ref_s:.1f} s "
          f"(a step ~{step_s * 1e3:.0f} ms as the loss log shows); runs in {work}", flush=True)
    tally = Tally()
    for i in range(1, n + 1):
        if args.budget_min is not None and time.monotonic() - t_start > args.budget_min * 60:
            print(f"budget of {args.budget_min:g} min spent: {i - 1} of {n} runs made", flush=True)
            break
        run_dir = work / f"run-{i:03d}"
        fault = draw_fault(rng) if args.only is None else parse_fault(args.only)
        run = chaos_run(run_dir, fault, step_s, rng, reader, ref_losses, ref_checkpoints, args.py_spy)
        tally.runs.append(run)
        print(f"{describe(i, n, run)}  [{tally.line()}]", flush=True)
        if run.passed and not args.keep:
            shutil.rmtree(run_dir)
    if not args.keep:
        shutil.rmtree(work / "reference")
    print()
    print(table(tally, ref_s, time.monotonic() - t_start))


if __name__ == "__main__":
    main()
