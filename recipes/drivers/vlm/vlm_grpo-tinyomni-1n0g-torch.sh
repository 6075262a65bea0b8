#!/usr/bin/env bash
# GRPO of the embedded tiny Nemotron 3 Omni on circle-count (tiny preset), CPU only, from the SFT warm start
# vlm_sft-tinyomni-1n0g-torch (run first when its run has no final/).
# Each launch runs at most STEPS_PER_RUN steps (checkpointing at the end) and resumes from the newest
# checkpoint; NUM_RUNS launches of NUM_MINUTES each reach MAX_STEPS. Extra arguments are recipe overrides.
set -euo pipefail

# ===== BEGIN CONFIG =====
NUM_NODES=1
GPUS_PER_NODE=0
STEPS_PER_RUN=150
MAX_STEPS=150
NUM_RUNS=$(( (MAX_STEPS + STEPS_PER_RUN - 1) / STEPS_PER_RUN ))
NUM_MINUTES=60
# ===== END CONFIG =====

cd "$(dirname "$0")/../../.."
RUNS="${CHECKPOINT_DIR:-runs}"
WARM="$RUNS/vlm_sft-tinyomni-1n0g-torch"
[ -f "$WARM/final/config.json" ] || CHECKPOINT_DIR="$RUNS" bash recipes/drivers/vlm/vlm_sft-tinyomni-1n0g-torch.sh
exec gymv train recipes/vlm/vlm_grpo-tinyomni-1n0g-torch.yaml \
  model.path="$WARM/final" \
  grpo.max_steps="$MAX_STEPS" \
  checkpoint.steps_per_run="$STEPS_PER_RUN" \
  checkpoint.dir="$RUNS" \
  "$@"
