#!/usr/bin/env bash
# One command for a GPU machine, run from the repository root: the `gpu`-marked tests of tests/ and, behind a
# flag each, the GPU benchmarks the open issues ask for. Plain bash; nothing is installed system-wide.
#
#   bash scripts/gpu-session.sh [SITE] [PARTS...] [OPTIONS]      (bash scripts/gpu-session.sh --help)
#
# SITE (or $GYMV_SITE) is a site folder holding what the host's Python lacks (Ray, pydantic, ...): a folder
# unpacked from an offline archive or filled from a wheelhouse with `pip install --target`. It goes first on
# PYTHONPATH, its bin/ on PATH. Without one, the host's own Python must have them.
set -euo pipefail

usage() {
  cat <<'EOF'
Usage: bash scripts/gpu-session.sh [SITE] [PARTS...] [OPTIONS]

SITE             a site folder with the packages the host lacks (default: $GYMV_SITE; none: the host's Python)

Parts (none named: --tests):
  --tests          every `gpu`-marked test of tests/ (pytest -m gpu)
  --tests-file F   only the gpu-marked tests of F (repeatable), e.g. tests/test_gpu_train_e2e.py
  --omni           bench/gpu_nemotron_omni.py --device cuda        (Nemotron 3 Nano Omni layers, train, decode)
  --omni-profile   the same, profiled: 13-layer decode (static, hf_generate) and 3-layer trainers (gymv, megatron)
  --omni-decode52  the full 52-layer decode, bf16, batch 64 (static, hf_generate; about 65 GB of weights)
  --refit-check    bench/refit_check.py --device cuda --steps 6    (refit digests, the 0.8B GRPO step)
  --grpo           bench/gpu_grpo.py, colocated on one GPU, 3 steps (two GPUs: the separate layout too)
  --fsdp2-train    bench/gpu_train.py --shapes 0.8b                (the fsdp2 trainer step)
  --megatron       bench/gpu_megatron.py                           (needs megatron-core)
  --trl            bench/grpo_vs_trl.py --device cuda --repeats 1  (needs trl)
  --doorkey        bench/gpu_doorkey.py                            (SFT then multi-turn GRPO, ~9 min)
  --grpo-7b        bench/gpu_grpo_7b.py                            (the 7B shape colocated: bf16-moments on an H200, else offload)
  --benches        every bench above

Options:
  -k EXPR          pytest -k filter for the test parts
  --test-timeout S seconds per test where pytest-timeout is installed (default 600)
  --part-timeout S seconds each bench may run before it is stopped (default 540)
  --out DIR        where results go (default: $OUT if set, else bench/results/gpu-session)
  -h, --help       this text

Results: gpu-tests.xml (junit) and gpu-tests.txt (the pytest output), and per bench <name>.json and
<name>.log, flat in the results folder; scratch (checkpoints, models) goes to a temporary folder. Exit code: the
first failing part's, after every part asked for has run.
EOF
}

SITE=${GYMV_SITE:-}
parts=()
files=()
kexpr=""
test_timeout=600
part_timeout=540
res=${OUT:-bench/results/gpu-session}
while [[ $# -gt 0 ]]; do
  case $1 in
    -h|--help) usage; exit 0 ;;
    --tests|--omni|--omni-profile|--omni-decode52|--refit-check|--grpo|--fsdp2-train|--megatron|--trl|--doorkey|--grpo-7b) parts+=("${1#--}") ;;
    --benches) parts+=(omni omni-profile omni-decode52 refit-check grpo fsdp2-train megatron trl doorkey grpo-7b) ;;
    --tests-file) files+=("$2"); parts+=(tests); shift ;;
    -k) kexpr=$2; shift ;;
    --test-timeout) test_timeout=$2; shift ;;
    --part-timeout) part_timeout=$2; shift ;;
    --out) res=$2; shift ;;
    -*) echo "error: unknown option $1 (see --help)" >&2; exit 2 ;;
    *) if [[ -z ${site_given:-} && -d $1 ]]; then SITE=$1; site_given=1
       else echo "error: $1 is neither an option nor a site folder (see --help)" >&2; exit 2; fi ;;
  esac
  shift
