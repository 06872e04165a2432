#!/usr/bin/env bash
# `elastic-quick` against `quick`, side by side in one invocation: the same model, tasks, seeds, warm start and
# RL steps; the RL phase step by step on one process vs streamed over 2 cell agents (same processor).
# Prints each run's wall time and its summary's held-out rows. ~7 minutes on a 2-core CPU.
#   bash bench/experiments/elastic_quick_vs_quick.sh [TAG]
set -euo pipefail
cd "$(dirname "$0")/../.."
TAG=${1:-$(date +%s)}
for preset in quick elastic-quick; do
  start=$(date +%s.%N)
  .venv/bin/gyre train --preset "$preset" --set run.name="$preset-vs-$TAG" > "/tmp/gyre-$preset-vs-$TAG.log" 2>&1
  end=$(date +%s.%N)
  echo "$preset: wall $(.venv/bin/python -c "print(round($end - $start, 1))") s"
  grep -E "held-out success|paired difference|time: (rollout|train|elastic|score|process|publish)" "/tmp/gyre-$preset-vs-$TAG.log"
done
