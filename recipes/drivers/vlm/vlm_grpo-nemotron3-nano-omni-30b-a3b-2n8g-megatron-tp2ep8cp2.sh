#!/usr/bin/env bash
# GRPO of Nemotron 3 Nano Omni in Megatron TP2 x EP8 x CP2 (vlm_grpo-nemotron3-nano-omni-30b-a3b-2n8g-megatron-tp2ep8cp2),
# 2 nodes of 8 GPUs: the reference driver's 10 steps in one launch of 120 minutes. Extra arguments are recipe
# overrides.
set -euo pipefail

# ===== BEGIN CONFIG =====
NUM_NODES=2
GPUS_PER_NODE=8
STEPS_PER_RUN=10
MAX_STEPS=10
NUM_RUNS=$(( (MAX_STEPS + STEPS_PER_RUN - 1) / STEPS_PER_RUN ))
NUM_MINUTES=120
# ===== END CONFIG =====

cd "$(dirname "$0")/../../.."
exec gymv train recipes/vlm/vlm_grpo-nemotron3-nano-omni-30b-a3b-2n8g-megatron-tp2ep8cp2.yaml \
  grpo.max_steps="$MAX_STEPS" \
  checkpoint.steps_per_run="$STEPS_PER_RUN" \
  checkpoint.dir="${CHECKPOINT_DIR:-runs}" \
  "$@"
