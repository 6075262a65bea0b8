"""Benchmark: GRPO on the tiny VLM, `gymv train` against TRL's `GRPOTrainer`, side by side on this CPU.

Both train the same checkpoint on the same rows in the same order (circle-count `tiny`, 128 rows from
`gymv prepare`, no shuffling), with the same prompts per step, group size, completion limit, sampling
(temperature 1.0, top-p 1.0), learning rate (1e-4, constant), clipping (0.2), token-mean loss, no KL and no
reference model, one optimizer step per step, fp32, two torch threads and OMP_WAIT_POLICY=PASSIVE. TRL's
reward function is gymv's circle-count verifier (`CircleCount.score_output`) on each completion's text.

The checkpoint is a tiny LLaVA from `gymv model init tiny-llava` (`random` configs), or that model after
100 SFT steps of 8 rows at lr 1e-3 on the same rows (`sft` configs): its sampled completions are short
`\\boxed{N}<|im_end|>` answers with mixed rewards, as a warm-started policy's are, where random weights
write until the limit and score 0.

TRL comes from PyPI in its own virtual environment (bench/.venv-trl, made on first use with
`pip install torch==2.13.0 trl transformers pillow`; torch stays pinned to the local CPU wheel); this script
re-runs itself there with `--trl-worker`. Runs alternate (gymv, TRL, TRL, gymv, ...) so that load from other
work on the machine falls on both alike.

Throughput is steady state: the wall time from the end of step 1 to the end of step N (gymv: the
`wall_time` of its metrics.jsonl rows; TRL: a `TrainerCallback.on_step_end`), so start-up, model loading
and the first step's warm-up count for neither; samples/s = (N - 1) x prompts x generations / that time.
Per config, the medians over the runs of each framework are compared. Target: gymv >= 2x TRL's samples/s.

    .venv/bin/python bench/grpo_vs_trl.py [--configs 4x4-sft,8x8-random] [--repeats 3] [--steps N] [--json]
    .venv/bin/python bench/grpo_vs_trl.py --gymv-only [--configs ...]   # gymv alone: A/B of gymv changes

`--device cuda` (one GPU; both frameworks in the running Python, no virtual environments): a ~0.8B LLaVA-shaped
VLM built locally (`gymv.models.tiny` at hidden 2048, 16 layers, a 4-layer 224-pixel CLIP tower; random
weights, so every completion runs to the token limit in both frameworks and the work per step is the same),
circle-count rows at NeMo Gym's default 1000x1000, bf16 compute with float32 master weights in both. gymv runs
its colocated layout (generation and training on the one GPU, CUDA-IPC refit, the static-cache decoder, fsdp2
with packed rows); TRL's `GRPOTrainer` generates with transformers (`generation_kwargs`: dynamic and static
cache are both run, the faster one is TRL's figure), since vLLM's GPU wheel cannot be installed beside this
torch. Steps 2..N timed as above.

    python bench/grpo_vs_trl.py --device cuda [--configs cuda-16x8] [--repeats 1] [--steps 6]
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
TRL_VENV = ROOT / "bench" / ".venv-trl"
TRL_PACKAGES = ["torch==2.13.0", "trl", "transformers", "pillow"]  # an unpinned torch pulls a CUDA build
RECIPE = "recipes/vlm/vlm_grpo-tinyllava-1n0g-torch.yaml"
SFT_RECIPE = "recipes/vlm/vlm_sft-tinyllava-1n0g-torch.yaml"
RESULTS = ROOT / "bench" / "results" / "grpo_vs_trl.json"
TARGET = 2.0
THREADS = 2
LR = 1.0e-4
SEED = 42


# ---------------------------------------------------------------------------------------------------------------
# shared: what both runs are given
# ---------------------------------------------------------------------------------------------------------------

def bench_env() -> dict:
    env = dict(os.environ, OMP_WAIT_POLICY="PASSIVE", OMP_NUM_THREADS=str(THREADS), PYTHONUNBUFFERED="1")
    env.pop("RAY_ADDRESS", None)
    return env


def run(cmd: list[str], *, log: Path, env: dict | None = None) -> None:
    with log.open("w") as fh:
        proc = subprocess.run(cmd, cwd=ROOT, env=env or bench_env(), stdout=fh, stderr=subprocess.STDOUT)
    if proc.returncode != 0:
        raise SystemExit(f"command failed ({proc.returncode}): {' '.join(cmd)}\n"
                         f"--- last lines of {log} ---\n{log.read_text()[-3000:]}")


def steady_state(step_ends: dict[int, float], steps: int, samples_per_step: int) -> dict:
    """Throughput over steps 2..N from the wall-clock end of each step."""
    missing = [s for s in range(1, steps + 1) if s not in step_ends]
    if missing:
        raise SystemExit(f"no end time logged for step(s) {missing}")
    seconds = step_ends[steps] - step_ends[1]
    timed = steps - 1
    return {"steady_s": round(seconds, 3), "steps_timed": timed,
            "step_s": round(seconds / timed, 4),
            "steps_per_min": round(60.0 * timed / seconds, 2),
            "samples_per_s": round(timed * samples_per_step / seconds, 2)}


def ensure_trl_venv() -> Path:
    python = TRL_VENV / "bin" / "python"
    probe = [str(python), "-c", "import trl, transformers, torch, PIL"]
    if python.exists() and subprocess.run(probe, capture_output=True).returncode == 0:
        return python
    print(f"making {TRL_VENV}: pip install {' '.join(TRL_PACKAGES)}", file=sys.stderr)
    base = getattr(sys, "_base_executable", None) or sys.executable
    subprocess.run([base, "-m", "venv", str(TRL_VENV)], check=True)
    subprocess.run([str(python), "-m", "pip", "install", "-q", *TRL_PACKAGES], check=True)
    return python


def package_versions(python: Path, names: list[str]) -> dict:
    """Installed versions of `names` in `python` (None for one not installed)."""
    code = ("import importlib.metadata as m, json, sys\n"
            "def v(n):\n"
            "    try: return m.version(n)\n"
            "    except m.PackageNotFoundError: return None\n"
            "print(json.dumps({n: v(n) for n in sys.argv[1:]}))")
    out = subprocess.run([str(python), "-c", code, *names], capture_output=True, text=True, check=True)
    return json.loads(out.stdout)


def prepare(work: Path, init: str) -> tuple[Path, Path]:
    """The checkpoint and the rows, made once and reused by every run."""
    gymv = str(ROOT / ".venv" / "bin" / "gymv")
    work.mkdir(parents=True, exist_ok=True)
    rows = work / "train.jsonl"
    if not rows.exists():
        run([gymv, "prepare", "circle-count", "--preset", "tiny", "--n", "128", "--out", str(rows)],
            log=work / "prepare.log")
    base = work / "model-init"
    if not base.exists():
        run([gymv, "model", "init", "tiny-llava", str(base)], log=work / "model-init.log")
    if init == "random":
        return base, rows
    sft = work / "sft-warm" / "final"
    if not sft.exists():
        print("warm start: SFT of the tiny model on the bench rows (100 steps of 8 at lr 1e-3)", file=sys.stderr)
        run([gymv, "train", SFT_RECIPE, f"model.path={base}", f"checkpoint.dir={work}", "name=sft-warm",
             f"data.train={rows}", f"data.eval={rows}", "data.prepare=null", "sft.batch_size=8",
             "sft.max_steps=100", "training.lr=1.0e-3", "training.warmup_steps=0", "sft.val_period=100", "sft.val_prompts=16",
             "checkpoint.period=100", "checkpoint.resume=false"], log=work / "sft.log")
    return sft, rows


# ---------------------------------------------------------------------------------------------------------------
# gymv
# ---------------------------------------------------------------------------------------------------------------

def run_gymv(work: Path, model: Path, rows: Path, args: argparse.Namespace, tag: str, extra: list[str] = ()) -> dict:
    """`extra`: more overrides, last (another bench's variations of this run)."""
    name = f"gymv-{tag}"
    run_dir = work / name
    if run_dir.exists():
        shutil.rmtree(run_dir)
    overrides = [
        f"model.path={model}", f"data.train={rows}", f"data.eval={rows}", "data.shuffle=false",
        f"grpo.prompts_per_step={args.prompts}", f"grpo.generations_per_prompt={args.generations}",
        f"generation.max_new_tokens={args.max_new_tokens}", "generation.temperature=1.0", "generation.top_p=1.0",
        "grpo.val_period=0", "grpo.val_at_start=false", f"grpo.max_steps={args.steps}",
        "grpo.loss.kl_coef=0.0", "grpo.loss.clip_low=0.2", "grpo.loss.clip_high=0.2",
        "grpo.loss.aggregation=token_mean", f"training.lr={LR}", "training.warmup_steps=0",
        "training.max_grad_norm=1.0", "training.dtype=float32", "training.gradient_checkpointing=false",
        f"checkpoint.period={args.steps}", "checkpoint.resume=false", f"checkpoint.dir={work}", f"name={name}",
        f"seed={SEED}", *extra,
    ]
    t0 = time.time()
    run([str(ROOT / ".venv" / "bin" / "gymv"), "train", RECIPE, *overrides, "--json"], log=work / f"{name}.log")
    wall = time.time() - t0
    metrics = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    metrics = [m for m in metrics if m["step"] >= 1]
    ends = {m["step"]: m["wall_time"] for m in metrics}
    tail = [m for m in metrics if m["step"] >= 2]
    return {
        **steady_state(ends, args.steps, args.prompts * args.generations),
        "process_wall_s": round(wall, 1),
        "reward_mean": round(statistics.mean(m["train/reward_mean"] for m in metrics), 3),
        "completion_tokens_mean": round(statistics.mean(m["train/gen_length_mean"] for m in metrics), 2),
        "median_generation_s": round(statistics.median(m["timing/generation_s"] for m in tail), 4),
        "median_training_s": round(statistics.median(m["timing/training_s"] for m in tail), 4),
        "median_refit_s": round(statistics.median(m["timing/refit_s"] for m in tail), 4),
    }


# ---------------------------------------------------------------------------------------------------------------
# TRL (runs inside bench/.venv-trl; gymv's engine is imported from the source tree for the verifier only)
# ---------------------------------------------------------------------------------------------------------------

def trl_dataset(rows_path: Path):
    """gymv rows -> TRL's conversational VLM format: `prompt` messages, one `image`, the row for the verifier."""
    from datasets import Dataset

    from gymv.data.images import decode_data_url

    records = []
    for n, line in enumerate(rows_path.read_text().splitlines(), 1):
        row = json.loads(line)
        where = f"{rows_path} line {n}"
        prompt, images = [], []
        for msg in row["responses_create_params"]["input"]:
            content = msg["content"]
            if isinstance(content, str):
                prompt.append({"role": msg["role"], "content": content})
                continue
            texts = []
            for part in content:
                if part["type"] in ("input_image", "image_url", "image"):
                    if texts or msg["role"] != "user":
                        raise SystemExit(f"{where}: TRL puts a row's image before the first user text; "
                                         "this row has it elsewhere")
                    images.append(decode_data_url(part["image_url"], where=where))
                else:
                    texts.append(part["text"])
            prompt.append({"role": msg["role"], "content": "".join(texts)})
        if len(images) != 1:
            raise SystemExit(f"{where}: expected one image, found {len(images)}")
        records.append({"prompt": prompt, "image": images[0], "gymv_row": line})
    return Dataset.from_list(records)


def circle_count_reward():
    from gymv.envs.circle_count import CircleCount

    env = CircleCount()

    def circle_count(prompts, completions, gymv_row, **_):
        rewards = []
        for completion, row in zip(completions, gymv_row, strict=True):
            text = completion[-1]["content"] if isinstance(completion, list) else completion
            if isinstance(text, list):  # structured content blocks
                text = "".join(p.get("text", "") for p in text if isinstance(p, dict))
            output = [{"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": text}]}]
            rewards.append(env.score_output(json.loads(row), output).reward)
        return rewards

    return circle_count


