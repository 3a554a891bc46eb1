"""The collective registry is complete whenever it is read, with nothing imported first.

Each collective registers itself where ``autopar.core.comm`` defines it; the registry
imports that package on its first lookup. A fresh interpreter that reads the registry
without importing ``comm`` must still see every collective.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

EVERY_COLLECTIVE = {
    "copy_to_tp", "reduce_from_tp", "gather_from_tp", "scatter_to_tp", "reduce_scatter_to_sp", "gather_from_sp",
    "vocab_parallel_embedding", "vocab_parallel_embedding_sp", "vocab_parallel_cross_entropy",
    "vocab_parallel_logsumexp", "vocab_parallel_softmax", "vocab_parallel_log_softmax", "vocab_parallel_nll_loss",
    "vocab_parallel_soft_cross_entropy",
}

_READ_FIRST = """
import json, sys
from autopar.core import collectives
before = "autopar.core.comm" in sys.modules
reading = sys.argv[1]
if reading == "registered":
    names = sorted(c.name for c in collectives.registered())
elif reading == "collective_named":
    names = [collectives.collective_named("copy_to_tp").name]
else:
    collectives.collective_of(print)  # no collective; the lookup still completes the registry
    names = sorted(c.name for c in collectives.registered())
print(json.dumps({"comm_imported_before": before, "names": names}))
"""


def _read_in_fresh_interpreter(reading: str) -> dict:
    out = subprocess.run([sys.executable, "-c", _READ_FIRST, reading], cwd=ROOT, capture_output=True, text=True,
                         check=True, env={**os.environ, "PYTHONPATH": str(ROOT)})
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_registered_lists_every_collective_without_importing_comm_first():
    seen = _read_in_fresh_interpreter("registered")
    assert not seen["comm_imported_before"]
    assert set(seen["names"]) == EVERY_COLLECTIVE


def test_lookup_by_name_completes_the_registry():
    assert _read_in_fresh_interpreter("collective_named")["names"] == ["copy_to_tp"]


def test_lookup_by_function_completes_the_registry():
    assert set(_read_in_fresh_interpreter("collective_of")["names"]) == EVERY_COLLECTIVE


def test_the_registry_matches_the_comm_package():
    from autopar.core import comm
    from autopar.core.collectives import registered

    names = {c.name for c in registered()}
    assert names == EVERY_COLLECTIVE
    assert all(getattr(comm, name).__name__ == name for name in names)
