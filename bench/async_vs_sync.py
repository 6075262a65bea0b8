"""Benchmark: async GRPO (`gymv train --async`) against synchronous GRPO, side by side in one run.

Two workloads, each from its own SFT warm start (made once, cached in the work folder):
- `polygon`: multi-turn polygon-naming (`tiny` preset: pictures in two turns, a get_picture tool call),
  recipe vlm_grpo-tinyllava-1n0g-torch-polygon, against a remote environment: a gymv env server in this
  process on 127.0.0.1 whose every /step and tool call takes `--latency-ms` (100 ms);
- `circle`: single-turn circle-count (the quickstart recipe), in-process environment.

Sync is the recipe as it is, its best configuration here: each phase takes both cores, remote episodes
are stepped concurrently. Async is the same recipe with `--async` (one step off-policy, truncated IS):
the generation worker runs beside training. Both train the same checkpoint on the same rows in the same
order with the same seeds. Runs alternate (sync, async, async, sync, ...) so that load from other work
falls on both alike.

Throughput is steady state: samples from the end of step 1 to the end of step N-1 over that wall time (the
`wall_time` of each metrics.jsonl row; step N also validates). Held-out accuracy is measured once at the end of each run (greedy,
`--eval-rows` rows): the two modes have then trained on the same number of samples. The step-time split
(means over steps 2..N-1) explains the ratio: in sync the phases add up; in async `wait_s` is what training
waited for rollouts and `overlap_fraction` the share of the step during which both ran.

    .venv/bin/python bench/async_vs_sync.py [--workloads polygon,circle] [--steps N] [--repeats 2]

Targets (issue #6): polygon >= 1.5x sync's samples/s on this CPU; circle: report the ratio; held-out
accuracy within 3 points of sync's.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench" / "results"
TARGET = 1.5
WORKLOADS = {
    "polygon": {"sft": "recipes/vlm/vlm_sft-tinyllava-1n0g-torch-polygon.yaml",
                "grpo": "recipes/vlm/vlm_grpo-tinyllava-1n0g-torch-polygon.yaml", "env": "polygon-naming",
                "remote": True, "n_eval": 128, "steps": 100},
    "circle": {"sft": "recipes/vlm/vlm_sft-tinyllava-1n0g-torch.yaml",
               "grpo": "recipes/vlm/vlm_grpo-tinyllava-1n0g-torch.yaml", "env": "circle-count",
               "remote": False, "n_eval": 400, "steps": 150},
}
SPLIT = ("step_s", "generation_s", "env_s", "training_s", "refit_s", "wait_s", "overlap_s")


def gpu_overrides(gpus: int, mode: str, gen_workers: int = 1) -> list[str]:
    """Sync: every GPU generates and trains (colocated, CUDA IPC refit). Async: one GPU set generates, the
    other trains (NCCL refit; with several generation workers per GPU, the object store), as async needs."""
    if gpus == 0:
        return []
    common = ["cluster.num_nodes=1", f"cluster.gpus_per_node={gpus}", "training.dtype=bfloat16", "model.dtype=bfloat16"]
    if mode == "sft":
        return common
    if mode == "sync":
        return common + ["cluster.colocated=true", "refit.transport=cuda_ipc"]
    split = ["cluster.colocated=false", f"cluster.generation_gpus={gpus // 2}", f"cluster.training_gpus={gpus - gpus // 2}"]
    if gen_workers > 1:
        return common + split + [f"cluster.generation_workers_per_gpu={gen_workers}", "refit.transport=object_store"]
    return common + split + ["refit.transport=nccl"]


def bench_env() -> dict:
    env = dict(os.environ, OMP_WAIT_POLICY="PASSIVE", PYTHONUNBUFFERED="1")
    env.pop("RAY_ADDRESS", None)
    return env


def gymv(args: list[str], log: Path) -> None:
    cmd = [sys.executable, "-m", "gymv_cli.main", *args]
    with open(log, "w") as f:
        proc = subprocess.run(cmd, cwd=ROOT, env=bench_env(), stdout=f, stderr=subprocess.STDOUT)
    if proc.returncode != 0:
        raise SystemExit(f"failed ({proc.returncode}): {' '.join(cmd)}\n  see {log}")


def metrics(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines() if line.strip()]


def load() -> float:
    return os.getloadavg()[0]


def cpu_ticks() -> tuple[int, int] | None:
    """(busy, total) jiffies of the whole machine from /proc/stat (Linux), else None."""
    try:
        fields = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    except (OSError, ValueError):
        return None
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0)
    return sum(fields) - idle, sum(fields)


def warm_start(work: Path, name: str, spec: dict, model: Path, args) -> Path:
    """The SFT run the GRPO runs start from (its final/ export), trained once."""
    run = work / "runs" / f"sft-{name}"
    if not (run / "final" / "config.json").exists():
        print(f"[{name}] SFT warm start ...", flush=True)
        gymv(["train", spec["sft"], f"name=sft-{name}", f"checkpoint.dir={work / 'runs'}", f"model.path={model}",
              "checkpoint.resume=false", *gpu_overrides(args.gpus, "sft"), *args.sft_override], work / f"sft-{name}.log")
    return run / "final"


def run_grpo(work: Path, name: str, spec: dict, init: Path, mode: str, tag: str, args, url: str | None) -> dict:
    run_name = f"{name}-{mode}-{tag}"
    steps = args.steps or spec["steps"]
    n_eval = args.eval_rows or spec["n_eval"]
    over = [f"name={run_name}", f"checkpoint.dir={work / 'runs'}", f"model.path={init}", "checkpoint.resume=false",
            f"grpo.max_steps={steps}", f"grpo.val_period={steps}", f"grpo.val_prompts={n_eval}",
            "grpo.val_at_start=false", f"checkpoint.period={steps}", f"data.prepare.n_eval={n_eval}"]
    if url:
        over.append(f"env.url={url}")
    if args.batch:
        prompts, group = args.batch.split("x")
        over += [f"grpo.prompts_per_step={prompts}", f"grpo.generations_per_prompt={group}"]
    over += gpu_overrides(args.gpus, mode, args.async_gen_workers) + args.grpo_override
    if mode == "async":
        over += ["--async", "grpo.importance_sampling.kind=truncated"]
    shutil.rmtree(work / "runs" / run_name, ignore_errors=True)  # a scratch run of an earlier invocation
    before = load()
    ticks0 = cpu_ticks()
    t0 = time.time()
    gymv(["train", spec["grpo"], *over], work / f"{run_name}.log")
    ticks1 = cpu_ticks()
    busy = (ticks1[0] - ticks0[0]) / max(ticks1[1] - ticks0[1], 1) if ticks0 and ticks1 else None
    rows = [r for r in metrics(work / "runs" / run_name) if r.get("step", 0) >= 1]
    by_step = {r["step"]: r for r in rows}
    n = max(by_step)
    last = n - 1  # step n also validates: left out of the throughput
    samples = sum(r["train/num_rollouts"] for s, r in by_step.items() if 2 <= s <= last)
    span = by_step[last]["wall_time"] - by_step[1]["wall_time"]
    steady = [r for s, r in by_step.items() if 2 <= s <= last]
    split = {k: statistics.mean(r.get(f"timing/{k}", 0.0) for r in steady) for k in SPLIT}
    split["overlap_fraction"] = statistics.mean(r.get("async/overlap_fraction", 0.0) for r in steady)
    return {"mode": mode, "samples_per_s": samples / span, "steps": n, "wall_s": time.time() - t0,
            "val_accuracy": by_step[n].get("val/accuracy"), "val_reward": by_step[n].get("val/reward_mean"),
            "train_reward_last10":
            statistics.mean(r["train/reward_mean"] for r in rows[-10:]), "turns_mean":
            statistics.mean(r["train/turns_mean"] for r in steady), "split": split, "cpu_busy": busy, "load_before": before,
            "load_after": load()}


def bench_workload(work: Path, name: str, args) -> dict:
    spec = WORKLOADS[name]
    model = work / "model"
    if not (model / "config.json").exists():
        if args.gpus:  # bench/gpu_grpo.py's ~100M-parameter model
            sys.path.insert(0, str(ROOT / "bench"))
            from gpu_grpo import MODEL

            from gymv.models.tiny import init_tiny_llava

            init_tiny_llava(model, force=True, **{**MODEL, "image_size": 56, "patch_size": 7})
        else:
            gymv(["model", "init", "tiny-llava", str(model), "--layers", "1", "--vision-layers", "1"], work / "model.log")
    init = warm_start(work, name, spec, model, args)
    server = None
    url = None
    if spec["remote"]:
        from gymv.envs import get_env
        from gymv.envs.server import EnvServer

        server = EnvServer(get_env(spec["env"]), step_latency_s=args.latency_ms / 1000.0).start()
        url = server.url
    runs: list[dict] = []
    try:
        order = ["sync", "async"]
        for i in range(args.repeats):
            for mode in (order if i % 2 == 0 else order[::-1]):
                print(f"[{name}] {mode} run {i + 1} ...", flush=True)
                runs.append(run_grpo(work, name, spec, init, mode, str(i), args, url))
                r = runs[-1]
                busy = f", machine CPU busy {100 * r['cpu_busy']:.0f}%" if r["cpu_busy"] is not None else ""
                print(f"    {r['samples_per_s']:.2f} samples/s, val {r['val_accuracy']}, load {r['load_before']:.1f}"
                      f"-{r['load_after']:.1f}{busy}", flush=True)
    finally:
        if server is not None:
            server.close()
    out = {"workload": name, "runs": runs, "latency_ms": args.latency_ms if spec["remote"] else 0}
    for mode in ("sync", "async"):
        mine = [r for r in runs if r["mode"] == mode]
        out[mode] = {"samples_per_s": statistics.median(r["samples_per_s"] for r in mine),
                     "val_accuracy": statistics.mean(r["val_accuracy"] for r in mine),
                     "val_reward": statistics.mean(r["val_reward"] for r in mine),
                     "split": {k: statistics.median(r["split"][k] for r in mine) for k in mine[0]["split"]}}
    out["ratio"] = out["async"]["samples_per_s"] / out["sync"]["samples_per_s"]
    out["accuracy_gap_points"] = 100 * (out["async"]["val_accuracy"] - out["sync"]["val_accuracy"])
    return out


def print_table(results: list[dict]) -> None:
    print("\n| workload | sync samples/s | async samples/s | **ratio** | held-out accuracy sync / async | gap (points) "
          "| held-out reward sync / async |")
    print("|---|---|---|---|---|---|---|")
    for r in results:
        print(f"| {r['workload']} | {r['sync']['samples_per_s']:.2f} | {r['async']['samples_per_s']:.2f} | "
              f"**{r['ratio']:.2f}x** | {r['sync']['val_accuracy']:.3f} / {r['async']['val_accuracy']:.3f} | "
              f"{r['accuracy_gap_points']:+.1f} | {r['sync']['val_reward']:.3f} / {r['async']['val_reward']:.3f} |")
    print("\nStep-time split (medians of per-run means over steps 2..N-1, seconds):\n")
    print("| workload | mode | " + " | ".join(SPLIT) + " | overlap fraction |")
    print("|---|---|" + "---|" * (len(SPLIT) + 1))
    for r in results:
        for mode in ("sync", "async"):
            s = r[mode]["split"]
            print(f"| {r['workload']} | {mode} | " + " | ".join(f"{s[k]:.3f}" for k in SPLIT)
                  + f" | {s['overlap_fraction']:.2f} |")


def write_results(args, results: list[dict]) -> None:
    """Merge into --out: the workloads run now replace their earlier entries, the others are kept."""
    ran = {r["workload"] for r in results}
    try:
        old = json.loads(args.out.read_text())
    except (OSError, ValueError):
        old = {}
    same = all(old.get(k) == getattr(args, k) for k in ("repeats", "gpus", "batch", "async_gen_workers"))
    kept = [r for r in old.get("results", []) if r["workload"] not in ran] if same else []
    steps = {**(old.get("steps", {}) if same else {}),
             **{n: args.steps or WORKLOADS[n]["steps"] for n in ran}}
    order = list(WORKLOADS)
    merged = sorted(kept + results, key=lambda r: order.index(r["workload"]))
    dates = {**(old.get("dates", {}) if same else {}), **{n: time.strftime("%Y-%m-%d %H:%M") for n in ran}}
    args.out.write_text(json.dumps({"steps": steps, "repeats": args.repeats, "gpus": args.gpus, "batch": args.batch,
                                    "async_gen_workers": args.async_gen_workers, "results": merged, "cpus": os.cpu_count(), "dates": dates}, indent=1))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--workloads", default="polygon,circle")
    p.add_argument("--steps", type=int, default=None, help="GRPO steps per run (default: polygon 100, circle 150)")
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--eval-rows", type=int, default=None, help="held-out rows (default: polygon 128, circle 400)")
    p.add_argument("--latency-ms", type=float, default=100.0)
    p.add_argument("--gpus", type=int, default=0, help="0: this CPU; N: sync on all N GPUs against async N/2 + N/2")
    p.add_argument("--batch", default=None, help="prompts x generations per step, e.g. 16x8 (default: the recipe's)")
    p.add_argument("--sft-override", action="append", default=[], help="extra override for the warm start (repeatable)")
    p.add_argument("--async-gen-workers", type=int, default=1,
                   help="with --gpus: generation workers sharing each generating GPU in async (object-store refit when > 1)")
    p.add_argument("--grpo-override", action="append", default=[], help="extra override for both GRPO runs (repeatable)")
    p.add_argument("--work", type=Path, default=Path("/tmp/gymv-bench-async"))
    p.add_argument("--out", type=Path, default=RESULTS / "async_vs_sync.json")
    args = p.parse_args()
    args.work.mkdir(parents=True, exist_ok=True)
    results = [bench_workload(args.work, name, args) for name in args.workloads.split(",")]
    print_table(results)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    write_results(args, results)
    for r in results:
        if r["workload"] == "polygon":
            verdict = "meets" if r["ratio"] >= TARGET else "misses"
            print(f"\npolygon: async {r['ratio']:.2f}x sync {verdict} the {TARGET}x target")


if __name__ == "__main__":
    main()
