#!/usr/bin/env bash
# MOPD into Qwen2.5-VL-3B from two 7B teachers, two nodes of 8 GPUs, non-colocated.
# Each launch runs at most STEPS_PER_RUN steps (checkpointing at the end) and resumes from the newest
# checkpoint; NUM_RUNS launches of NUM_MINUTES each reach MAX_STEPS. Extra arguments are recipe overrides.
set -euo pipefail

# ===== BEGIN CONFIG =====
NUM_NODES=2
GPUS_PER_NODE=8
STEPS_PER_RUN=150
MAX_STEPS=300
NUM_RUNS=$(( (MAX_STEPS + STEPS_PER_RUN - 1) / STEPS_PER_RUN ))
NUM_MINUTES=240
# ===== END CONFIG =====

cd "$(dirname "$0")/../../.."
exec gymv cluster up -- gymv train recipes/vlm/vlm_mopd-qwen2.5-vl-3b-2n8g-megatron-noncolocated.yaml \
  mopd.max_steps="$MAX_STEPS" \
  checkpoint.steps_per_run="$STEPS_PER_RUN" \
  checkpoint.dir="${CHECKPOINT_DIR:-runs}" \
  "$@"
