#!/usr/bin/env bash
# Make (once) and print the path of a Python 3.12 venv with the public nemo-gym 0.4.0, which the interop tests
# run NeMo Gym's own servers and agents from. It lives outside the repo (it is ~1 GB) and is reused.
# Usage: bash scripts/nemo_gym_venv.sh            prints the venv's python; exit 3 when no Python 3.12 exists
set -euo pipefail
version=0.4.0
venv="${GYMV_NEMO_GYM_VENV:-${XDG_CACHE_HOME:-$HOME/.cache}/gymv/nemo-gym-${version}-py312}"
if [ -x "$venv/bin/python" ] && "$venv/bin/python" -c "import nemo_gym, resources_servers, responses_api_agents" 2>/dev/null; then
  echo "$venv/bin/python"; exit 0
fi
py=""
for cand in python3.12 "$HOME"/.pyenv/versions/3.12*/bin/python3.12 /usr/bin/python3.12; do
  # pyenv's shims exist even where their version is not selected: ask each candidate to run.
  if "$cand" -c 'import sys; assert sys.version_info[:2] == (3, 12)' >/dev/null 2>&1; then py=$(command -v "$cand"); break; fi
done
if [ -z "$py" ]; then echo "no Python 3.12 found (nemo-gym $version needs it): install one, e.g. pyenv install 3.12" >&2; exit 3; fi
rm -rf "$venv.tmp"
"$py" -m venv "$venv.tmp" >&2
"$venv.tmp/bin/python" -m pip install -q --disable-pip-version-check "nemo-gym==$version" 2>&1 | grep -vE "Location 'file|^\s*$" >&2 || true
"$venv.tmp/bin/python" -c "import nemo_gym, resources_servers, responses_api_agents" >&2
rm -rf "$venv"; mv "$venv.tmp" "$venv"
# A moved venv keeps its old path in scripts, not in bin/python: only python is used.
echo "$venv/bin/python"
