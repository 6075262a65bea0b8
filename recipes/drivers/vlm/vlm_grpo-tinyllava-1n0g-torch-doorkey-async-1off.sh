#!/usr/bin/env bash
# Async GRPO on doorkey (one step off-policy), CPU only: the doorkey driver with this recipe.
set -euo pipefail

# ===== BEGIN CONFIG =====
export NUM_NODES=1
export GPUS_PER_NODE=0
export STEPS_PER_RUN=100
export MAX_STEPS=100
export NUM_RUNS=$(( (MAX_STEPS + STEPS_PER_RUN - 1) / STEPS_PER_RUN ))
export NUM_MINUTES=45
# ===== END CONFIG =====

# ===== BEGIN CHECKS =====
# median(train/token_mult_prob_error) < 1.5
# max(async/age_max) <= 1
# mean(train/turns_mean) > 2
# ===== END CHECKS =====

export RECIPE=recipes/vlm/vlm_grpo-tinyllava-1n0g-torch-doorkey-async-1off.yaml
exec "$(dirname "$0")/vlm_grpo-tinyllava-1n0g-torch-doorkey.sh" "$@"
