#!/usr/bin/env bash
# The 3-step smoke of the Super Omni MOPD run in Megatron
# (vlm_mopd-nemotron3-super-omni-4n8g-megatron-tp8ep16cp2-async-noncolocated-smoke): the 10-node driver on 4 nodes
# for 480 minutes, with this recipe, as the reference smoke runs its parent's driver.
set -euo pipefail
SCRIPT_DIR="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"

# ===== BEGIN CONFIG =====
NUM_NODES=4
GPUS_PER_NODE=8
STEPS_PER_RUN=3
MAX_STEPS=3
NUM_MINUTES=480
RECIPE=recipes/vlm/vlm_mopd-nemotron3-super-omni-4n8g-megatron-tp8ep16cp2-async-noncolocated-smoke.yaml
# ===== END CONFIG =====
export NUM_NODES NUM_MINUTES RECIPE

exec "$SCRIPT_DIR/vlm_mopd-nemotron3-super-omni-10n8g-megatron-tp8ep16cp2-async-noncolocated.sh" "$@"
