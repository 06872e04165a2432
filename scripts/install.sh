#!/usr/bin/env bash
# Installs Gyre into .venv/ at the project root (CPU build of torch, DeepSpeed without prebuilt ops).
# Usage: bash scripts/install.sh            (add --dev for the test dependencies)
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
.venv/bin/python -m pip install -q --upgrade pip
# torch==2.13.0 resolves to the CPU wheel; any range would pull a multi-GB CUDA build.
.venv/bin/python -m pip install -q "torch==2.13.0"
# DeepSpeed builds its ops just in time; its setup needs the torch above (hence no build isolation).
.venv/bin/python -m pip show deepspeed >/dev/null 2>&1 || \
  DS_BUILD_OPS=0 .venv/bin/python -m pip install -q --no-build-isolation "deepspeed==0.19.8"
extra=""
[ "${1:-}" = "--dev" ] && extra="[dev]"
.venv/bin/python -m pip install -q -e ".${extra}"
echo "installed: $(.venv/bin/gyre --help >/dev/null && echo .venv/bin/gyre)"