def trl_worker(spec_path: Path) -> None:
    import torch

    spec = json.loads(spec_path.read_text())
    cuda = spec.get("device") == "cuda"
    if not cuda:
        torch.set_num_threads(THREADS)
    from transformers import AutoProcessor, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    P, G = spec["prompts"], spec["generations"]
    accumulation = 4 if cuda else 1
    step_ends: dict[int, float] = {}
    rows: list[dict] = []

    class StepClock(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            step_ends[state.global_step] = time.time()

        def on_log(self, args, state, control, logs=None, **kwargs):
            if logs and "reward" in logs:
                rows.append({"step": state.global_step,
                             **{k: v for k, v in logs.items() if isinstance(v, (int, float))}})

    config = GRPOConfig(
        output_dir=spec["output_dir"], use_cpu=not cuda, bf16=cuda, fp16=False, seed=SEED,
        # on a GPU four micro-batches of 32 (one generation of P x G, one optimizer step): 128 rows of a 0.8B
        # model in one forward would hold ~80 GB of activations
        per_device_train_batch_size=P * G // accumulation, gradient_accumulation_steps=accumulation,
        steps_per_generation=accumulation,
        num_generations=G, num_iterations=1, max_completion_length=spec["max_new_tokens"],
        temperature=1.0, top_p=1.0, top_k=0, beta=0.0, epsilon=0.2, loss_type="dapo",
        learning_rate=LR, lr_scheduler_type="constant", warmup_steps=0, weight_decay=0.0, max_grad_norm=1.0,
        max_steps=spec["steps"], shuffle_dataset=False, gradient_checkpointing=False,
        logging_steps=1, save_strategy="no", report_to="none", dataloader_num_workers=0,
        disable_tqdm=True, model_init_kwargs={"dtype": "float32"},
        **({"cache_implementation": spec["cache"]} if spec.get("cache") else {}),
    )
    processor = AutoProcessor.from_pretrained(spec["model"], padding_side="left")
    trainer = GRPOTrainer(model=spec["model"], reward_funcs=circle_count_reward(), args=config,
                          train_dataset=trl_dataset(Path(spec["rows"])), processing_class=processor,
                          callbacks=[StepClock()])
    generate = trainer._generate_and_score_completions  # timed like gymv's timing/generation_s (sampling + rewards)
    generation_s: list[float] = []

    def timed_generate(*a, **kw):
        t0 = time.perf_counter()
        try:
            return generate(*a, **kw)
        finally:
            generation_s.append(time.perf_counter() - t0)

    trainer._generate_and_score_completions = timed_generate
    trainer.train()
    out = {"step_ends": step_ends, "logs": rows, "generation_s": generation_s, "threads": torch.get_num_threads(),
           "model_class": type(trainer.model).__name__, "processor_class": type(processor).__name__,
           "attn_implementation": trainer.model.config._attn_implementation,
           "activation_checkpointing": bool(trainer.args.activation_checkpointing)}
    Path(spec["result"]).write_text(json.dumps(out))


def run_trl(python: Path, work: Path, model: Path, rows: Path, args: argparse.Namespace, tag: str,
            device: str = "cpu", cache: str | None = None) -> dict:
    name = f"trl-{tag}"
    spec = {"model": str(model), "rows": str(rows), "prompts": args.prompts, "generations": args.generations,
            "max_new_tokens": args.max_new_tokens, "steps": args.steps, "output_dir": str(work / name),
            "result": str(work / f"{name}.json"), "device": device, "cache": cache}
    spec_path = work / f"{name}.spec.json"
    spec_path.write_text(json.dumps(spec))
    env = bench_env()
    if device == "cuda":  # the running Python (its PYTHONPATH too), all host threads
        env.pop("OMP_NUM_THREADS", None)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), *([env["PYTHONPATH"]] if env.get("PYTHONPATH") else [])])
    t0 = time.time()
    run([str(python), str(Path(__file__).resolve()), "--trl-worker", str(spec_path)], log=work / f"{name}.log",
        env=env)
    wall = time.time() - t0
    res = json.loads(Path(spec["result"]).read_text())
    ends = {int(k): v for k, v in res["step_ends"].items()}
    logs = res["logs"]
    return {
        **steady_state(ends, args.steps, args.prompts * args.generations),
        "process_wall_s": round(wall, 1),
        "reward_mean": round(statistics.mean(r["reward"] for r in logs), 3) if logs else None,
        "completion_tokens_mean": (round(statistics.mean(r["completions/mean_length"] for r in logs), 2)
                                   if logs and "completions/mean_length" in logs[0] else None),
        "median_generation_s": round(statistics.median(res["generation_s"][1:]), 4),
        **{k: res[k] for k in ("threads", "model_class", "processor_class", "attn_implementation",
                               "activation_checkpointing")},
        "cache_implementation": cache,
    }


