#!/usr/bin/env bash
# Installs Gyre with its test dependencies into .venv/ and runs the whole test suite.
# Usage: bash scripts/test.sh [pytest args]
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh --dev --vllm --agents
export DO_NOT_TRACK=1 PREFECT_SERVER_ANALYTICS_ENABLED=false DS_ACCELERATOR=cpu TOKENIZERS_PARALLELISM=false
# pytest exits 5 when it collects nothing: that is a failure here, never a pass.
.venv/bin/python -m pytest -q -p no:cacheprovider "$@"
