#!/usr/bin/env bash
# What only a GPU machine can confirm, in one command: flash-attn's varlen kernel against the SDPA
# fallback, bf16 training against fp32, the length sweep on the device, a throttled device's measured
# time, the allocator's peak against the memory model, and, with 2 GPUs, a 2-stage pipeline over
# NCCL against the single-process reference and a live migration. Each check, its oracle and its
# tolerance: malleus_svc/runtime/gpu_check.py.
#
#   bash scripts/gpu_check.sh                # on a GPU machine (source checkout or installed package)
#   bash scripts/gpu_check.sh --device cpu   # every check that needs no CUDA, on CPU over gloo
#
# Prints a table: check | pass/fail/skip | figure | tolerance. Exit status: 0 no check failed
# (skips allowed), 1 a check failed, 2 bad arguments, 77 no CUDA GPU here (nothing checked).
# Python: $PYTHON, else the checkout's .venv, else python3.
set -euo pipefail
cd "$(dirname "$0")/.."
if [ -z "${PYTHON:-}" ]; then
  if [ -x .venv/bin/python ]; then PYTHON=.venv/bin/python; else PYTHON=python3; fi
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
exec "$PYTHON" -m malleus_svc.runtime.gpu_check "$@"
