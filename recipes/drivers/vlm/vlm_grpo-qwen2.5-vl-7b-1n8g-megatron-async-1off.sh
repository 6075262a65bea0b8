#!/usr/bin/env bash
# Async GRPO on Qwen2.5-VL-7B (4 generation + 4 training GPUs): the synchronous driver with this recipe and longer runs.
set -euo pipefail

# ===== BEGIN CONFIG =====
export NUM_NODES=1
export GPUS_PER_NODE=8
export STEPS_PER_RUN=100
export MAX_STEPS=200
export NUM_RUNS=$(( (MAX_STEPS + STEPS_PER_RUN - 1) / STEPS_PER_RUN ))
export NUM_MINUTES=180
# ===== END CONFIG =====

export RECIPE=recipes/vlm/vlm_grpo-qwen2.5-vl-7b-1n8g-megatron-async-1off.yaml
exec "$(dirname "$0")/vlm_grpo-qwen2.5-vl-7b-1n8g-megatron.sh" "$@"
