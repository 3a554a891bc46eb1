#!/usr/bin/env bash
# Set up a fresh checkout: a virtual environment in .venv with torch, autopar
# (editable) and the test dependencies. Safe to run again: it only installs
# what is missing.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
if ! .venv/bin/python -c "import torch" 2>/dev/null; then
  if command -v nvidia-smi >/dev/null 2>&1; then
    .venv/bin/pip install -q "torch>=2.6,<2.15"     # a CUDA build on GPU machines
  else
    .venv/bin/pip install -q torch==2.13.0          # the CPU build
  fi
fi
if ! .venv/bin/python -c "import autopar, transformers, pytest" 2>/dev/null; then
  .venv/bin/pip install -q -e '.[test]'
fi
