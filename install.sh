#!/usr/bin/env bash
# Install draftwise and what it needs. The CPU build of torch is asked for by exact version first, so
# pip takes the local CPU wheel (or the CPU index) instead of several GB of CUDA packages.
set -euo pipefail
PY=${PYTHON:-python3}
TORCH_VERSION=${TORCH_VERSION:-2.13.0}
if ! "$PY" -c "import torch" 2>/dev/null; then
  "$PY" -m pip install "torch==${TORCH_VERSION}" \
    || "$PY" -m pip install "torch==${TORCH_VERSION}" --index-url https://download.pytorch.org/whl/cpu
fi
"$PY" -m pip install -e ".[serve,bench,test]"
