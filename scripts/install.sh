#!/usr/bin/env bash
# Install gymv into .venv with the CPU build of PyTorch (torch==2.13.0; an unpinned torch would pull a multi-GB
# CUDA build). GPU users: install your own torch first, then `pip install -e .`.
# Usage: bash scripts/install.sh [EXTRAS]     e.g. bash scripts/install.sh dev
#        bash scripts/install.sh vllm   makes the separate vLLM venv instead (scripts/install_vllm.sh; outside the checkout)
set -euo pipefail
cd "$(dirname "$0")/.."
extras="${1:-}"
if [ "$extras" = "vllm" ]; then exec bash scripts/install_vllm.sh; fi
spec="."
[ -n "$extras" ] && spec=".[${extras}]"
if [ ! -x .venv/bin/python ]; then python3 -m venv .venv; fi
.venv/bin/python -m pip install -q --upgrade pip 2>&1 | grep -vE "Location 'file|^\s*$" || true
# setuptools' generic notice about editable installs (a package folder in the working directory wins imports)
# is dropped: it is always printed for this layout and asks nothing of the user
.venv/bin/python -m pip install -q torch==2.13.0 -e "$spec" 2>&1 \
  | awk '/BuildBackendWarning: Editable installation/ {skip=1} !skip {print} skip && /with strategy, WheelFile/ {skip=0}' \
  | grep -vE "Location 'file|^\s*$" || true
.venv/bin/python -c "import gymv, torch; print(f'gymv {gymv.__version__} installed (torch {torch.__version__})')"
