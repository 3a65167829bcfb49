#!/usr/bin/env bash
# What pstar_core needs beyond a CUDA image's own packages (torch, numpy, safetensors,
# psutil, pyyaml, rich, transformers): pydantic and what it brings, unpacked for the GPU
# machine's Python into .gpu-deps/, which scripts/gpu_check.py puts on its path. Run it on
# a machine with PyPI, then copy .gpu-deps/ beside the checkout on the GPU machine.
#
#   bash scripts/gpu_deps.sh [PYTHON_VERSION [PLATFORM]]    # default: 3.12 manylinux2014_x86_64
set -euo pipefail
cd "$(dirname "$0")/.."
PYVER=${1:-3.12}
PLATFORM=${2:-manylinux2014_x86_64}
PY=${PYTHON:-python3}
rm -rf .gpu-deps
# (this machine's pip configuration may name local index folders that do not exist: pip
# warns "is ignored" for each, and those lines are dropped)
"$PY" -m pip install --quiet --disable-pip-version-check --target .gpu-deps \
  --python-version "$PYVER" --platform "$PLATFORM" --implementation cp --only-binary=:all: \
  "pydantic>=2.6" 2>&1 | { grep -v "is ignored" || true; }
echo "gpu_deps: .gpu-deps/ holds $(ls .gpu-deps | grep -c dist-info) packages for CPython $PYVER on $PLATFORM"
