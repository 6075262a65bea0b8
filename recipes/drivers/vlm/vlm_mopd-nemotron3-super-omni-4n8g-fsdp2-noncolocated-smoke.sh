#!/usr/bin/env bash
# MOPD into Nemotron 3 Super Omni (vlm_mopd-nemotron3-super-omni-4n8g-fsdp2-noncolocated-smoke), 4 nodes of 8 GPUs.
# Each launch runs at most STEPS_PER_RUN steps (checkpointing at the end) and resumes from the newest
# checkpoint; NUM_RUNS launches of NUM_MINUTES each reach MAX_STEPS. Extra arguments are recipe overrides.
set -euo pipefail

# ===== BEGIN CONFIG =====
NUM_NODES=4
GPUS_PER_NODE=8
STEPS_PER_RUN=3
MAX_STEPS=3
NUM_RUNS=$(( (MAX_STEPS + STEPS_PER_RUN - 1) / STEPS_PER_RUN ))
NUM_MINUTES=60
# ===== END CONFIG =====

cd "$(dirname "$0")/../../.."
[ -f data/circle-count/train.jsonl ] || gymv prepare circle-count --n 512 --out data/circle-count/train.jsonl
[ -f data/circle-count/eval.jsonl ] || gymv prepare circle-count --n 256 --split eval --out data/circle-count/eval.jsonl
exec gymv train recipes/vlm/vlm_mopd-nemotron3-super-omni-4n8g-fsdp2-noncolocated-smoke.yaml \
  mopd.max_steps="$MAX_STEPS" \
  checkpoint.steps_per_run="$STEPS_PER_RUN" \
  checkpoint.dir="${CHECKPOINT_DIR:-runs}" \
  "$@"
