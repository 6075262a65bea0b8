#!/usr/bin/env bash
# SFT of Llama-3.1-8B-Instruct, one node of 8 GPUs, fsdp2 backend.
# Each launch runs at most STEPS_PER_RUN steps (checkpointing at the end) and resumes from the newest
# checkpoint; NUM_RUNS launches of NUM_MINUTES each reach MAX_STEPS. Extra arguments are recipe overrides.
set -euo pipefail

# ===== BEGIN CONFIG =====
NUM_NODES=1
GPUS_PER_NODE=8
STEPS_PER_RUN=500
MAX_STEPS=1000
NUM_RUNS=$(( (MAX_STEPS + STEPS_PER_RUN - 1) / STEPS_PER_RUN ))
NUM_MINUTES=120
# ===== END CONFIG =====

cd "$(dirname "$0")/../../.."
exec gymv cluster up -- gymv train recipes/llm/sft-llama3.1-8b-1n8g-fsdp2.yaml \
  sft.max_steps="$MAX_STEPS" \
  checkpoint.steps_per_run="$STEPS_PER_RUN" \
  checkpoint.dir="${CHECKPOINT_DIR:-runs}" \
  "$@"
