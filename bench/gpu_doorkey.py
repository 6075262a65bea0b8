"""doorkey on one GPU: an SFT warm start on gold episodes, then multi-turn GRPO; held-out success before and after.

doorkey (docs/environments.md) is the reference environment that had not learned anywhere: on a 2-core CPU a
GRPO step of 4 worlds x 8 episodes took 37-56 s and the sampled success stayed near 4% over 27 steps. This
script runs the shipped recipes (`vlm_sft-tinyllava-1n0g-torch-doorkey.yaml`, then
`vlm_grpo-tinyllava-1n0g-torch-doorkey.yaml` from its checkpoint) with the four keys that move a recipe onto
one GPU (docs/training.md, "Running a recipe on one GPU") and the scale given here: a LLaVA-style model built
locally (`gymv.models.tiny`, --hidden/--layers), more worlds per GRPO step, more SFT steps. Each run is its
own process (the engine's entry point, as `gymv train` calls it); a run stopped at its --*-timeout keeps the
steps it logged. Writes DIR/doorkey.json (the held-out greedy success at each validation of both runs, the
per-step sampled success, step times) and DIR/doorkey.png (the curves), and prints a table.

Usage (a GPU machine):  python bench/gpu_doorkey.py --out /tmp/dk [--grpo-steps 60] [--prompts 16]
       on a CPU, to check the script:  python bench/gpu_doorkey.py --cpu-smoke --out /tmp/dk
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SFT_RECIPE = ROOT / "recipes/vlm/vlm_sft-tinyllava-1n0g-torch-doorkey.yaml"
GRPO_RECIPE = ROOT / "recipes/vlm/vlm_grpo-tinyllava-1n0g-torch-doorkey.yaml"
GPU = ["cluster.num_nodes=1", "cluster.gpus_per_node=1", "cluster.colocated=true", "refit.transport=auto",
       "training.dtype=bfloat16", "model.dtype=bfloat16"]
CPU = ["cluster.num_nodes=1", "cluster.gpus_per_node=0"]


def run(name: str, recipe: Path, overrides: list[str], out: Path, timeout_s: float) -> dict:
    """One fresh `gymv train` run in its own process (a run folder of that name from an earlier call is removed
    first, so its rows are never read as this run's); its metrics rows, whether it finished, and its wall time."""
    shutil.rmtree(out / name, ignore_errors=True)
    # the run's log tells each phase as it starts, with the seconds since launch: a step that never ends
    # still says how far it got
    code = ("import sys, time; from gymv.train import Reporter, train\n"
            "class PhaseLog(Reporter):\n"
            "    t0 = time.time()\n"
            "    def on_phase(self, step, name): print(f'[{time.time() - self.t0:7.1f} s] step {step}: {name}', flush=True)\n"
            "    def on_message(self, text): print(f'[{time.time() - self.t0:7.1f} s] {text}', flush=True)\n"
            "train(sys.argv[1], sys.argv[2:], reporter=PhaseLog())")
    args = [sys.executable, "-c", code, str(recipe), f"name={name}", f"checkpoint.dir={out}", *overrides]
    t0 = time.time()
    with open(out / f"{name}.log", "w") as log:
        proc = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            proc.wait(timeout=timeout_s)
            note = "" if proc.returncode == 0 else f"exit code {proc.returncode} (see {name}.log)"
        except subprocess.TimeoutExpired:  # the run and every process it started (Ray's too) go
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            note = f"stopped at the {timeout_s:.0f} s limit"
    metrics = out / name / "metrics.jsonl"
    rows = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()] if metrics.exists() else []
    return {"name": name, "rows": rows, "note": note, "wall_s": time.time() - t0, "run_dir": str(out / name)}


def series(rows: list[dict], key: str) -> list[tuple[int, float]]:
    return [(int(r.get("step", 0)), float(r[key])) for r in rows if key in r]


def summary(result: dict) -> dict:
    rows = result["rows"]
    steps = [r["timing/step_s"] for r in rows if "timing/step_s" in r]
    return {"name": result["name"], "note": result["note"], "wall_s": round(result["wall_s"], 1),
            "steps": max([int(r.get("step", 0)) for r in rows], default=0),
            "val_accuracy": series(rows, "val/accuracy"), "train_accuracy": series(rows, "train/accuracy"),
            "train_reward": series(rows, "train/reward_mean"), "turns_mean": series(rows, "train/turns_mean"),
            "step_s_median": statistics.median(steps) if steps else None,
            "token_mult_prob_error": [v for _, v in series(rows, "train/token_mult_prob_error")][-1:]}


