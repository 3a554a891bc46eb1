#!/usr/bin/env bash
# Set up a fresh checkout: a virtual environment in .venv with torch, autopar
# (editable) and the test dependencies. Safe to run again: it only installs
# what is missing.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
has() {  # whether the environment has these modules installed (found, not imported: seconds saved)
  .venv/bin/python -c "import importlib.util as u, sys; sys.exit(not all(u.find_spec(m) for m in sys.argv[1:]))" "$@"
}
if ! has torch; then
  if command -v nvidia-smi >/dev/null 2>&1; then
    .venv/bin/pip install -q "torch>=2.6,<2.15"     # a CUDA build on GPU machines
  else
    .venv/bin/pip install -q torch==2.13.0          # the CPU build
  fi
fi
if ! has autopar transformers pytest; then
  .venv/bin/pip install -q -e '.[test]'
fi
