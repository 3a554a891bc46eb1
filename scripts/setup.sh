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
# pip installs without byte-compiling (it compiles one file after another); compileall then compiles
# the environment on every core: torch and the test dependencies in about 45 s instead of 80
installed=0
if ! has torch; then
  if command -v nvidia-smi >/dev/null 2>&1; then
    .venv/bin/pip install -q --no-compile "torch>=2.6,<2.15"     # a CUDA build on GPU machines
  else
    .venv/bin/pip install -q --no-compile torch==2.13.0          # the CPU build
  fi
  installed=1
fi
if ! has autopar transformers pytest xdist; then
  .venv/bin/pip install -q --no-compile -e '.[test]'
  installed=1
fi
if [ "$installed" = 1 ]; then  # (a few files of the dependencies' own tests do not compile: not ours to fail on)
  .venv/bin/python -m compileall -q -j 0 "$(.venv/bin/python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')" >/dev/null || true
fi
