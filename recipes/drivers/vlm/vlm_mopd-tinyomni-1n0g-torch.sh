#!/usr/bin/env bash
# Self-distillation MOPD with a tiny Nemotron 3 Omni student on circle-count rows (the recipe prepares them),
# CPU only; each launch runs at most STEPS_PER_RUN steps and resumes from the newest checkpoint. Extra
# arguments are recipe overrides (e.g. mopd.teachers.self.path=...).
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
exec gymv train recipes/vlm/vlm_mopd-tinyomni-1n0g-torch.yaml \
  mopd.max_steps="$MAX_STEPS" \
  checkpoint.steps_per_run="$STEPS_PER_RUN" \
  checkpoint.dir="${CHECKPOINT_DIR:-runs}" \
  "$@"
