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
# The CPU build by name: on Linux and Windows plain `torch==X` from PyPI is the CUDA build
# (several GB); `X+cpu` is the CPU one, from a wheel folder or index pip is configured with, else
# from PyTorch's CPU index. macOS wheels are CPU (and MPS) builds under the plain version.
TORCH="torch==2.13.0"
[ "$(uname -s)" = Darwin ] || TORCH="$TORCH+cpu"
if ! .venv/bin/python -m pip install --quiet "$TORCH" 2>/dev/null; then
    .venv/bin/python -m pip install --quiet "$TORCH" --extra-index-url https://download.pytorch.org/whl/cpu
fi
.venv/bin/python -m pip install --quiet -e ".[test]"
echo "cleave installed in .venv ($(.venv/bin/python -c 'import torch; print("torch", torch.__version__)'))"
