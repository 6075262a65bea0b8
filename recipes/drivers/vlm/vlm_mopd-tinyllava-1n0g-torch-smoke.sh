#!/usr/bin/env bash
# The 3-step MOPD smoke on a CPU: builds the narrow tiny teacher once, then trains (one launch).
# Extra arguments are recipe overrides.
set -euo pipefail

# ===== BEGIN CONFIG =====
NUM_NODES=1
GPUS_PER_NODE=0
STEPS_PER_RUN=3
MAX_STEPS=3
NUM_RUNS=$(( (MAX_STEPS + STEPS_PER_RUN - 1) / STEPS_PER_RUN ))
NUM_MINUTES=5
# ===== END CONFIG =====

cd "$(dirname "$0")/../../.."
TEACHER=runs/teachers/tiny-llava-h64-l1
[ -f "$TEACHER/config.json" ] || gymv model init tiny-llava "$TEACHER" --hidden 64 --layers 1
exec gymv train recipes/vlm/vlm_mopd-tinyllava-1n0g-torch-smoke.yaml \
  mopd.max_steps="$MAX_STEPS" \
  checkpoint.steps_per_run="$STEPS_PER_RUN" \
  checkpoint.dir="${CHECKPOINT_DIR:-runs}" \
  "$@"
