#!/usr/bin/env bash
# Install gymv with its test extras into .venv (CPU torch) and run every test this machine can run; then
# the vLLM backend's tests (tests/vllm_backend, skipped in .venv) in the separate vLLM venv (made once outside the
# checkout, then reused, by `bash scripts/install.sh vllm`), with the Triton kernel tests (decode attention, the
# Mamba convolution, the MoE experts' passes, the vocabulary scores) that need its triton. GYMV_TEST_VLLM=0
# leaves the vLLM part out. Each stage's wall time is printed at the end, and a stage more than 25% over its
# budget (below) fails the run.
# Usage: bash scripts/test.sh [pytest args...]   (e.g. -m "not slow" for the fast set; they apply to .venv's run)
# GYMV_TEST_WORKERS sets the number of pytest-xdist workers of .venv's run (default 2; 0 runs the tests in one process).

# Wall-time budgets on 2 cores, in seconds: the one place they are set (CONTRIBUTING.md states the same figures,
# and a test holds it to them). A stage passes up to 25% over its budget, machines and their load vary; beyond
# that the run fails, with a last line naming the stage and by how much.
declare -A BUDGET=(
  [fast]=180   # the fast set: the main suite's stage of a run given exactly -m "not slow"
  [main]=1200  # the main suite (.venv): every other run
  [ci]=2100    # the whole run of a fresh clone's .ci/run (venvs built from nothing); any run is held to it
)
BUDGET_HEADROOM_PCT=25
# The budgets hold on this machine at its usual speed, where scripts/machine_speed.py's workload takes this long.
# The same 2-core machine has measured up to twice as slow, idle, from one hour to the next: a run whose machine
# measures slower has its limits scaled by the ratio (at most MACHINE_SLOW_MAX_PCT; never tightened), and says so.
MACHINE_REFERENCE_S=3.0
MACHINE_SLOW_MAX_PCT=200
SPEED_PCT=${SPEED_PCT:-100}  # this run's scale of the limits, in percent (set by machine_speed_pct)
# The main suite's pytest still running at this share of its stage's budget is taken for hung (a deadlocked
# pytest-xdist session waits forever) and stopped, so that the run fails saying so rather than running into the
# CI job's own limit with nothing said.
HANG_LIMIT_PCT=250
# The fast set is checked only on a run given -m "not slow", whose main stage is the fast set's wall time. In a
# full run the suite-timing summary's fast share is test time summed over the xdist workers, with each shared
# fixture (a tiny model, the local Ray) charged to whichever test asked first, slow or not: it is not what a
# fast-only run costs, so a limit on it would fail or pass by where the fixtures fell.

