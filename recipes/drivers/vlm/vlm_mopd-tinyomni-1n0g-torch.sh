#!/usr/bin/env bash
# Two-teacher MOPD with a tiny Nemotron 3 Omni student on mixed circle-count + polygon-naming rows, CPU
# only. Writes the mixed rows once, then trains; each launch runs at most STEPS_PER_RUN steps and resumes
# from the newest checkpoint. Extra arguments are recipe overrides (e.g. mopd.teachers.counting.path=...).
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
DATA=data/mopd-omni
[ -f "$DATA/train.jsonl" ] || gymv prepare mix circle-count:tiny:128 polygon-naming:tiny:128 --out "$DATA/train.jsonl"
[ -f "$DATA/eval.jsonl" ] || gymv prepare mix circle-count:tiny:16 polygon-naming:tiny:16 --split eval --out "$DATA/eval.jsonl"
exec gymv train recipes/vlm/vlm_mopd-tinyomni-1n0g-torch.yaml \
  mopd.max_steps="$MAX_STEPS" \
  checkpoint.steps_per_run="$STEPS_PER_RUN" \
  checkpoint.dir="${CHECKPOINT_DIR:-runs}" \
  "$@"
