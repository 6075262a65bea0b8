#!/usr/bin/env bash
# GRPO of Nemotron 3 Nano Omni (vlm_grpo-nemotron3-nano-omni-30b-a3b-2n8g-fsdp2-polygon), 2 nodes of 8 GPUs.
# Each launch runs at most STEPS_PER_RUN steps (checkpointing at the end) and resumes from the newest
# checkpoint; NUM_RUNS launches of NUM_MINUTES each reach MAX_STEPS. Extra arguments are recipe overrides.
set -euo pipefail

# ===== BEGIN CONFIG =====
NUM_NODES=2
GPUS_PER_NODE=8
STEPS_PER_RUN=100
MAX_STEPS=100
NUM_RUNS=$(( (MAX_STEPS + STEPS_PER_RUN - 1) / STEPS_PER_RUN ))
NUM_MINUTES=240
# ===== END CONFIG =====

cd "$(dirname "$0")/../../.."
exec gymv train recipes/vlm/vlm_grpo-nemotron3-nano-omni-30b-a3b-2n8g-fsdp2-polygon.yaml \
  grpo.max_steps="$MAX_STEPS" \
  checkpoint.steps_per_run="$STEPS_PER_RUN" \
  checkpoint.dir="${CHECKPOINT_DIR:-runs}" \
  "$@"
