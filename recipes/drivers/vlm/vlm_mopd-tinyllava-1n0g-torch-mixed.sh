#!/usr/bin/env bash
# Two-teacher MOPD on a mixed circle-count + arithmetic dataset, CPU only. Writes the mixed rows and an
# untrained teacher once, then trains; each launch runs at most STEPS_PER_RUN steps and resumes from the
# newest checkpoint. Extra arguments are recipe overrides (e.g. mopd.teachers.counting.path=...).
set -euo pipefail

# ===== BEGIN CONFIG =====
NUM_NODES=1
GPUS_PER_NODE=0
STEPS_PER_RUN=40
MAX_STEPS=40
NUM_RUNS=$(( (MAX_STEPS + STEPS_PER_RUN - 1) / STEPS_PER_RUN ))
NUM_MINUTES=45
# ===== END CONFIG =====

cd "$(dirname "$0")/../../.."
DATA=data/mopd-mixed
[ -f "$DATA/train.jsonl" ] || gymv prepare mix circle-count:tiny:128 arithmetic:tiny:128 --out "$DATA/train.jsonl"
[ -f "$DATA/eval.jsonl" ] || gymv prepare mix circle-count:tiny:16 arithmetic:tiny:16 --split eval --out "$DATA/eval.jsonl"
TEACHER=runs/teachers/tiny-llava-h64-l1
[ -f "$TEACHER/config.json" ] || gymv model init tiny-llava "$TEACHER" --hidden 64 --layers 1
exec gymv train recipes/vlm/vlm_mopd-tinyllava-1n0g-torch-mixed.yaml \
  mopd.max_steps="$MAX_STEPS" \
  checkpoint.steps_per_run="$STEPS_PER_RUN" \
  checkpoint.dir="${CHECKPOINT_DIR:-runs}" \
  "$@"
