"""What a refit check costs, against the peer approach, and as a share of a GRPO step.

1. Digests (`--part digest`): the weights of a model shape (synthetic tensors of its layers' shapes, bf16, on
   the device) fingerprinted the way both sides of gymv's `digest` check do (gymv.backends.weights.tensor_digest,
   on the tensor's own device), beside the peer approach: a per-tensor SHA-256 of each tensor copied to host
   memory (the checker proposed for vLLM's weight updates; slime's check compares snapshots the same way).
2. A GRPO step (`--part grpo`): `gymv train` with `refit.check.mode: off`, the default schedule (every refit up
   to the 3rd, then every 10th) and every refit checked (`first` = the run's steps): the refit phase's median
   seconds and the step's, steps 2..N. The default's cost per step over a long run is the per-check cost
   (every-refit minus off) times the share of refits it checks (13 of 100), divided by the step.

    .venv/bin/python bench/refit_check.py                          # CPU: tiny shapes, the tiny LLaVA GRPO step
    python bench/refit_check.py --device cuda                      # one GPU: 0.8B and 7.6B shapes, the 0.8B step
"""

from __future__ import annotations

import argparse
import hashlib
import json
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "bench"))

# name -> (hidden, layers, intermediate, vocab, kv heads x head dim): decoder shapes (attention, SwiGLU MLP, norms)
SHAPES = {
    "tiny": (256, 4, 704, 1024, 128),
    "0.5B": (896, 24, 4864, 151936, 128),
    "0.8B": (2048, 16, 5632, 1024, 1024),  # the GPU GRPO bench's model (bench/grpo_vs_trl.py --device cuda)
    "7.6B": (3584, 28, 18944, 152064, 512),  # Qwen2.5-7B's decoder
}
DEFAULT_SCHEDULE_SHARE = 13 / 100  # refits 1-3 and every 10th of 100 steps (refit.check defaults)


def layer_shapes(hidden: int, layers: int, inter: int, vocab: int, kv: int) -> list[tuple[str, tuple[int, ...]]]:
    out = [("embed_tokens.weight", (vocab, hidden)), ("lm_head.weight", (vocab, hidden)), ("norm.weight", (hidden,))]
    for i in range(layers):
        p = f"layers.{i}."
        out += [(p + "self_attn.q_proj.weight", (hidden, hidden)), (p + "self_attn.k_proj.weight", (kv, hidden)),
                (p + "self_attn.v_proj.weight", (kv, hidden)), (p + "self_attn.o_proj.weight", (hidden, hidden)),
                (p + "mlp.gate_proj.weight", (inter, hidden)), (p + "mlp.up_proj.weight", (inter, hidden)),
                (p + "mlp.down_proj.weight", (hidden, inter)), (p + "input_layernorm.weight", (hidden,)),
                (p + "post_attention_layernorm.weight", (hidden,))]
    return out


def sync(device) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


def bench_digest(shape: str, device, repeats: int) -> dict:
    import torch

    from gymv.backends.weights import tensor_digest

    names = layer_shapes(*SHAPES[shape])
    g = torch.Generator(device=device).manual_seed(0)
    weights = [(n, torch.randn(s, generator=g, device=device, dtype=torch.bfloat16)) for n, s in names]
    nbytes = sum(t.numel() * t.element_size() for _, t in weights)
    for _, t in weights[:4]:
        tensor_digest(t)  # warm-up: kernels, the column tables
    gymv, peer = [], []
    for _ in range(repeats):
        sync(device)
        t0 = time.perf_counter()
        for _, t in weights:
            tensor_digest(t)
        sync(device)
        gymv.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        for _, t in weights:
            hashlib.sha256(t.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes()).hexdigest()
        peer.append(time.perf_counter() - t0)
    return {"shape": shape, "tensors": len(weights), "gb": round(nbytes / 1e9, 3), "gymv_s": round(min(gymv), 4),
            "sha256_host_s": round(min(peer), 4), "gymv_gb_per_s": round(nbytes / 1e9 / min(gymv), 1),
            "sha256_gb_per_s": round(nbytes / 1e9 / min(peer), 2), "speedup": round(min(peer) / min(gymv), 1)}


