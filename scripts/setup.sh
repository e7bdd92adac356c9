#!/usr/bin/env bash
# Create .venv and install malleus-svc with its test and data (Hugging Face) extras. Idempotent; safe to re-run.
# torch is pinned here (not in the package metadata): 2.13.0 is the CPU build this project's
# machines carry locally; any other spec would pull several GB of CUDA wheels.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
TORCH=2.13.0
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
.venv/bin/python -m pip install -q --upgrade pip >/dev/null 2>&1 || true
if ! .venv/bin/python -c 'import torch, sys; sys.exit(torch.__version__.split("+")[0] != sys.argv[1])' "$TORCH" 2>/dev/null; then
  .venv/bin/python -m pip install -q "torch==$TORCH"
fi
.venv/bin/python -m pip install -q -e ".[test,data]"
# A real Prometheus for tests/test_service_e2e.py (Debian's package; skipped where apt is not ours to use).
if ! command -v prometheus >/dev/null 2>&1; then
  if command -v apt-get >/dev/null 2>&1 && [ "$(id -u)" = 0 ]; then
    (apt-get install -y -q prometheus >/dev/null 2>&1 || { apt-get update -q >/dev/null 2>&1 && apt-get install -y -q prometheus >/dev/null 2>&1; }) \
      || echo "setup: could not install prometheus; the Prometheus test will be skipped" >&2
  else
    echo "setup: prometheus not found; install it (e.g. apt-get install prometheus) to run the Prometheus test" >&2
  fi
fi
echo "setup: .venv ready ($(.venv/bin/python -c 'import torch, ray; print("torch", torch.__version__, "ray", ray.__version__)'))"