# ---------------------------------------------------------------------------------------------------------------
# driver
# ---------------------------------------------------------------------------------------------------------------

# name: (init, prompts per step, generations per prompt, max new tokens, steps per run)
CONFIGS = {
    "4x4-sft": ("sft", 4, 4, 16, 20),         # 16 samples per step, short answers of a warm-started policy
    "4x4-random": ("random", 4, 4, 16, 20),   # same batch, random weights: every completion runs to the limit
    "8x8-sft": ("sft", 8, 8, 64, 10),         # 64 samples per step (the quickstart GRPO recipe's batch), short answers
    "8x8-random": ("random", 8, 8, 64, 10),   # 64 samples per step, completions of 64 tokens
}


def median_of(runs: list[dict]) -> dict:
    out = dict(runs[0])
    for k, v in runs[0].items():
        if isinstance(v, (int, float)) and not isinstance(v, bool):
            out[k] = round(statistics.median(r[k] for r in runs), 4)
    out["rest_s"] = round(out["step_s"] - out["median_generation_s"], 4)
    return out


def bench_config(name: str, python: Path | None, work: Path, repeats: int, steps: int | None, loads: list) -> dict:
    """Both frameworks, alternating; gymv alone when `python` (TRL's environment) is None."""
    init, prompts, generations, max_new_tokens, default_steps = CONFIGS[name]
    cfg = argparse.Namespace(prompts=prompts, generations=generations, max_new_tokens=max_new_tokens,
                             steps=steps or default_steps)
    model, rows = prepare(work, init)
    runs: dict[str, list[dict]] = {"gymv": [], "trl": []}
    for i in range(repeats):
        order = ("gymv", "trl") if i % 2 == 0 else ("trl", "gymv")
        for which in (order if python is not None else ("gymv",)):
            before = os.getloadavg()[0]
            tag = f"{name}-{i}"
            r = run_gymv(work, model, rows, cfg, tag) if which == "gymv" else run_trl(python, work, model, rows, cfg, tag)
            r["load_before"], r["load_after"] = round(before, 2), round(os.getloadavg()[0], 2)
            loads += [r["load_before"], r["load_after"]]
            runs[which].append(r)
            print(f"{name} {which} run {i}: {r['samples_per_s']:.1f} samples/s, {r['steps_per_min']:.1f} steps/min "
                  f"(load {r['load_before']:.1f} -> {r['load_after']:.1f})", file=sys.stderr)
    if python is None:
        g = median_of(runs["gymv"])
        g["other_s"] = round(g["rest_s"] - g["median_training_s"] - g["median_refit_s"], 4)
        return {"name": name, "setup": {"init": init, "prompts_per_step": prompts, "generations_per_prompt": generations,
                                        "samples_per_step": prompts * generations, "max_new_tokens": max_new_tokens,
                                        "steps": cfg.steps, "repeats": repeats},
                "gymv": {"median": g, "runs": runs["gymv"]}}
    g, t = median_of(runs["gymv"]), median_of(runs["trl"])
    pairs = [a["samples_per_s"] / b["samples_per_s"] for a, b in zip(runs["gymv"], runs["trl"])]
    ratio = round(g["samples_per_s"] / t["samples_per_s"], 2)
    return {
        "name": name,
        "setup": {"init": init, "model": str(model.relative_to(ROOT)) if model.is_relative_to(ROOT) else str(model),
                  "prompts_per_step": prompts, "generations_per_prompt": generations,
                  "samples_per_step": prompts * generations, "max_new_tokens": max_new_tokens, "steps": cfg.steps,
                  "repeats": repeats},
        "gymv": {"median": g, "runs": runs["gymv"]},
        "trl": {"median": t, "runs": runs["trl"]},
        "ratio_samples_per_s": ratio,
        "ratio_per_pair": [round(x, 2) for x in pairs],
        "pass": ratio >= TARGET,
    }


