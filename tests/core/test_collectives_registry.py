"""The collective registry is complete whenever it is read, with nothing imported first.

Each collective registers itself where ``autopar.core.comm`` defines it; the registry
imports that package on its first lookup. A process that reads the registry
without importing ``comm`` first (forked from one that imported torch alone) must still see every
collective.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

EVERY_COLLECTIVE = {
    "copy_to_tp", "reduce_from_tp", "gather_from_tp", "scatter_to_tp", "reduce_scatter_to_sp", "gather_from_sp",
    "vocab_parallel_embedding", "vocab_parallel_embedding_sp", "vocab_parallel_cross_entropy",
    "vocab_parallel_logsumexp", "vocab_parallel_softmax", "vocab_parallel_log_softmax", "vocab_parallel_nll_loss",
    "vocab_parallel_soft_cross_entropy", "all_gather_matmul", "matmul_reduce_scatter",
}

_READ_FIRST = """
import json, os, sys
import torch  # what the registry's modules import from outside autopar, loaded once before the forks


def read(reading):
    from autopar.core import collectives
    before = "autopar.core.comm" in sys.modules
    if reading == "registered":
        names = sorted(c.name for c in collectives.registered())
    elif reading == "collective_named":
        names = [collectives.collective_named("copy_to_tp").name]
    else:
        collectives.collective_of(print)  # no collective; the lookup still completes the registry
        names = sorted(c.name for c in collectives.registered())
    return {"comm_imported_before": before, "names": names}


seen = {}
for reading in sys.argv[1:]:  # each in a child that has imported nothing of autopar
    r, w = os.pipe()
    if os.fork() == 0:
        os.write(w, json.dumps(read(reading)).encode())
        os._exit(0)
    os.close(w)
    with os.fdopen(r) as pipe:
        seen[reading] = json.loads(pipe.read())
    os.wait()
print(json.dumps(seen))
"""

READINGS = ("registered", "collective_named", "collective_of")


@pytest.fixture(scope="module")
def first_reads() -> dict[str, dict]:
    """Per way of reading the registry first: whether ``comm`` was imported before, and the names read.
    Each read in a process forked from one that imported torch alone (one interpreter for the three)."""
    out = subprocess.run([sys.executable, "-c", _READ_FIRST, *READINGS], cwd=ROOT, capture_output=True, text=True,
                         check=True, env={**os.environ, "PYTHONPATH": str(ROOT)})
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_registered_lists_every_collective_without_importing_comm_first(first_reads):
    seen = first_reads["registered"]
    assert not seen["comm_imported_before"]
    assert set(seen["names"]) == EVERY_COLLECTIVE


def test_lookup_by_name_completes_the_registry(first_reads):
    assert first_reads["collective_named"]["names"] == ["copy_to_tp"]


def test_lookup_by_function_completes_the_registry(first_reads):
    assert set(first_reads["collective_of"]["names"]) == EVERY_COLLECTIVE


def test_the_registry_matches_the_comm_package():
    from autopar.core import comm
    from autopar.core.collectives import registered

    names = {c.name for c in registered()}
    assert names == EVERY_COLLECTIVE
    assert all(getattr(comm, name).__name__ == name for name in names)
