#!/usr/bin/env bash
# GRPO of the embedded tiny Qwen3 (text only) on arithmetic (tiny preset), CPU only; pass the SFT warm start
# as model.path=runs/sft-tinyqwen3-1n0g-torch-arithmetic/final.
# Each launch runs at most STEPS_PER_RUN steps (checkpointing at the end) and resumes from the newest
# checkpoint; NUM_RUNS launches of NUM_MINUTES each reach MAX_STEPS. Extra arguments are recipe overrides.
set -euo pipefail

# ===== BEGIN CONFIG =====
NUM_NODES=1
GPUS_PER_NODE=0
STEPS_PER_RUN=200
MAX_STEPS=200
NUM_RUNS=$(( (MAX_STEPS + STEPS_PER_RUN - 1) / STEPS_PER_RUN ))
NUM_MINUTES=15
# ===== END CONFIG =====

cd "$(dirname "$0")/../../.."
exec gymv train recipes/llm/grpo-tinyqwen3-1n0g-torch-arithmetic.yaml \
  grpo.max_steps="$MAX_STEPS" \
  checkpoint.steps_per_run="$STEPS_PER_RUN" \
  checkpoint.dir="${CHECKPOINT_DIR:-runs}" \
  "$@"
