#!/usr/bin/env bash
# Install gymv with its test extras into .venv (CPU torch from the local wheel) and run every test this machine
# can run. Usage: bash scripts/test.sh [pytest args...]   (e.g. -m "not slow" for the fast set)
set -euo pipefail
cd "$(dirname "$0")/.."
if [ ! -x .venv/bin/python ]; then python3 -m venv .venv; fi
.venv/bin/python -m pip install -q --upgrade pip >/dev/null
.venv/bin/python -m pip install -q torch==2.13.0 -e '.[dev]' 2>&1 | grep -vE "Location 'file|^\s*$" || true
set +e
.venv/bin/python -m pytest -q -p no:cacheprovider --timeout=900 "$@"
rc=$?
set -e
if [ "$rc" -eq 5 ]; then echo "pytest collected no tests"; exit 0; fi
exit "$rc"