def print_table(res: dict) -> None:
    s, g, t = res["setup"], res["gymv"]["median"], res["trl"]["median"]
    loads = [r[k] for x in ("gymv", "trl") for r in res[x]["runs"] for k in ("load_before", "load_after")]
    print(f"\n{res['name']}: {s['init']} init, {s['prompts_per_step']} prompts x {s['generations_per_prompt']} "
          f"generations, <= {s['max_new_tokens']} new tokens, steps 2..{s['steps']} timed, median of {s['repeats']} "
          f"runs each, load {min(loads):.1f}-{max(loads):.1f}")
    print(f"{'':<24} {'gymv':>10} {'TRL':>10}")
    rows_out = [("samples/s", "samples_per_s", "{:.1f}"), ("steps/min", "steps_per_min", "{:.1f}"),
                ("s/step", "step_s", "{:.3f}"), ("  generation + reward", "median_generation_s", "{:.3f}"),
                ("  training and the rest", "rest_s", "{:.3f}"),
                ("completion tokens", "completion_tokens_mean", "{:.1f}"), ("reward mean", "reward_mean", "{:.3f}"),
                ("process wall s", "process_wall_s", "{:.1f}")]
    for label, key, fmt in rows_out:
        cells = [fmt.format(x[key]) if x.get(key) is not None else "-" for x in (g, t)]
        print(f"{label:<24} {cells[0]:>10} {cells[1]:>10}")
    print(f"ratio (gymv samples/s over TRL's): {res['ratio_samples_per_s']:.2f}x  (run pairs: "
          f"{', '.join(f'{x:.2f}' for x in res['ratio_per_pair'])}; target {TARGET:.0f}x: "
          f"{'PASS' if res['pass'] else 'FAIL'})")


