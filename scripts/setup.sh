#!/usr/bin/env bash
# Create .venv and install malleus-svc with its test extras. Idempotent; safe to re-run.
# torch is pinned here (not in the package metadata): 2.13.0 is the CPU build this project's
# machines carry locally; any other spec would pull several GB of CUDA wheels.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
.venv/bin/python -m pip install -q --upgrade pip >/dev/null 2>&1 || true
if ! .venv/bin/python -c 'import torch, sys; sys.exit(torch.__version__.split("+")[0] != "2.13.0")' 2>/dev/null; then
  .venv/bin/python -m pip install -q "torch==2.13.0"
fi
.venv/bin/python -m pip install -q -e ".[test]"
echo "setup: .venv ready ($(.venv/bin/python -c 'import torch, ray; print("torch", torch.__version__, "ray", ray.__version__)'))"
