#!/usr/bin/env bash
# Set up (idempotent) and run. The README's two commands:
#   bash run.sh bench [bench_decode.py args]   correctness check + timing of the task shapes
#   bash run.sh test  [pytest args]            the test suite
# Uses the python3 that already has PyTorch (a GPU machine's image), else makes
# .venv with PyTorch 2.14.1 (a CUDA 13 build: with nvcc present the CUDA
# kernels are compiled for sm_90a; without a GPU the fallback runs).
set -euo pipefail
cd "$(dirname "$0")"
what=${1:-}
shift || true

if [ -x .venv/bin/python ]; then
  PY=.venv/bin/python
elif python3 -c "import torch" 2>/dev/null; then
  PY=python3
else
  python3 -m venv .venv
  PY=.venv/bin/python
fi
if ! $PY -c "import torch" 2>/dev/null; then
  $PY -m pip install -q "torch==2.14.1"
fi
for mod in pytest ninja setuptools wheel; do
  $PY -c "import $mod" 2>/dev/null || $PY -m pip install -q "$mod"
done
$PY -c "import matplotlib" 2>/dev/null || $PY -m pip install -q matplotlib || echo "(matplotlib unavailable: --plot will not work)"

# run from outside the source tree's import path so the installed package
# (with its compiled _C) is the one imported
export PYTHONSAFEPATH=1

# build and install the package (kernels compile where a GPU toolkit is present)
export MAX_JOBS=${MAX_JOBS:-$(nproc)}
$PY -m pip install -q --no-build-isolation --no-deps .
$PY -c "import mla_decode; print('mla_decode backend:', mla_decode.backend())"

case "$what" in
  bench) exec $PY benchmarks/bench_decode.py "$@" ;;
  test) exec $PY -m pytest -q -rs tests "$@" ;;
  *) echo "usage: bash run.sh bench|test [args]" >&2; exit 2 ;;
esac
