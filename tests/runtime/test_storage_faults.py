"""Storage faults and untrusted checkpoints: a failed save loses nothing, a load runs no stored code.

On 2 gloo ranks (a small regressor at pp=2, so each rank writes its own
files), one run meets, in order:

1. a save that succeeds (step 1);
2. a save while rank 1 may write no file past 64 bytes (``RLIMIT_FSIZE``,
   its ``SIGXFSZ`` ignored, so the write fails with ``EFBIG`` as on a full,
   size-limited file system): every rank raises ``CheckpointError`` naming
   the checkpoint, its partial directory and rank 1's OS error;
   ``latest`` still names step 1, no partial directory is left, and step 1
   loads with the weights it was saved with, bit for bit;
3. the same fault during an asynchronous save: the failure is raised by the
   next ``train_step`` on every rank, and the step after that runs;
4. a NaN written into one weight: the save is refused on every rank before
   anything is written, naming the parameter and the step; so is the
   HuggingFace export (``engine.save_pretrained``), naming the rank.

In one process: a checkpoint whose DCP metadata pickle carries a payload
(``os.system`` through ``__reduce__``) is refused by ``engine.load`` and by
the HuggingFace export without running it (its marker file never appears),
while the untouched checkpoint, optimizer, scheduler and extra included, loads.
"""

import os
import pickle
import resource
import signal
import time
from pathlib import Path

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from families import TinyRegressor
from helpers import assert_bitwise_equal, on_rank0, parallelize_on, spawn_ranks

import autopar
from autopar.runtime.checkpoint.description import CheckpointError
from autopar.runtime.hf.export_checkpoint import export_checkpoint

WIDTH, ROWS, M = 8, 4, 2
FILE_LIMIT = 64
"""Bytes rank 1 may write into a file while its disk is 'full': less than any of its checkpoint files."""


def _Regressor() -> nn.Module:
    return TinyRegressor(WIDTH)


def _batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    return torch.randn(ROWS, WIDTH, generator=g), torch.randn(ROWS, 4, generator=g)


