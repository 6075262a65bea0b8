#!/usr/bin/env bash
# SFT warm start of the embedded tiny LLaVA on doorkey (tiny preset; a move call per turn, a new picture after each), CPU only.
# vlm_grpo-tinyllava-1n0g-torch-doorkey.sh starts from its run directory. Each launch runs at most
# STEPS_PER_RUN steps (checkpointing at the end) and resumes from the newest checkpoint; NUM_RUNS launches
# of NUM_MINUTES each reach MAX_STEPS. Extra arguments are recipe overrides.
set -euo pipefail

# ===== BEGIN CONFIG =====
NUM_NODES=1
GPUS_PER_NODE=0
STEPS_PER_RUN=250
MAX_STEPS=250
NUM_RUNS=$(( (MAX_STEPS + STEPS_PER_RUN - 1) / STEPS_PER_RUN ))
NUM_MINUTES=25
# ===== END CONFIG =====

# ===== BEGIN CHECKS =====
# max(val/reward_mean, last=1) > 0.05
# ===== END CHECKS =====

cd "$(dirname "$0")/../../.."
exec gymv train recipes/vlm/vlm_sft-tinyllava-1n0g-torch-doorkey.yaml \
  sft.max_steps="$MAX_STEPS" \
  checkpoint.steps_per_run="$STEPS_PER_RUN" \
  checkpoint.dir="${CHECKPOINT_DIR:-runs}" \
  "$@"