done
[[ ${#parts[@]} -eq 0 ]] && parts=(tests)
if [[ ! -f pyproject.toml || ! -d gymv ]]; then
  echo "error: run this from the repository root (bash scripts/gpu-session.sh ...)" >&2; exit 2
fi
REPO=$(pwd)
PY=$(command -v "${PYTHON:-python3}") || { echo "error: ${PYTHON:-python3} not found (set PYTHON)" >&2; exit 2; }
[[ $PY == /* ]] || PY="$REPO/$PY"

# ---- environment: the site folder, then gymv's CLI importable from any folder --------------------------
if [[ -n $SITE ]]; then
  [[ -d $SITE ]] || { echo "error: site folder $SITE not found (pass the unpacked folder or set GYMV_SITE)" >&2; exit 2; }
  SITE=$(cd "$SITE" && pwd)
  export PYTHONPATH="$SITE${PYTHONPATH:+:$PYTHONPATH}" PATH="$SITE/bin:$PATH"
fi
work=$(mktemp -d)
made_link=""
cleanup() {
  rm -rf "$work"
  [[ -n $made_link ]] && rm -f "$REPO/gymv_cli/commands"
  return 0
}
trap cleanup EXIT
cli_ok() { (cd "$work" && "$PY" -c 'import gymv_cli.commands.train' 2>/dev/null); }
if ! cli_ok; then
  # the tests run `python -m gymv_cli.main` from their own folders: gymv must import from anywhere, with the
  # commands/ folder that an install maps to gymv_cli.commands
  if "$PY" -m pip install -q --no-index --no-deps --no-build-isolation --target "$work/gymv" . >"$work/pip.log" 2>&1; then
    # the copy's recipe roots are its own: the tests' recipes name this checkout's recipes/ in `defaults:`
    export PYTHONPATH="$work/gymv${PYTHONPATH:+:$PYTHONPATH}" GYMV_RECIPE_ROOTS="$REPO/recipes${GYMV_RECIPE_ROOTS:+:$GYMV_RECIPE_ROOTS}"
  else
    ln -s ../commands gymv_cli/commands && made_link=1
    export PYTHONPATH="$REPO${PYTHONPATH:+:$PYTHONPATH}"
  fi
  cli_ok || { echo "error: gymv's CLI does not import (pip: $(tail -1 "$work/pip.log"))" >&2; exit 1; }
fi

mkdir -p "$res"
res=$(cd "$res" && pwd)
echo "results: $res"
"$PY" - <<'PY' | tee "$res/environment.txt"
import importlib, platform
import torch
print(f"python {platform.python_version()}, torch {torch.__version__}, CUDA {torch.version.cuda}")
if not torch.cuda.is_available():
    raise SystemExit("error: no CUDA device visible to torch")
for i in range(torch.cuda.device_count()):
    p = torch.cuda.get_device_properties(i)
    print(f"GPU {i}: {p.name}, {p.total_memory / 2**30:.0f} GiB")
for name in ("transformers", "ray", "pydantic", "pytest", "pytest_timeout", "mamba_ssm", "causal_conv1d", "triton",
             "megatron.core", "trl", "vllm"):
    try:
        m = importlib.import_module(name)
        print(f"{name} {getattr(m, '__version__', '?')}")
    except Exception as e:
        print(f"{name}: not importable ({type(e).__name__})")
PY

# ---- parts ---------------------------------------------------------------------------------------------
status=0
note() { echo; echo "==== $* ($(date -u +%H:%M:%S) UTC)"; }
failed() { echo "==== $1 failed with exit code $2"; [[ $status -ne 0 ]] || status=$2; }

run_tests() {
  local args=(-m gpu -p no:cacheprovider -rA -o junit_family=xunit1 --junitxml "$res/gpu-tests.xml")
  "$PY" -c 'import pytest_timeout' 2>/dev/null && args+=(--timeout "$test_timeout")
  [[ -n $kexpr ]] && args+=(-k "$kexpr")
  if [[ ${#files[@]} -gt 0 ]]; then args+=("${files[@]}"); else args+=(tests); fi
  note "tests: pytest ${args[*]}"
  set +e
  PYTHONUNBUFFERED=1 "$PY" -m pytest "${args[@]}" 2>&1 | tee "$res/gpu-tests.txt"
  local rc=${PIPESTATUS[0]}
  set -e
  [[ $rc -eq 0 ]] || failed tests "$rc"
}

# run_bench NAME CMD...: the command under `timeout`, its output in NAME.log
run_bench() {
  local name=$1; shift
  note "$name: $*"
  set +e
  PYTHONUNBUFFERED=1 timeout --kill-after=20 "$part_timeout" "$@" 2>&1 | tee "$res/$name.log"
  local rc=${PIPESTATUS[0]}
  set -e
  [[ $rc -eq 0 ]] || failed "$name" "$rc"
}

gpus=$("$PY" -c 'import torch; print(torch.cuda.device_count())')
ran=" "
for part in "${parts[@]}"; do
  [[ $ran == *" $part "* ]] && continue
  ran+="$part "
  case $part in
    tests) run_tests ;;
    omni) run_bench gpu_nemotron_omni "$PY" bench/gpu_nemotron_omni.py --device cuda --out "$work/omni" \
            --json "$res/gpu_nemotron_omni.json" ;;
    omni-profile)
      run_bench omni_decode_profile "$PY" bench/gpu_nemotron_omni.py --device cuda --out "$work/omni" --part decode \
        --decode-layers 13 --paths static,hf_generate --profile --json "$res/omni_decode_profile.json"
      for path in gymv megatron; do
        run_bench "omni_train_${path}_profile" "$PY" bench/gpu_nemotron_omni.py --device cuda --out "$work/omni" \
          --part train --train-paths "$path" --train-layers 3 --profile --json "$res/omni_train_${path}_profile.json"
      done ;;
    omni-decode52) run_bench omni_decode52 "$PY" bench/gpu_nemotron_omni.py --device cuda --out "$work/omni" \
                     --part decode --decode-layers 52 --paths static,hf_generate --json "$res/omni_decode52.json" ;;
    refit-check) run_bench refit_check "$PY" bench/refit_check.py --device cuda --steps 6 --work "$work/refit" \
                   --out "$res/refit_check.json" ;;
    grpo)
      layouts=colocated; [[ $gpus -ge 2 ]] && layouts=separate,colocated
      run_bench gpu_grpo "$PY" bench/gpu_grpo.py --out "$work/grpo" --steps 3 --layouts "$layouts" --decode auto
      [[ -f $work/grpo/results.json ]] && cp "$work/grpo/results.json" "$res/gpu_grpo.json" ;;
    fsdp2-train)
      run_bench gpu_train "$PY" bench/gpu_train.py --out "$work/train" --shapes 0.8b --steps 3
      [[ -f $work/train/gpu_train.json ]] && cp "$work/train/gpu_train.json" "$res/gpu_train.json" ;;
    megatron) run_bench gpu_megatron "$PY" bench/gpu_megatron.py --out "$res/gpu_megatron.json" ;;
    trl) run_bench grpo_vs_trl "$PY" bench/grpo_vs_trl.py --device cuda --repeats 1 --work "$work/trl" \
           --out "$res/grpo_vs_trl.json" ;;
    doorkey)
      run_bench gpu_doorkey "$PY" bench/gpu_doorkey.py --out "$work/doorkey" --sft-timeout 180 --grpo-timeout 320
      cp "$work/doorkey/doorkey.json" "$work/doorkey/doorkey.png" "$res/" 2>/dev/null || true ;;
    grpo-7b)
      run_bench gpu_grpo_7b "$PY" bench/gpu_grpo_7b.py --out "$work/grpo7b" --run-timeout $((part_timeout - 60))
      cp "$work/grpo7b/gpu_grpo_7b.json" "$res/" 2>/dev/null || true ;;
  esac
done
echo
echo "results in $res: $(cd "$res" && ls | tr '\n' ' ')"
exit $status
