#!/usr/bin/env bash
# GRPO of the embedded tiny LLaVA on circle-click (tiny preset; one click tool call at the target circle), CPU only,
# from the SFT warm start vlm_sft-tinyllava-1n0g-torch-circle-click (run first when its run has no final/).
# Each launch runs at most STEPS_PER_RUN steps (checkpointing at the end) and resumes from the newest
# checkpoint; NUM_RUNS launches of NUM_MINUTES each reach MAX_STEPS. Extra arguments are recipe overrides.
set -euo pipefail

# ===== BEGIN CONFIG =====
NUM_NODES=1
GPUS_PER_NODE=0
STEPS_PER_RUN=100
MAX_STEPS=100
NUM_RUNS=$(( (MAX_STEPS + STEPS_PER_RUN - 1) / STEPS_PER_RUN ))
NUM_MINUTES=20
# ===== END CONFIG =====

# ===== BEGIN CHECKS =====
# median(train/token_mult_prob_error) < 1.1
# mean(train/reward_mean, last=10) > mean(train/reward_mean, first=10)
# ===== END CHECKS =====

cd "$(dirname "$0")/../../.."
RUNS="${CHECKPOINT_DIR:-runs}"
WARM="$RUNS/vlm_sft-tinyllava-1n0g-torch-circle-click"
if [ ! -d "$WARM/final" ]; then
  CHECKPOINT_DIR="$RUNS" bash recipes/drivers/vlm/vlm_sft-tinyllava-1n0g-torch-circle-click.sh
fi
exec gymv train "${RECIPE:-recipes/vlm/vlm_grpo-tinyllava-1n0g-torch-circle-click.yaml}" \
  model.path="$WARM" \
  grpo.max_steps="$MAX_STEPS" \
  checkpoint.steps_per_run="$STEPS_PER_RUN" \
  checkpoint.dir="$RUNS" \
  "$@"
