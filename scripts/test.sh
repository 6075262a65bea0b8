#!/usr/bin/env bash
# Install gymv with its test extras into .venv (CPU torch) and run every test this machine can run; then
# the vLLM backend's tests (tests/vllm_backend, skipped in .venv) in the separate vLLM venv (made once outside the
# checkout, then reused, by `bash scripts/install.sh vllm`), with the decode-attention kernel tests that need its
# triton. GYMV_TEST_VLLM=0 leaves the vLLM part out. Each stage's wall time is printed at the end.
# Usage: bash scripts/test.sh [pytest args...]   (e.g. -m "not slow" for the fast set; they apply to .venv's run)
# GYMV_TEST_WORKERS sets the number of pytest-xdist workers of .venv's run (default 2; 0 runs the tests in one process).
set -euo pipefail
cd "$(dirname "$0")/.."
stages=()
t0=$(date +%s)
stage() { local now; now=$(date +%s); stages+=("$(printf '%-34s %5d s' "$1" $((now - t0)))"); t0=$now; }
bash scripts/install.sh dev
stage "install (.venv)"
set +e
# Two pytest-xdist workers, one test file at a time each (module fixtures are shared within a file);
# GYMV_TEST_WORKERS=0 runs in this process.
.venv/bin/python -m pytest -q -p no:cacheprovider --timeout=900 --durations=15 \
  -n "${GYMV_TEST_WORKERS:-2}" --dist loadfile "$@"
rc=$?
set -e
stage "main suite (.venv)"
if [ "$rc" -eq 5 ]; then echo "pytest collected no tests"; rc=0; fi
if [ "${GYMV_TEST_VLLM:-1}" != "0" ]; then
  bash scripts/install.sh vllm
  stage "install (vLLM venv)"
  set +e
  "$(bash scripts/install_vllm.sh --path)/bin/python" -m pytest -q -p no:cacheprovider --timeout=900 tests/vllm_backend tests/test_decode_attention.py
  vrc=$?
  set -e
  stage "vLLM backend tests (vLLM venv)"
  [ "$rc" -eq 0 ] && rc=$vrc
fi
echo "== wall time per stage (targets, CONTRIBUTING.md: main suite <= 600 s on 2 cores, the fast set <= 180 s)"
printf '%s\n' "${stages[@]}"
exit "$rc"