MODES = {"off": ["refit.check.mode=off"], "default": [], "every refit": ["refit.check.first=1000"]}


def bench_grpo(device: str, work: Path, steps: int) -> dict:
    import grpo_vs_trl as g

    out = {}
    if device == "cuda":
        model, rows = g.prepare_cuda(work)
        prompts, generations, max_new, _ = g.CUDA_CONFIGS["cuda-16x8"]
        cfg = argparse.Namespace(prompts=prompts, generations=generations, max_new_tokens=max_new, steps=steps)
        for mode, extra in MODES.items():
            out[mode] = g.run_gymv_cuda(work, model, rows, cfg, f"check-{mode.replace(' ', '-')}", extra)
            print(f"grpo {mode}: {out[mode]['step_s']} s/step, refit {out[mode].get('median_refit_s')}", file=sys.stderr)
        return out
    model, rows = g.prepare(work, "random")
    cfg = argparse.Namespace(prompts=4, generations=4, max_new_tokens=16, steps=steps)
    for mode, extra in MODES.items():
        out[mode] = g.run_gymv(work, model, rows, cfg, f"check-{mode.replace(' ', '-')}", extra)
        print(f"grpo {mode}: {out[mode]['step_s']} s/step, refit {out[mode]['median_refit_s']}", file=sys.stderr)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    ap.add_argument("--part", choices=["digest", "grpo", "both"], default="both")
    ap.add_argument("--shapes", help="comma-separated, from: " + ", ".join(SHAPES) + " (default: by device)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--steps", type=int, default=8, help="GRPO steps per run (2..N timed)")
    ap.add_argument("--work", type=Path, default=ROOT / "runs" / "bench-refit-check")
    ap.add_argument("--out", type=Path, help="results JSON (default: bench/results/refit_check_<device>.json)")
    args = ap.parse_args()
    import torch

    device = torch.device("cuda", 0) if args.device == "cuda" else torch.device("cpu")
    shapes = args.shapes.split(",") if args.shapes else (["0.8B", "7.6B"] if args.device == "cuda" else ["tiny", "0.5B"])
    result: dict = {"started": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "device": args.device,
                    "device_name": torch.cuda.get_device_name(0) if args.device == "cuda" else "cpu",
                    "torch": torch.__version__}
    if args.part in ("digest", "both"):
        result["digest"] = [bench_digest(s, device, args.repeats) for s in shapes]
        print(f"\nDigests of every weight (bf16, on {result['device_name']}), best of {args.repeats}:")
        print(f"{'shape':<6} {'tensors':>7} {'GB':>7} {'gymv digest s':>14} {'GB/s':>7} {'SHA-256 via host s':>19} "
              f"{'GB/s':>6} {'gymv faster':>11}")
        for r in result["digest"]:
            print(f"{r['shape']:<6} {r['tensors']:>7} {r['gb']:>7.3f} {r['gymv_s']:>14.4f} {r['gymv_gb_per_s']:>7.1f} "
                  f"{r['sha256_host_s']:>19.4f} {r['sha256_gb_per_s']:>6.2f} {r['speedup']:>10.1f}x")
    if args.part in ("grpo", "both"):
        runs = bench_grpo(args.device, args.work.resolve(), args.steps)
        off, every = runs["off"], runs["every refit"]
        per_check = max(every["median_refit_s"] - off["median_refit_s"], 0.0)
        share = per_check * DEFAULT_SCHEDULE_SHARE / off["step_s"]
        result["grpo"] = {"runs": runs, "per_check_s": round(per_check, 4),
                          "default_share_of_step": round(share, 5)}
        print(f"\nGRPO steps 2..{args.steps}, medians (refit.check):")
        print(f"{'':<12} {'s/step':>8} {'refit s':>8}")
        for mode, r in runs.items():
            print(f"{mode:<12} {r['step_s']:>8.3f} {r['median_refit_s']:>8.4f}")
        print(f"one check costs {per_check:.4f} s; at the default schedule (13 of 100 refits) "
              f"{100 * share:.2f}% of a step")
    out = args.out or ROOT / "bench" / "results" / f"refit_check_{args.device}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"-> {out}")


if __name__ == "__main__":
    main()