def plot(path: Path, sft: dict, grpo: dict, offset: int) -> None:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    fig, ax = plt.subplots(figsize=(8, 4.5))
    for label, pts, shift, style in [("SFT held-out (greedy)", sft["val_accuracy"], 0, "o-"),
                                     ("GRPO held-out (greedy)", grpo["val_accuracy"], offset, "s-"),
                                     ("GRPO sampled (train)", grpo["train_accuracy"], offset, "-")]:
        if pts:
            ax.plot([s + shift for s, _ in pts], [v for _, v in pts], style, label=label, alpha=0.6 if style == "-" else 1)
    ax.axvline(offset, color="gray", lw=0.8, ls=":")
    ax.set_xlabel("step (SFT, then GRPO)")
    ax.set_ylabel("success (reached the goal)")
    ax.set_ylim(0, 1)
    ax.set_xlim(left=0)
    ax.legend()
    ax.set_title("doorkey (tiny preset) on one GPU")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--sft-steps", type=int, default=500)
    ap.add_argument("--sft-batch", type=int, default=32)
    ap.add_argument("--sft-lr", type=float, default=5e-4)
    ap.add_argument("--grpo-steps", type=int, default=60)
    ap.add_argument("--prompts", type=int, default=16, help="worlds per GRPO step (8 episodes each)")
    ap.add_argument("--lr", type=float, default=1e-4, help="GRPO learning rate")
    ap.add_argument("--val-period", type=int, default=10, help="GRPO steps between held-out validations")
    ap.add_argument("--val-prompts", type=int, default=64)
    ap.add_argument("--sft-timeout", type=float, default=200)
    ap.add_argument("--grpo-timeout", type=float, default=340)
    ap.add_argument("--cpu-smoke", action="store_true", help="a tiny model and a few steps on the CPU")
    a = ap.parse_args()
    from gymv.models.tiny import init_tiny_llava

    a.out.mkdir(parents=True, exist_ok=True)
    if a.cpu_smoke:
        a.hidden, a.layers, a.sft_steps, a.grpo_steps, a.prompts, a.val_period, a.val_prompts = 64, 1, 4, 2, 2, 1, 4
    knobs = dict(hidden=a.hidden, layers=a.layers, heads=max(4, a.hidden // 64), kv_heads=2,
                 intermediate=3 * a.hidden, vision_hidden=max(64, a.hidden // 2), vision_layers=2, vision_heads=4)
    model = init_tiny_llava(a.out / "model", force=True, **knobs)
    layout = CPU if a.cpu_smoke else GPU
    t0 = time.time()
    sft = run("doorkey-sft", SFT_RECIPE, layout + [
        f"model.path={model}", f"sft.max_steps={a.sft_steps}", f"sft.batch_size={a.sft_batch}",
        f"training.lr={a.sft_lr}", "training.warmup_steps=20", f"sft.val_period={max(1, a.sft_steps // 3)}", f"sft.val_prompts={a.val_prompts}",
        f"checkpoint.period={max(1, a.sft_steps // 5)}"], a.out, a.sft_timeout)
    print(json.dumps(summary(sft)), flush=True)
    grpo = run("doorkey-grpo", GRPO_RECIPE, layout + [
        f"model.path={sft['run_dir']}", f"grpo.max_steps={a.grpo_steps}", f"grpo.prompts_per_step={a.prompts}",
        f"training.lr={a.lr}", f"grpo.val_period={a.val_period}", f"grpo.val_prompts={a.val_prompts}",
        "grpo.val_at_start=true", f"checkpoint.period={a.grpo_steps}"], a.out, a.grpo_timeout)
    s, g = summary(sft), summary(grpo)
    print(json.dumps(g), flush=True)
    result = {"knobs": knobs, "args": {k: str(v) for k, v in vars(a).items()}, "sft": s, "grpo": g,
              "wall_s": time.time() - t0}
    (a.out / "doorkey.json").write_text(json.dumps(result, indent=1))
    plot(a.out / "doorkey.png", s, g, offset=max([r.get("step", 0) for r in sft["rows"]], default=0))
    print("\nrun | held-out success at each validation (step: value) | step s | note")
    for r in (s, g):
        vals = ", ".join(f"{st}: {v:.3f}" for st, v in r["val_accuracy"])
        step = f"{r['step_s_median']:.2f}" if r["step_s_median"] else "-"
        print(f"{r['name']} | {vals} | {step} | {r['note'] or 'finished'}")


if __name__ == "__main__":
    main()
