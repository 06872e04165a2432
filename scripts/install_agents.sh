#!/usr/bin/env bash
# Installs third-party agent harnesses, each in a virtual environment of its own at the project root (called by
# `install.sh --agents`; idempotent): mini-SWE-agent into .venv-mswea/ (its litellm pins are not Gyre's). Gyre runs
# it as an external harness (harness.command; gyre_core/envs/coding/mini_swe.py).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
MSWEA=2.4.6              # the version tested here
V=.venv-mswea
if [ -x $V/bin/python ] && $V/bin/python -c "import minisweagent" 2>/dev/null; then
  echo "mini-swe-agent: already in $V"; exit 0
fi
[ -x $V/bin/python ] || "$PY" -m venv $V
$V/bin/python -m pip install -q --upgrade pip
$V/bin/python -m pip install -q "mini-swe-agent==$MSWEA"
$V/bin/python -c "import minisweagent; print('mini-swe-agent:', minisweagent.__version__, 'in $V')"
