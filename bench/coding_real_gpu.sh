#!/usr/bin/env bash
# coding-real's learning on a GPU host: a pretrained model on vLLM (CUDA), mini-SWE-agent unmodified as every
# execution's harness through the recording proxy, its commands in the sandbox, RL on the train tasks, the
# paired evaluation on the 9 held-out tasks before and after. Needs the package index (vllm, mini-swe-agent)
# and, for a model other than the default, its directory. Prints the run's summary, then per-step figures.
#
#   bash bench/coding_real_gpu.sh                                   # SmolLM2-135M-Instruct, 16 RL steps
#   MODEL=path/to/Qwen2.5-Coder-1.5B-Instruct STEPS=32 bash bench/coding_real_gpu.sh
#
# SmolLM2-135M-Instruct solves 0 of 9 held-out tasks on a CPU (bench/RESULTS.md): with every reward 0 the
# group advantages are 0 and RL cannot move it; a model that solves some train tasks is what this measures.
set -euo pipefail
cd "$(dirname "$0")/.."
MODEL=${MODEL:-data/models/SmolLM2-135M-Instruct}
STEPS=${STEPS:-16}
RUN=${RUN:-coding-real-gpu}
command -v nvidia-smi >/dev/null && nvidia-smi -L || { echo "coding_real_gpu.sh: no GPU here (nvidia-smi); on a CPU run the preset as it is: gyre train --preset coding-real" >&2; exit 2; }
bash scripts/install.sh --vllm --agents          # vllm (CUDA build) in .venv-vllm/, mini-swe-agent in .venv-mswea/
if [ "$MODEL" = data/models/SmolLM2-135M-Instruct ] && [ ! -f "$MODEL/config.json" ]; then
  .venv/bin/gyre model fetch smollm2-135m-instruct "$MODEL"
fi
# on a GPU the executions take seconds, not minutes: more of them a step, vLLM takes 60% of the GPU, the trainer the rest
.venv/bin/gyre train --preset coding-real --set run.name="$RUN" --set model.path="$MODEL" --set model.fetch=null \
  --set rl.steps="$STEPS" --set rollout.tasks_per_step=8 --set rollout.group_size=8 --set rollout.concurrency=32 \
  --set engine.gpu_memory_utilization=0.6 --set harness.wall_clock_s=600
.venv/bin/gyre sql "SELECT step, count(*) AS executions, avg(success::INT) AS success, avg(partial) AS partial,
                           avg(evaluator_s) AS evaluator_s, sum(tokens_generated) AS tokens
                    FROM executions WHERE split = 'train' GROUP BY 1 ORDER BY 1" --run "$RUN"