def gymv_only(args: argparse.Namespace, names: list[str], work: Path) -> None:
    loads: list[float] = []
    configs = [bench_config(n, None, work, args.repeats, args.steps, loads) for n in names]
    out = args.out if args.out != RESULTS else RESULTS.with_name("gymv_only.json")
    result = {"started": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
              "load_average_1min": {"min": round(min(loads), 2), "max": round(max(loads), 2),
                                    "mean": round(statistics.mean(loads), 2)},
              "versions": {"gymv_env": package_versions(ROOT / ".venv" / "bin" / "python",
                                                        ["torch", "transformers", "ray"])},
              "configs": configs}
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(result, indent=2) + "\n")
    tmp.replace(out)
    if args.json:
        print(json.dumps(result, indent=2))
        return
    print(f"gymv alone, load average {result['load_average_1min']['min']:.1f}-{result['load_average_1min']['max']:.1f}"
          f"; medians of {args.repeats} runs, seconds per step")
    print(f"{'config':<12} {'samples/s':>10} {'step':>7} {'gen+reward':>11} {'training':>9} {'refit':>7} {'other':>7}")
    for c in configs:
        g = c["gymv"]["median"]
        print(f"{c['name']:<12} {g['samples_per_s']:>10.1f} {g['step_s']:>7.3f} {g['median_generation_s']:>11.3f} "
              f"{g['median_training_s']:>9.3f} {g['median_refit_s']:>7.3f} {g['other_s']:>7.3f}")
    print(f"-> {out}")


