#!/usr/bin/env bash
# Create .venv (if missing) and install this project with the extras in $EXTRAS (default: test).
# torch goes in first and never as a CUDA build on a machine without a GPU.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
PY=${PYTHON:-python3}
EXTRAS=${EXTRAS:-test}
TORCH_VERSION=${TORCH_VERSION:-2.13.0}
PIP=".venv/bin/python -m pip"

[ -x .venv/bin/python ] || "$PY" -m venv .venv

has_gpu() { command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; }

if ! .venv/bin/python -c "import torch" >/dev/null 2>&1; then
  echo "[setup] installing torch"
  if $PIP install -q --dry-run --no-index --no-deps "torch==$TORCH_VERSION" >/dev/null 2>&1; then
    # A local wheel is configured (these machines keep a CPU build on disk): pip prefers its
    # "+cpu" version; the dependencies come from the package index.
    $PIP install -q "torch==$TORCH_VERSION"
  elif ! has_gpu; then
    # Never a multi-GB CUDA build where no GPU exists: PyTorch's CPU index first.
    $PIP install -q "torch==$TORCH_VERSION" --index-url https://download.pytorch.org/whl/cpu \
        --extra-index-url https://pypi.org/simple \
      || $PIP install -q torch --index-url https://download.pytorch.org/whl/cpu --extra-index-url https://pypi.org/simple
  else
    $PIP install -q "torch==$TORCH_VERSION" || $PIP install -q torch
  fi
fi

stamp=".venv/.installed-$(cat pyproject.toml | sha1sum | cut -c1-12)-$EXTRAS"
if [ ! -f "$stamp" ]; then
  echo "[setup] installing the project (.[${EXTRAS}])"
  $PIP install -q -e ".[${EXTRAS}]"
  if [[ ",$EXTRAS," == *",test,"* ]]; then
    # SGLang's frontend language only (its server dependencies are not wanted here).
    $PIP install -q --no-deps "sglang==0.4.10.post2"
  fi
  touch "$stamp"
fi

# The C++ CPU attention kernels (kernels/cpu), built now so that the first server start or test
# does not compile them; without a compiler the runtime keeps the torch path (logged once).
kstamp=".venv/.cpu-kernels-$(cat kernels/cpu/csrc/* kernels/cpu/build.py | sha1sum | cut -c1-12)"
if [ ! -f "$kstamp" ]; then
  command -v ninja >/dev/null 2>&1 || [ -x .venv/bin/ninja ] || $PIP install -q ninja
  if .venv/bin/python -m kernels.cpu.build; then touch "$kstamp"; else echo "[setup] C++ CPU kernels not built"; fi
fi
