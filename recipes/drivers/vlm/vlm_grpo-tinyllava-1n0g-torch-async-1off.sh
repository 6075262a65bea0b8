#!/usr/bin/env bash
# Async GRPO quickstart (one step off-policy), CPU only: the quickstart driver with this recipe.
set -euo pipefail

# ===== BEGIN CONFIG =====
export NUM_NODES=1
export GPUS_PER_NODE=0
export STEPS_PER_RUN=40
export MAX_STEPS=40
export NUM_RUNS=$(( (MAX_STEPS + STEPS_PER_RUN - 1) / STEPS_PER_RUN ))
export NUM_MINUTES=45
# ===== END CONFIG =====

export RECIPE=recipes/vlm/vlm_grpo-tinyllava-1n0g-torch-async-1off.yaml
exec "$(dirname "$0")/vlm_grpo-tinyllava-1n0g-torch.sh" "$@"