# ---------------------------------------------------------------------------------------------------------------
# one GPU: both frameworks in this Python
# ---------------------------------------------------------------------------------------------------------------

CUDA_MODEL = dict(hidden=2048, layers=16, heads=16, kv_heads=8, intermediate=5632, vision_hidden=256, vision_layers=4,
                  vision_heads=4, image_size=224, patch_size=14, vocab_size=1024)
CUDA_CONFIGS = {"cuda-16x8": (16, 8, 128, 6)}  # prompts, generations, max new tokens, steps
CUDA_LAYOUT = ["cluster.num_nodes=1", "cluster.gpus_per_node=1", "cluster.colocated=true", "refit.transport=cuda_ipc",
               "training.dtype=bfloat16", "model.dtype=bfloat16", "training.backend=fsdp2",
               "training.sequence_packing=true", "training.micro_batch_tokens=32768", "model.max_seq_len=2048"]


def prepare_cuda(work: Path) -> tuple[Path, Path]:
    from gymv.data.generate import write_dataset
    from gymv.envs import get_env
    from gymv.envs.knobs import resolve_knobs
    from gymv.models.tiny import init_tiny_llava

    work.mkdir(parents=True, exist_ok=True)
    rows = work / "train-cuda.jsonl"
    if not rows.exists():
        env = get_env("circle-count")
        write_dataset(rows, env, resolve_knobs(env, "default", []), n=256, seed=SEED)
    model = init_tiny_llava(work / "model-cuda", reuse=True, **CUDA_MODEL)
    return model, rows


