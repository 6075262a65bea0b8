#!/usr/bin/env bash
# GRPO on Qwen2.5-VL-7B, one node of 8 GPUs, vLLM + Megatron colocated.
# Each launch runs at most STEPS_PER_RUN steps (checkpointing at the end) and resumes from the newest
# checkpoint; NUM_RUNS launches of NUM_MINUTES each reach MAX_STEPS. Extra arguments are recipe overrides.
# A wrapper may export its own CONFIG values and RECIPE, then exec this driver; otherwise the defaults apply.
set -euo pipefail

# ===== BEGIN CONFIG =====
NUM_NODES="${NUM_NODES:-1}"
GPUS_PER_NODE="${GPUS_PER_NODE:-8}"
STEPS_PER_RUN="${STEPS_PER_RUN:-30}"
MAX_STEPS="${MAX_STEPS:-60}"
NUM_RUNS=$(( (MAX_STEPS + STEPS_PER_RUN - 1) / STEPS_PER_RUN ))
NUM_MINUTES="${NUM_MINUTES:-90}"
# ===== END CONFIG =====

RECIPE="${RECIPE:-recipes/vlm/vlm_grpo-qwen2.5-vl-7b-1n8g-megatron.yaml}"
cd "$(dirname "$0")/../../.."
exec gymv cluster up -- gymv train "$RECIPE" \
  grpo.max_steps="$MAX_STEPS" \
  checkpoint.steps_per_run="$STEPS_PER_RUN" \
  checkpoint.dir="${CHECKPOINT_DIR:-runs}" \
  "$@"
