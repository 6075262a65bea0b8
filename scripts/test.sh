#!/usr/bin/env bash
# Install gymv with its test extras into .venv (CPU torch) and run every test this machine can run.
# Usage: bash scripts/test.sh [pytest args...]   (e.g. -m "not slow" for the fast set)
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh dev
set +e
.venv/bin/python -m pytest -q -p no:cacheprovider --timeout=900 "$@"
rc=$?
set -e
if [ "$rc" -eq 5 ]; then echo "pytest collected no tests"; exit 0; fi
exit "$rc"
