#!/usr/bin/env bash
# MOPD into Nemotron 3 Super Omni in Megatron (vlm_mopd-nemotron3-super-omni-10n8g-megatron-tp8ep16cp2-async-noncolocated),
# 10 nodes of 8 GPUs: the reference driver's 3 steps in one launch of 840 minutes. The smoke's driver runs this one
# with its own NUM_NODES, NUM_MINUTES and RECIPE exported. Extra arguments are recipe overrides.
set -euo pipefail

# ===== BEGIN CONFIG =====
NUM_NODES="${NUM_NODES:-10}"
GPUS_PER_NODE=8
STEPS_PER_RUN=3
MAX_STEPS=3
NUM_RUNS=1
NUM_MINUTES="${NUM_MINUTES:-840}"
RECIPE="${RECIPE:-recipes/vlm/vlm_mopd-nemotron3-super-omni-10n8g-megatron-tp8ep16cp2-async-noncolocated.yaml}"
# ===== END CONFIG =====

cd "$(dirname "$0")/../../.."
[ -f data/circle-count/train.jsonl ] || gymv prepare circle-count --n 512 --out data/circle-count/train.jsonl
[ -f data/circle-count/eval.jsonl ] || gymv prepare circle-count --n 256 --split eval --out data/circle-count/eval.jsonl
exec gymv train "$RECIPE" \
  mopd.max_steps="$MAX_STEPS" \
  checkpoint.steps_per_run="$STEPS_PER_RUN" \
  checkpoint.dir="${CHECKPOINT_DIR:-runs}" \
  "$@"
