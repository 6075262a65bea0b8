#!/usr/bin/env bash
# SFT warm start of the embedded tiny Nemotron 3 Omni on circle-count (tiny preset), CPU only.
# Each launch runs at most STEPS_PER_RUN steps (checkpointing at the end) and resumes from the newest
# checkpoint; NUM_RUNS launches of NUM_MINUTES each reach MAX_STEPS. Extra arguments are recipe overrides.
set -euo pipefail

# ===== BEGIN CONFIG =====
NUM_NODES=1
GPUS_PER_NODE=0
STEPS_PER_RUN=80
MAX_STEPS=80
NUM_RUNS=$(( (MAX_STEPS + STEPS_PER_RUN - 1) / STEPS_PER_RUN ))
NUM_MINUTES=30
# ===== END CONFIG =====

cd "$(dirname "$0")/../../.."
exec gymv train recipes/vlm/vlm_sft-tinyomni-1n0g-torch.yaml \
  sft.max_steps="$MAX_STEPS" \
  checkpoint.steps_per_run="$STEPS_PER_RUN" \
  checkpoint.dir="${CHECKPOINT_DIR:-runs}" \
  "$@"
