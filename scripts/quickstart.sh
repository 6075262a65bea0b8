#!/usr/bin/env bash
# The gymv quickstart on a laptop CPU: install, prepare circle-count (tiny preset, disjoint train/eval rows),
# build the embedded tiny VLM, SFT warm start, GRPO, then print held-out accuracy before and after GRPO and
# write a report (plots + rollout viewer). Usage: bash scripts/quickstart.sh   (outputs under runs/quickstart/)
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh
export PATH="$PWD/.venv/bin:$PATH" OMP_WAIT_POLICY="${OMP_WAIT_POLICY:-PASSIVE}"
out=runs/quickstart
rm -rf "$out"
mkdir -p "$out"
start=$(date +%s)

echo "== 1/5 prepare circle-count (tiny preset, radius 9): 4096 train rows, 400 held-out eval rows"
gymv prepare circle-count --preset tiny --n 4096 --split train --out "$out/data/train.jsonl" --preview "$out/data/preview.png" radius=9
gymv prepare circle-count --preset tiny --n 400 --split eval --out "$out/data/eval.jsonl" radius=9

echo "== 2/5 build the tiny LLaVA-style VLM (random init, tokenizer trained on the fly)"
gymv model init tiny-llava "$out/model" --layers 1 --vision-layers 1

data=("data.train=$out/data/train.jsonl" "data.eval=$out/data/eval.jsonl" "data.prepare=null" "checkpoint.dir=$out")

echo "== 3/5 SFT warm start on gold answers"
gymv train recipes/vlm/vlm_sft-tinyllava-1n0g-torch.yaml name=sft "model.path=$out/model" "${data[@]}"

echo "== 4/5 GRPO from the SFT weights (validation before the first step = the SFT start)"
gymv train recipes/vlm/vlm_grpo-tinyllava-1n0g-torch.yaml name=grpo "model.path=$out/sft/final" \
  grpo.val_at_start=true "${data[@]}"

echo "== 5/5 result"
gymv report "$out/grpo" --out "$out/grpo/report" >/dev/null
.venv/bin/python - "$out/grpo/metrics.jsonl" "$start" <<'PY'
import json, os, sys, time
rows = [json.loads(l) for l in open(sys.argv[1]) if l.strip()]
val = [(r["step"], r["val/accuracy"]) for r in rows if "val/accuracy" in r]
(s0, before), (s1, after) = val[0], val[-1]
n = sum(1 for l in open(sys.argv[1].rsplit('/', 2)[0] + "/data/eval.jsonl") if l.strip())
print(f"held-out accuracy (greedy, all {n} rows of {sys.argv[1].rsplit('/', 2)[0]}/data/eval.jsonl, disjoint from train):")
print(f"  before GRPO (step {s0}, after SFT): {before:6.1%}")
print(f"  after  GRPO (step {s1}):            {after:6.1%}   ({(after - before) * 100:+.1f} points)")
print(f"total wall time: {time.time() - float(sys.argv[2]):.0f} s (load average now: {os.getloadavg()[0]:.1f})")
PY
echo "report: $out/grpo/report/index.html   plots and every rollout with its image"
