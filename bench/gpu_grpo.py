"""GRPO on GPUs: step time and tokens/s of `gymv train` with a locally built ~100M-parameter LLaVA-style VLM.

Runs the quickstart recipe on circle-count (NeMo Gym's default 1000x1000 images) in two layouts, side by side:
  separate   one GPU generating, one GPU training, refit broadcast over NCCL   (needs 2 GPUs)
  colocated  generation and training share each GPU, refit through CUDA IPC    (1 or more GPUs)
and prints a table of medians over the steps after the first (warm-up) one.

Each run also reports where generation's time goes (`timing/generation/*`, medians): environment calls,
rendering and tokenizing (image decoding included, and also on its own), parsing the model's turns, and
the backend's image encoding, prefill, first-call compile/capture of new shapes and decode loop; what is
left of `generation_s` is the driver's and Ray's.

Usage (on a GPU machine): python bench/gpu_grpo.py --out /tmp/gpu_grpo [--steps 8] [--layouts separate,colocated]
                          [--decode eager,auto]   (generation.decode: the HF loop against the static-cache decoder)
                          [--gpus 1]              (GPUs the runs may use: colocated runs on one)
       on a CPU, to check the script: python bench/gpu_grpo.py --cpu-smoke --out /tmp/gg --steps 2
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

RECIPE = str(Path(__file__).resolve().parents[1] / "recipes/vlm/vlm_grpo-tinyllava-1n0g-torch.yaml")
MODEL = dict(hidden=1024, layers=8, heads=16, kv_heads=4, intermediate=2816, vision_hidden=512, vision_layers=6,
             vision_heads=8, image_size=224, patch_size=14, vocab_size=1024)
BREAKDOWN = ["env_open_s", "render_s", "image_decode_s", "parse_s", "env_step_s", "env_verify_s", "backend_encode_s",
             "backend_prefill_s", "backend_capture_s", "backend_decode_s"]
SMOKE_MODEL = dict(hidden=64, layers=2, heads=4, kv_heads=2, intermediate=128, vision_hidden=32, vision_layers=1,
                   vision_heads=2, image_size=56, patch_size=14, vocab_size=1024)
MAIN = ["timing/step_s", "timing/generation_s", "timing/logprobs_s", "timing/training_s", "timing/refit_s",
        "timing/generation_tokens_per_s", "timing/tokens_per_s", "train/token_mult_prob_error", "train/reward_mean"]
COLUMNS = MAIN + [f"timing/generation/{k}" for k in BREAKDOWN]


def layouts(gpus: int) -> dict[str, list[str]]:
    common = ["cluster.num_nodes=1", f"cluster.gpus_per_node={gpus}", "training.dtype=bfloat16", "model.dtype=bfloat16"]
    return {
        "separate": common + ["cluster.colocated=false", "cluster.generation_gpus=1", "cluster.training_gpus=1",
                              "refit.transport=nccl"],
        "colocated": common + ["cluster.colocated=true", "refit.transport=cuda_ipc"],
        "cpu": ["cluster.num_nodes=1", "cluster.gpus_per_node=0", "training.dtype=float32", "model.dtype=float32"],
    }


def run(name: str, overrides: list[str], model_dir: Path, out: Path, steps: int, timeout_s: float = 1e9) -> dict:
    overrides = [f"name=gpu-{name}", f"checkpoint.dir={out}", f"model.path={model_dir}", f"grpo.max_steps={steps}",
                 "grpo.prompts_per_step=16", "grpo.generations_per_prompt=8", "generation.max_new_tokens=64",
                 "grpo.val_period=0", "env.preset=null", "data.prepare.n_train=256", "data.prepare.n_eval=16",
                 "checkpoint.period=1000", "training.micro_batch_tokens=16384", "model.max_seq_len=1024", *overrides]
    # the engine's own entry point, not the CLI: a tree on PYTHONPATH without an install has no CLI commands
    code = "import sys; from gymv.train import train; train(sys.argv[1], sys.argv[2:])"
    t0 = time.time()
    proc = subprocess.Popen([sys.executable, "-c", code, RECIPE, *overrides], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        _, err = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:  # the run and every process it started (Ray's too) go
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        err = f"killed after {timeout_s:.0f} s"
    wall = time.time() - t0
    metrics = out / f"gpu-{name}" / "metrics.jsonl"
    if proc.returncode != 0 and not (metrics.exists() and metrics.read_text().strip()):
        return {"layout": name, "error": (err.strip().splitlines() or ["?"])[-1], "wall_s": wall}
    rows_all = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()]
    rows = [r for r in rows_all if r.get("step", 0) >= 2] or rows_all
    med = {c: statistics.median([r[c] for r in rows if c in r]) for c in COLUMNS if any(c in r for r in rows)}
    first = {f"first_step/{c}": rows_all[0][c] for c in COLUMNS if c in rows_all[0]} if rows_all else {}
    done = {} if proc.returncode == 0 else {"note": f"stopped early: {(err.strip().splitlines() or ['?'])[-1]}"}
    return {"layout": name, "wall_s": wall, "steps": len(rows), **med, **first, **done}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--layouts", default="separate,colocated")
    ap.add_argument("--decode", default="auto", help="generation.decode values to run each layout with, e.g. eager,auto")
    ap.add_argument("--run-timeout", type=float, default=1e9, help="seconds before a run is killed (its steps so "
                    "far still count)")
    ap.add_argument("--gpus", type=int, default=0, help="GPUs the runs may use (0: every visible one)")
    ap.add_argument("--cpu-smoke", action="store_true", help="a tiny model on the CPU: checks this script, not speed")
    a = ap.parse_args()
    import torch

    from gymv.models.tiny import init_tiny_llava

    gpus = torch.cuda.device_count()
    if a.gpus:
        gpus = min(gpus, a.gpus)
    if a.cpu_smoke:
        a.layouts = "cpu"
    elif gpus == 0:
        sys.exit("no CUDA device: this benchmark needs a GPU")
    a.out.mkdir(parents=True, exist_ok=True)
    model_dir = init_tiny_llava(a.out / "model", force=True, **(SMOKE_MODEL if a.cpu_smoke else MODEL))
    n_params = sum(p.numel() for p in __import__("safetensors.torch", fromlist=["load_file"]).load_file(
        str(model_dir / "model.safetensors")).values())
    device = "cpu" if a.cpu_smoke else f"{torch.cuda.get_device_name(0)} x {gpus}"
    print(f"model: {n_params / 1e6:.1f}M parameters, {device}", flush=True)
    results = []
    for decode in a.decode.split(","):
        for name in a.layouts.split(","):
            label = name if decode == "auto" else f"{name}-{decode}"
            if name == "separate" and gpus < 2:
                results.append({"layout": label, "error": "needs 2 GPUs"})
                continue
            results.append(run(label, layouts(gpus)[name] + [f"generation.decode={decode}"], model_dir, a.out, a.steps,
                               a.run_timeout))
            print(json.dumps(results[-1]), flush=True)
            (a.out / "results.json").write_text(json.dumps({"params": n_params, "gpus": gpus, "device": device,
                                                            "results": results}, indent=2))
    head = ["layout", "step s", "gen s", "logp s", "train s", "refit s", "gen tok/s", "tok/s", "mult_prob_err"]
    print("\n" + " | ".join(head))
    for r in results:
        if "error" in r:
            print(f"{r['layout']} | error: {r['error']}")
            continue
        vals = [r.get(c) for c in MAIN[:-1]]
        print(" | ".join([r["layout"]] + [f"{v:.4g}" if isinstance(v, (int, float)) else "-" for v in vals]))
    print("\nwhere generation's time goes (s, medians; first step in brackets)")
    print(" | ".join(["layout", "generation", *BREAKDOWN]))
    for r in results:
        if "error" not in r:
            cells = [f"{r.get(c, 0):.3g} [{r.get('first_step/' + c, 0):.3g}]"
                     for c in ["timing/generation_s"] + [f"timing/generation/{k}" for k in BREAKDOWN]]
            print(" | ".join([r["layout"], *cells]))


if __name__ == "__main__":
    main()