# main_budget PYTEST_ARGS...: the budget the main suite's stage is held to ("fast" or "main").
main_budget() {
  local prev="" arg expr
  for arg in "$@"; do
    expr=""
    if [ "$prev" = "-m" ]; then expr=$arg; elif [[ "$arg" == -m?* ]]; then expr=${arg#-m}; fi
    prev=$arg
    if [ -n "$expr" ] && [ "$(echo "$expr" | tr -s ' ' | sed 's/^ //; s/ $//')" = "not slow" ]; then
      echo fast; return
    fi
  done
  echo main
}

# machine_speed_pct SECONDS: the scale of the limits for a machine whose speed workload took SECONDS, in percent:
# 100 at or under the reference, its ratio to the reference above it, at most MACHINE_SLOW_MAX_PCT.
machine_speed_pct() {
  awk -v s="$1" -v ref="$MACHINE_REFERENCE_S" -v cap="$MACHINE_SLOW_MAX_PCT" \
    'BEGIN { p = int(100 * s / ref); if (p < 100) p = 100; if (p > cap) p = cap; print p }'
}

# machine_speed_s: the seconds this machine takes for scripts/machine_speed.py's workload (15-20 s to measure).
machine_speed_s() {
  .venv/bin/python scripts/machine_speed.py
}

# over_budget [LABEL KEY SECONDS]...: say nothing and succeed when every stage is within its budget plus the
# headroom (scaled by SPEED_PCT); else print one line naming each stage beyond it, how long it took and by how much,
# and fail.
over_budget() {
  local over=() label key secs budget limit scaled=""
  [ "$SPEED_PCT" -gt 100 ] && scaled=" at this machine's measured speed, ${SPEED_PCT}% of the reference's time"
  while [ "$#" -ge 3 ]; do
    label=$1 key=$2 secs=$3
    shift 3
    budget=${BUDGET[$key]}
    limit=$((budget * (100 + BUDGET_HEADROOM_PCT) * SPEED_PCT / 10000))
    if [ "$secs" -gt "$limit" ]; then
      over+=("$label took $secs s, $((secs - budget)) s ($(((100 * (secs - budget) + budget - 1) / budget))%) over its $budget s budget (limit $limit s$scaled)")
    fi
  done
  [ "${#over[@]}" -eq 0 ] && return 0
  local line
  printf -v line '%s; ' "${over[@]}"
  echo "FAILED: over budget by more than $BUDGET_HEADROOM_PCT%: ${line%; }"
  return 1
}

# hang_limit KEY: the seconds after which the stage held to budget KEY is stopped as hung.
hang_limit() {
  echo $((BUDGET[$1] * HANG_LIMIT_PCT * SPEED_PCT / 10000))
}

# run_left START: the seconds the run begun at epoch START has left of its own hang limit (the whole run's budget,
# `ci`, times the same factor), at least 60: the limit of a stage without a budget of its own (the vLLM tests).
run_left() {
  local left=$(($(hang_limit ci) - ($(date +%s) - $1)))
  echo $((left < 60 ? 60 : left))
}

# guarded LIMIT LABEL COMMAND...: run COMMAND (its output shown, stderr merged into stdout), stopped after LIMIT
# seconds (TERM to its process group, KILL a minute later) with a line saying so (GUARD_WHY: what the limit is);
# pytest-xdist's lines about a
# crashed worker are repeated after it, with the Python stacks a test process that died left in
# $GYMV_TEST_CRASH_DIR (tests/crash_dumps.py), and kept in GUARD_NOTES for the run's summary. COMMAND's status.
GUARD_NOTES=()
guarded() {
  local limit=$1 label=$2 log rc t0=$SECONDS line dump
  shift 2
  log=$(mktemp)
  timeout --kill-after=60 "$limit" "$@" 2>&1 | tee "$log"
  rc=${PIPESTATUS[0]}
  local crashed="\[gw[0-9]+\] node down: .*|worker '[^']+' crashed while running '[^']+'|maximum crashed workers.*"
  while IFS= read -r line; do
    GUARD_NOTES+=("$label: $line")
  done < <(grep -aoE "$crashed" "$log" | sort -u)
  rm -f "$log"
  for dump in "${GYMV_TEST_CRASH_DIR:-/nonexistent}"/*.txt; do  # tests/crash_dumps.py: a process's fatal signal
    [ -s "$dump" ] || continue
    echo "== $label: $(basename "$dump" .txt) died; its Python stacks:"
    cat "$dump"
    GUARD_NOTES+=("$label: $(basename "$dump" .txt): $(head -n 1 "$dump") (its stacks are printed above)")
  done
  if [ "$rc" -eq 124 ] || { [ "$rc" -eq 137 ] && [ $((SECONDS - t0)) -ge "$limit" ]; }; then
    GUARD_NOTES+=("FAILED: $label still running after $limit s (${GUARD_WHY:-$HANG_LIMIT_PCT% of its budget}): stopped as hung")
  fi
  [ "${#GUARD_NOTES[@]}" -gt 0 ] && echo && printf '%s\n' "${GUARD_NOTES[@]}"  # pytest's last line may be open
  return "$rc"
}

run_tests() {
  set -euo pipefail
  cd "$(dirname "${BASH_SOURCE[0]}")/.."
  local start=${GYMV_RUN_START:-$(date +%s)}  # .ci/run sets it before its own set-up
  local stages=() t0 took main_s total_s rc vrc key name crash_dir
  t0=$(date +%s)
  stage() { local now; now=$(date +%s); took=$((now - t0)); stages+=("$(printf '%-34s %5d s' "$1" "$took")"); t0=$now; }
  bash scripts/install.sh dev
  stage "install (.venv)"
  # The NeMo Gym interop tests' venv (Python 3.12, ~1 GB) is made here, once, not by the first test that asks
  # for it, so that its install is charged to set-up and not to the main suite; no Python 3.12: they skip.
  if bash scripts/nemo_gym_venv.sh >/dev/null; then :; else
    [ $? -eq 3 ] && echo "no Python 3.12: the NeMo Gym interop tests will be skipped" || echo "the NeMo Gym venv failed to install; its tests will say why"
  fi
  stage "install (NeMo Gym venv)"
  key=$(main_budget "$@")
  local speed_s
  speed_s=$(machine_speed_s)
  SPEED_PCT=$(machine_speed_pct "$speed_s")
  echo "machine speed: its workload took $speed_s s (reference $MACHINE_REFERENCE_S s): the limits are scaled to $SPEED_PCT%"
  stage "machine speed"
  crash_dir=$(mktemp -d)
  set +e
  # Two pytest-xdist workers, one test file at a time each (module fixtures are shared within a file), the files
  # handed out in collection order (tests/conftest.py puts the longest first: xdist's own reorder, by test count,
  # would leave them for the end); GYMV_TEST_WORKERS=0 runs in this process.
  GYMV_TEST_CRASH_DIR=$crash_dir guarded "$(hang_limit "$key")" "main suite (.venv)" .venv/bin/python -m pytest -q \
    -p no:cacheprovider --timeout=900 --durations=15 -n "${GYMV_TEST_WORKERS:-2}" --dist loadfile \
    --no-loadscope-reorder "$@"
  rc=$?
  rm -rf "$crash_dir"
  set -e
  stage "main suite (.venv)"
  main_s=$took
  if [ "$rc" -eq 5 ]; then echo "pytest collected no tests"; rc=0; fi
  if [ "${GYMV_TEST_VLLM:-1}" != "0" ]; then
    bash scripts/install.sh vllm
    stage "install (vLLM venv)"
    set +e
    GUARD_WHY="what the whole run had left of its $HANG_LIMIT_PCT%" guarded "$(run_left "$start")" \
      "vLLM backend tests (vLLM venv)" "$(bash scripts/install_vllm.sh --path)/bin/python" -m pytest -q \
      -p no:cacheprovider --timeout=900 tests/vllm_backend tests/test_decode_attention.py tests/test_conv_kernel.py \
      tests/test_moe_kernels.py tests/test_scores_kernel.py
    vrc=$?
    set -e
    stage "vLLM backend tests (vLLM venv)"
    [ "$rc" -eq 0 ] && rc=$vrc
  fi
  echo "== wall time per stage (budgets on 2 cores, CONTRIBUTING.md: the fast set (-m \"not slow\") <= ${BUDGET[fast]} s," \
    "the main suite <= ${BUDGET[main]} s, a fresh clone's .ci/run <= ${BUDGET[ci]} s; more than $BUDGET_HEADROOM_PCT% over fails;" \
    "limits scaled to ${SPEED_PCT}% for this machine's measured speed)"
  printf '%s\n' "${stages[@]}"
  total_s=$(($(date +%s) - start))
  printf '%-34s %5d s\n' "whole run" "$total_s"
  [ "${#GUARD_NOTES[@]}" -gt 0 ] && printf '%s\n' "${GUARD_NOTES[@]}"
  name="main suite (.venv)"
  [ "$key" = fast ] && name="the fast set (main suite, -m \"not slow\")"
  if ! over_budget "$name" "$key" "$main_s" "whole run" ci "$total_s"; then
    [ "$rc" -eq 0 ] && rc=1
  fi
  return "$rc"
}

# Sourced (by its tests), it only defines the budgets and the functions above.
if [ "${BASH_SOURCE[0]}" = "$0" ]; then
  run_tests "$@"
fi
