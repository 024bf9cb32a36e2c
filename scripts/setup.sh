#!/usr/bin/env bash
# Create .venv and install Cleave with its test extras. Safe to run again.
# torch is pinned to the CPU build first, so nothing later can pull a multi-GB CUDA wheel.
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-python3}"
if [ ! -x .venv/bin/python ]; then
    "$PY" -m venv .venv
fi
.venv/bin/python -m pip install --quiet --upgrade pip
.venv/bin/python -m pip install --quiet "torch==2.13.0"
.venv/bin/python -m pip install --quiet -e ".[test]"
echo "cleave installed in .venv ($(.venv/bin/python -c 'import torch; print("torch", torch.__version__)'))"
