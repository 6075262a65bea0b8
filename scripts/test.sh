#!/usr/bin/env bash
# Install gymv with its test extras into .venv (CPU torch) and run every test this machine can run; then
# the vLLM backend's tests (tests/vllm_backend, skipped in .venv) in the separate vLLM venv (made once outside the
# checkout, then reused, by `bash scripts/install.sh vllm`), with the decode-attention kernel tests that need its
# triton. GYMV_TEST_VLLM=0 leaves the vLLM part out.
# Usage: bash scripts/test.sh [pytest args...]   (e.g. -m "not slow" for the fast set; they apply to .venv's run)
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh dev
set +e
.venv/bin/python -m pytest -q -p no:cacheprovider --timeout=900 "$@"
rc=$?
set -e
if [ "$rc" -eq 5 ]; then echo "pytest collected no tests"; rc=0; fi
if [ "${GYMV_TEST_VLLM:-1}" != "0" ]; then
  bash scripts/install.sh vllm
  set +e
  "$(bash scripts/install_vllm.sh --path)/bin/python" -m pytest -q -p no:cacheprovider --timeout=900 tests/vllm_backend tests/test_decode_attention.py
  vrc=$?
  set -e
  [ "$rc" -eq 0 ] && rc=$vrc
fi
exit "$rc"