def _program(**layout):
    torch.manual_seed(0)
    x, y = _batch(0)
    return parallelize_on(_Regressor(), [((x,), (y,))], ROWS // M, microbatches=M, loss_fn=F.mse_loss, **layout)


class _FileSizeLimit:
    """While active on this rank: no file grows past ``FILE_LIMIT`` bytes (writes fail with EFBIG)."""

    def __init__(self, active: bool):
        self.active = active

    def __enter__(self):
        if self.active:
            self.before = resource.getrlimit(resource.RLIMIT_FSIZE)
            self.handler = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
            resource.setrlimit(resource.RLIMIT_FSIZE, (FILE_LIMIT, self.before[1]))
        return self

    def __exit__(self, *exc):
        if self.active:
            resource.setrlimit(resource.RLIMIT_FSIZE, self.before)
            signal.signal(signal.SIGXFSZ, self.handler)


def _error(run) -> str | None:
    try:
        run()
    except CheckpointError as e:
        return str(e)
    return None


def _faults(program, root: str) -> dict:
    torch.set_num_threads(1)
    engine = program.materialize()
    optimizer = torch.optim.AdamW(engine.parameters(), lr=1e-2)
    out = {}

    def step(i: int) -> None:
        engine.train_step(*_batch(i))
        engine.optimizer_step(optimizer)

    step(1)
    engine.save(root, optimizer, step=1)
    saved = on_rank0(engine.full_state_dict())
    step(2)
    with _FileSizeLimit(engine.mesh.rank == 1):
        out["sync"] = _error(lambda: engine.save(root, optimizer, step=2))
    torch.distributed.barrier()  # rank 0 removed the partial directory before anyone looks
    out["latest after sync"] = (Path(root) / "latest").read_text().strip()
    out["loaded step"] = engine.load(root, optimizer)[0]
    out["loaded"], out["saved"] = on_rank0(engine.full_state_dict()), saved

    with _FileSizeLimit(engine.mesh.rank == 1):
        handle = engine.save(root, optimizer, step=3, async_save=True)
        deadline = time.monotonic() + 60
        while not handle.done() and time.monotonic() < deadline:
            time.sleep(0.01)
    out["async"] = _error(lambda: step(3))
    step(4)  # reported once: training goes on
    out["stepped after"] = engine.last_step.step

    with torch.no_grad():
        if engine.mesh.rank == 0:
            dict(engine.named_local_parameters())["blocks.0.fc.weight"][1, 2] = float("nan")
    out["nonfinite"] = _error(lambda: engine.save(root, optimizer, step=5))
    hf = Path(root).parent / "hf"
    out["export"] = _error(lambda: engine.save_pretrained(str(hf)))
    torch.distributed.barrier()
    out["exported"] = sorted(p.name for p in hf.iterdir()) if hf.exists() else []
    out["entries"] = sorted(p.name for p in Path(root).iterdir())
    return out


@pytest.mark.multiprocess
def test_a_failed_save_names_the_path_and_the_error_and_the_previous_checkpoint_loads(tmp_path):
    root = str(tmp_path / "ckpt")
    ranks = spawn_ranks(_faults, 2, _program(pp=2), root)
    for rank, r in enumerate(ranks):
        sync = r["sync"]
        assert sync is not None, rank
        assert sync.startswith(f"saving checkpoint {root}/step-00000002 failed writing into "
                               f"{root}/step-00000002.partial:\n  rank 1: OSError: [Errno 27] File too large"), sync
        assert f"nothing was published: {root}/latest still names step-00000001, which loads as before" in sync
        assert r["latest after sync"] == "step-00000001" and r["loaded step"] == 1
        asynchronous = r["async"]
        assert asynchronous is not None and asynchronous.startswith(
            f"saving checkpoint {root}/step-00000003 failed writing into {root}/step-00000003.partial:\n  "
            f"rank 1: OSError: [Errno 27] File too large"), asynchronous
        assert r["stepped after"] == 2  # step 1 loaded; the train_step that reported the failure ran no step
        nonfinite = r["nonfinite"]
        assert nonfinite.startswith(f"cannot save step 5 under {root}:\n  parameter(s) blocks.0.fc.weight hold NaN "
                                    f"or infinite values at step 5"), nonfinite
        assert "the previous one stays 'latest'" in nonfinite and "[ranks [0]]" in nonfinite
        export = r["export"]
        assert export is not None and export.startswith(
            "save_pretrained failed on rank 0: parameter(s) blocks.0.fc.weight hold NaN or infinite values: an export "
            "is never written with non-finite weights"), export
        assert r["exported"] == [], r["exported"]  # refused before any file was written
    assert ranks[0]["entries"] == ["latest", "step-00000001"]  # no partial directory, no step 2, 3 or 5
    assert_bitwise_equal(ranks[0]["loaded"], ranks[0]["saved"], "step 1 loaded after the failed save")


class _Payload:
    """Pickles as a call of ``os.system``: what a plain unpickler would run."""

    def __init__(self, command: str):
        self.command = command

    def __reduce__(self):
        return os.system, (self.command,)


def test_metadata_pickle_with_code_is_refused_unrun(tmp_path):
    torch.manual_seed(0)
    x, y = _batch(0)
    engine = autopar.parallelize(_Regressor(), example_inputs=(x,), example_targets=y, loss_fn=F.mse_loss).materialize()
    optimizer = torch.optim.AdamW(engine.parameters(), lr=1e-2)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0 / (1 + s))
    engine.train_step(x, y)
    engine.optimizer_step(optimizer, scheduler)
    engine.save(str(tmp_path / "ckpt"), optimizer, step=1, scheduler=scheduler, extra={"data": {"epoch": 0}})
    assert engine.load(str(tmp_path / "ckpt"), optimizer, scheduler) == (1, {"data": {"epoch": 0}})

    marker = tmp_path / "ran"
    (tmp_path / "ckpt" / "step-00000001" / ".metadata").write_bytes(pickle.dumps(_Payload(f"touch {marker}")))
    with pytest.raises(CheckpointError, match=r"\.metadata names posix\.system, which is not part of DCP's metadata: "
                                              r"the file holds code a plain unpickler would run\. Refused before"):
        engine.load(str(tmp_path / "ckpt"), optimizer, scheduler)
    with pytest.raises(CheckpointError, match=r"names posix\.system"):
        export_checkpoint(str(tmp_path / "ckpt"), str(tmp_path / "hf"))
    assert not marker.exists()