def run_gymv_cuda(work: Path, model: Path, rows: Path, cfg: argparse.Namespace, tag: str,
                  extra: list[str] = ()) -> dict:
    name = f"gymv-{tag}"
    if (work / name).exists():
        shutil.rmtree(work / name)
    overrides = [
        f"model.path={model}", f"data.train={rows}", f"data.eval={rows}", "data.shuffle=false", "data.prepare=null",
        f"grpo.prompts_per_step={cfg.prompts}", f"grpo.generations_per_prompt={cfg.generations}",
        f"generation.max_new_tokens={cfg.max_new_tokens}", "generation.temperature=1.0", "generation.top_p=1.0",
        "grpo.val_period=0", "grpo.val_at_start=false", f"grpo.max_steps={cfg.steps}", "grpo.loss.kl_coef=0.0",
        "grpo.loss.clip_low=0.2", "grpo.loss.clip_high=0.2", "grpo.loss.aggregation=token_mean", f"training.lr={LR}",
        "training.warmup_steps=0", "training.max_grad_norm=1.0", "training.gradient_checkpointing=false",
        f"checkpoint.period={cfg.steps}", "checkpoint.resume=false", f"checkpoint.dir={work}", f"name={name}",
        f"seed={SEED}", "env.preset=null", *CUDA_LAYOUT, *extra]
    code = "import sys; from gymv.train import train; train(sys.argv[1], sys.argv[2:])"
    env = bench_env()
    env.pop("OMP_NUM_THREADS", None)
    t0 = time.time()
    run([sys.executable, "-c", code, str(ROOT / RECIPE), *overrides], log=work / f"{name}.log", env=env)
    wall = time.time() - t0
    metrics = [json.loads(line) for line in (work / name / "metrics.jsonl").read_text().splitlines() if line.strip()]
    metrics = [m for m in metrics if m["step"] >= 1]
    tail = [m for m in metrics if m["step"] >= 2]
    out = {**steady_state({m["step"]: m["wall_time"] for m in metrics}, cfg.steps, cfg.prompts * cfg.generations),
           "process_wall_s": round(wall, 1),
           "completion_tokens_mean": round(statistics.mean(m["train/gen_length_mean"] for m in metrics), 2),
           "reward_mean": round(statistics.mean(m["train/reward_mean"] for m in metrics), 3),
           "median_generation_s": round(statistics.median(m["timing/generation_s"] for m in tail), 4)}
    for k in ("timing/training_s", "timing/logprobs_s", "timing/refit_s", "train/token_mult_prob_error"):
        if all(k in m for m in tail):
            out["median_" + k.split("/")[-1]] = round(statistics.median(m[k] for m in tail), 4)
    # where generation's time goes, timed steps (medians) and the first step apart (compile, graph capture)
    parts = sorted(k for k in metrics[0] if k.startswith("timing/generation/"))
    out["generation_split"] = {k.split("/")[-1]: round(statistics.median(m.get(k, 0.0) for m in tail), 4) for k in parts}
    out["first_step_generation_split"] = {k.split("/")[-1]: round(metrics[0][k], 4) for k in parts}
    # what the run warned about (a decoder that fell back to uncompiled or eager steps, memory), verbatim
    log = (work / f"{name}.log").read_text(errors="replace").splitlines()
    out["warnings"] = [line.strip()[:300] for line in log if "Warning" in line or "out of memory" in line][:20]
    return out


def bench_cuda(args: argparse.Namespace, work: Path) -> None:
    import torch

    if not torch.cuda.is_available():
        sys.exit("--device cuda: no CUDA device")
    results = {"started": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "device": torch.cuda.get_device_name(0),
               "versions": package_versions(Path(sys.executable), ["torch", "transformers", "trl", "ray"]),
               "model": CUDA_MODEL, "layout": CUDA_LAYOUT, "configs": []}
    model, rows = prepare_cuda(work)
    for name in args.configs.split(","):
        prompts, generations, max_new_tokens, steps = CUDA_CONFIGS[name]
        cfg = argparse.Namespace(prompts=prompts, generations=generations, max_new_tokens=max_new_tokens,
                                 steps=args.steps or steps)
        runs: dict[str, list[dict]] = {}
        for i in range(args.repeats):
            frameworks = (("gymv", None),) if args.gymv_only else \
                (("gymv", None), ("trl-dynamic", None), ("trl-static", "static"))
            for which, cache in frameworks:
                tag = f"{name}-{which}-{i}"
                try:
                    r = run_gymv_cuda(work, model, rows, cfg, tag) if which == "gymv" else \
                        run_trl(Path(sys.executable), work, model, rows, cfg, tag, device="cuda", cache=cache)
                except SystemExit as e:  # a failed run is reported, the others go on
                    r = {"error": str(e)[-2000:]}
                runs.setdefault(which, []).append(r)
                print(f"{name} {which} run {i}: " + (f"{r['samples_per_s']:.1f} samples/s" if "error" not in r
                                                     else r["error"][-300:]), file=sys.stderr, flush=True)
        medians = {k: median_of(v) for k, v in runs.items() if all("error" not in r for r in v)}
        trl = max((v for k, v in medians.items() if k.startswith("trl")), key=lambda m: m["samples_per_s"], default=None)
        entry = {"name": name, "setup": vars(cfg), "runs": runs, "medians": medians}
        if trl is not None and "gymv" in medians:
            entry["ratio_samples_per_s"] = round(medians["gymv"]["samples_per_s"] / trl["samples_per_s"], 2)
        results["configs"].append(entry)
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(results, indent=2) + "\n")
        print(f"\n{name}: {prompts} prompts x {generations} generations, {max_new_tokens} new tokens, steps 2..{cfg.steps}")
        print(f"{'':<22}" + "".join(f"{k:>14}" for k in medians))
        for label, key in (("samples/s", "samples_per_s"), ("s/step", "step_s"),
                           ("generation s", "median_generation_s"), ("completion tokens", "completion_tokens_mean")):
            print(f"{label:<22}" + "".join(f"{m.get(key, float('nan')):>14.3f}" for m in medians.values()))
        if "ratio_samples_per_s" in entry:
            print(f"gymv over TRL's faster path: {entry['ratio_samples_per_s']:.2f}x samples/s")
        split = medians.get("gymv", {}).get("generation_split")
        if split:  # the first step's in brackets: compile and graph capture land there
            first = medians["gymv"]["first_step_generation_split"]
            print("gymv generation, s: " + ", ".join(f"{k} {v:.3f} [{first.get(k, 0):.3f}]" for k, v in split.items()))
        for line in medians.get("gymv", {}).get("warnings", []):
            print(f"gymv warned: {line}")
    print(f"-> {args.out}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--configs", default=",".join(CONFIGS),
                    help=f"comma-separated, from: {', '.join(CONFIGS)} (default: all)")
    ap.add_argument("--repeats", type=int, default=3, help="runs of each framework per config, alternating")
    ap.add_argument("--steps", type=int, help="GRPO steps per run (default: the config's; steps 2..N are timed)")
    ap.add_argument("--work", type=Path, default=ROOT / "runs" / "bench-grpo-vs-trl", help="scratch folder")
    ap.add_argument("--out", type=Path, default=RESULTS, help="results JSON")
    ap.add_argument("--json", action="store_true", help="print the result as JSON")
    ap.add_argument("--gymv-only", action="store_true",
                    help="run gymv alone (no TRL environment): its samples/s and per-step split, for A/B comparisons "
                         "of gymv changes; results go to bench/results/gymv_only.json unless --out is given")
    ap.add_argument("--device", choices=["cpu", "cuda"], default="cpu",
                    help="cuda: one GPU, a ~0.8B VLM, both frameworks in this Python (see the module doc)")
    ap.add_argument("--trl-worker", type=Path, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.trl_worker:
        trl_worker(args.trl_worker)
        return
    if args.device == "cuda":
        if args.configs == ",".join(CONFIGS):
            args.configs = ",".join(CUDA_CONFIGS)
        if args.out == RESULTS:
            args.out = RESULTS.with_name("gymv_only_cuda.json" if args.gymv_only else "grpo_vs_trl_cuda.json")
        bench_cuda(args, args.work.resolve())
        return
    names = [n.strip() for n in args.configs.split(",") if n.strip()]
    unknown = [n for n in names if n not in CONFIGS]
    if unknown:
        ap.error(f"unknown config(s) {unknown}; choose from {list(CONFIGS)}")
    if args.steps is not None and args.steps < 3:
        ap.error("--steps must be at least 3 (step 1 is warm-up)")

    work = args.work.resolve()
    if args.gymv_only:
        gymv_only(args, names, work)
        return
    python = ensure_trl_venv()
    loads: list[float] = []
    started = time.strftime("%Y-%m-%dT%H:%M:%S%z")
    configs = [bench_config(n, python, work, args.repeats, args.steps, loads) for n in names]
    result = {
        "started": started,
        "common": {"rows": "circle-count tiny preset, 128 rows from `gymv prepare`, file order", "temperature": 1.0,
                   "top_p": 1.0, "lr": LR, "kl": 0.0, "clip": 0.2, "loss": "token mean (gymv token_mean, TRL dapo)",
                   "optimizer_steps_per_step": 1, "dtype": "float32", "torch_threads": THREADS,
                   "OMP_WAIT_POLICY": "PASSIVE", "cores": len(os.sched_getaffinity(0)),
                   "timed": "wall time from the end of step 1 to the end of step N"},
        "versions": {"gymv_env": package_versions(ROOT / ".venv" / "bin" / "python", ["torch", "transformers", "ray"]),
                     "trl_env": package_versions(python, ["trl", "torch", "transformers", "accelerate"])},
        "load_average_1min": {"min": round(min(loads), 2), "max": round(max(loads), 2),
                              "mean": round(statistics.mean(loads), 2)},
        "target": TARGET,
        "configs": configs,
        "ratios": {c["name"]: c["ratio_samples_per_s"] for c in configs},
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    tmp = args.out.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(result, indent=2) + "\n")
    tmp.replace(args.out)

    if args.json:
        print(json.dumps(result, indent=2))
        return
    print(f"GRPO, gymv vs TRL {result['versions']['trl_env']['trl']} on tiny-llava, {result['common']['cores']} cores "
          f"(load average {result['load_average_1min']['min']:.1f}-{result['load_average_1min']['max']:.1f})")
    for c in configs:
        print_table(c)
    print("\nsummary (gymv samples/s over TRL's): "
          + ", ".join(f"{c['name']} {c['ratio_samples_per_s']:.2f}x" for c in configs) + f"  -> {args.out}")


if __name__ == "__main__":
    main()
