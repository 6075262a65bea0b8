"""The Qwen2.5-VL-7B shape colocated on one GPU: GRPO steps of `gymv train` with generation, logprobs, training
and refit sharing the card, the step's split and the card's peak memory.

The model is Qwen2.5-VL-7B-Instruct's configuration (28 layers of 3584, 28 query / 4 KV heads, vocabulary
152064, the 32-layer 1280-wide vision tower) with random weights, written once in bfloat16 beside the tokenizer,
processor and chat template of gymv's tiny Qwen2.5-VL (`gymv.models.tiny`); nothing is downloaded. The run is
the shipped recipe `vlm_grpo-qwen2.5-vl-7b-1n2g-fsdp2.yaml` with the one-GPU keys (docs/training.md, "Running
a recipe on one GPU") on circle-count's default 1000x1000 pictures, each variant its own process:

  bf16-moments  fsdp2 on the GPU, AdamW moments stored in bfloat16 (`training.optimizer_state_dtype`)
  offload       fsdp2 with weights, gradients and AdamW state in host memory (`training.fsdp.cpu_offload`)

Memory, 8.29B parameters: float32 master weights 33 GB, their gradients 33 GB, AdamW's moments in bfloat16 33 GB,
the generator's bfloat16 copy 17 GB: about 116 GB before activations, which leaves an H200 (141 GB) room for the
trainer's micro-batches and the decoder's cache, and an 80 GB card none. The recipe's KL penalty would add a
frozen float32 reference (33 GB more, over an H200's memory), so the runs go without it (`grpo.loss.kl_coef=0`;
`--kl` keeps the recipe's). The offload variant holds those 100 GB in host memory instead, which a 128 GB host
just holds at their own sizes (bench/README.md: pinned blocks rounded up to powers of two did not fit; pageable
ones did, 95 GB). The runs write no checkpoint (`checkpoint.enabled=false`): the trainer's state, 66 GB of
float32 weights and moments, is more than a GPU machine's scratch disk held.

Per variant: the median of steps 2..N of each `timing/*` phase, `token_mult_prob_error`, each worker's
`memory/*_peak_gb` and `_reserved_gb` from the rows, and the card's peak memory in use while the run lasted
(nvidia-smi, sampled every 0.2 s: every process on the card, the generator's and the trainer's together). Random weights write to the token limit, so every step generates
prompts x generations x --new-tokens tokens.

Usage (one GPU; the bf16-moments variant needs about 116 GB, an H200; the default picks it where the card
holds it, else offload):
    python bench/gpu_grpo_7b.py --out /tmp/g7 [--variants bf16-moments,offload] [--steps 3]
on a CPU, to check the script (a 3-layer model of the same classes):
    python bench/gpu_grpo_7b.py --cpu-smoke --out /tmp/g7
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gpu_doorkey import run  # noqa: E402
from gpu_train import shaped_config  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
RECIPE = ROOT / "recipes/vlm/vlm_grpo-qwen2.5-vl-7b-1n2g-fsdp2.yaml"
ONE_GPU = ["cluster.num_nodes=1", "cluster.gpus_per_node=1", "cluster.colocated=true", "refit.transport=cuda_ipc",
           "model.dtype=bfloat16", "training.dtype=bfloat16"]
CPU = ["cluster.num_nodes=1", "cluster.gpus_per_node=0", "refit.transport=object_store", "model.dtype=float32",
       "training.dtype=float32"]
VARIANTS = {"bf16-moments": ["training.optimizer_state_dtype=bfloat16"],
            "offload": ["training.optimizer_state_dtype=bfloat16", "training.fsdp.cpu_offload=true"]}
PHASES = ["timing/step_s", "timing/generation_s", "timing/logprobs_s", "timing/training_s", "timing/refit_s"]


FITS_GIB = 120  # the bf16-moments variant's ~116 GB of weights, gradients, moments and generator, and room to run


def auto_variant() -> str:
    """bf16-moments where the card holds it, else offload (the trainer's state in host memory)."""
    import torch

    if torch.cuda.is_available() and torch.cuda.get_device_properties(0).total_memory < FITS_GIB * 2**30:
        return "offload"
    return "bf16-moments"


def build_model(out: Path, smoke: bool) -> tuple[Path, int]:
    """The 7B configuration with random bfloat16 weights (a 3-layer one for --cpu-smoke), in a checkpoint folder
    that carries the tiny Qwen2.5-VL's tokenizer, processor and chat template; (folder, parameter count)."""
    import torch
    import transformers

    from gymv.models.tiny import init_tiny_qwen2vl

    base = init_tiny_qwen2vl(out, force=True, arch="tiny-qwen2_5vl", image_size=448 if not smoke else 56)
    config = shaped_config(transformers.AutoConfig.from_pretrained(base), "7b", smoke)
    device = "cuda" if torch.cuda.is_available() and not smoke else "cpu"
    torch.manual_seed(0)
    with torch.device(device):
        model = getattr(transformers, config.architectures[0])(config).to(torch.bfloat16)
    for f in base.glob("model*.safetensors*"):
        f.unlink()
    model.save_pretrained(base, max_shard_size="5GB")
    n = sum(p.numel() for p in model.parameters())
    del model
    if device == "cuda":
        torch.cuda.empty_cache()
    return base, n


class PeakMemory:
    """The card's largest memory in use (MiB, nvidia-smi) while the `with` block runs; None without one."""

    def __init__(self, period_s: float = 0.2):
        self.period_s, self.peak_mib = period_s, None
        self._stop = threading.Event()

    def _poll(self) -> None:
        while not self._stop.is_set():
            try:
                out = subprocess.run(["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits",
                                      "-i", "0"], capture_output=True, text=True, timeout=5).stdout
                used = int(out.strip().splitlines()[0])
                self.peak_mib = max(self.peak_mib or 0, used)
            except (OSError, ValueError, IndexError, subprocess.SubprocessError):
                return
            self._stop.wait(self.period_s)

    def __enter__(self) -> PeakMemory:
        if shutil.which("nvidia-smi"):
            self._thread = threading.Thread(target=self._poll, daemon=True)
            self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()


def summarize(variant: str, result: dict, peak_mib: int | None) -> dict:
    rows = [r for r in result["rows"] if r.get("step", 0) >= 1]
    timed = [r for r in rows if r["step"] >= 2] or rows
    out = {"variant": variant, "steps": len(rows), "note": result["note"], "wall_s": round(result["wall_s"], 1),
           "peak_gpu_gb": round(peak_mib / 1024, 1) if peak_mib else None}
    memory = [f"memory/{p}_{n}" for p in ("training", "generation") for n in ("peak_gb", "reserved_gb")]
    for k in PHASES + memory + ["train/token_mult_prob_error", "timing/generation_tokens_per_s"]:
        vals = [r[k] for r in timed if k in r]
        if vals:
            out[k] = round(statistics.median(vals), 4)
    if rows:
        out["first_step_s"] = rows[0].get("timing/step_s")
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--variants", default="auto", help=f"comma-separated, from: {', '.join(VARIANTS)}; auto: "
                    f"bf16-moments on a card of {FITS_GIB} GiB or more (an H200), else offload")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--generations", type=int, default=8)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--run-timeout", type=float, default=480, help="seconds before a run is stopped (its logged "
                    "steps still count)")
    ap.add_argument("--kl", action="store_true", help="keep the recipe's KL penalty (a float32 reference model: "
                    "33 GB more)")
    ap.add_argument("--cpu-smoke", action="store_true")
    a = ap.parse_args()
    if a.variants == "auto":
        a.variants = auto_variant()
    unknown = set(a.variants.split(",")) - set(VARIANTS)
    if unknown:
        sys.exit(f"unknown variant(s) {', '.join(sorted(unknown))}: use {', '.join(VARIANTS)}")
    a.out.mkdir(parents=True, exist_ok=True)
    t0 = time.time()
    model, n = build_model(a.out / "model-7b", a.cpu_smoke)
    print(f"model: {n / 1e9:.2f}B parameters written in {time.time() - t0:.0f} s", flush=True)
    layout = CPU if a.cpu_smoke else ONE_GPU
    common = [f"model.path={model}", f"grpo.max_steps={a.steps}", f"grpo.prompts_per_step={a.prompts}",
              f"grpo.generations_per_prompt={a.generations}", f"generation.max_new_tokens={a.new_tokens}",
              "grpo.val_period=0", "grpo.val_at_start=false", "data.prepare.n_train=64", "data.prepare.n_eval=8",
              "checkpoint.enabled=false", "model.max_seq_len=2048"] + ([] if a.kl else ["grpo.loss.kl_coef=0"])
    results = []
    for v in a.variants.split(","):
        extra = [o for o in VARIANTS[v] if not (a.cpu_smoke and "cpu_offload" in o)]
        with PeakMemory() as mem:
            r = run(f"grpo7b-{v}", RECIPE, layout + common + extra, a.out, a.run_timeout)
        results.append(summarize(v, r, mem.peak_mib))
        print(json.dumps(results[-1]), flush=True)
    (a.out / "gpu_grpo_7b.json").write_text(json.dumps({"params": n, "results": results}, indent=1))
    head = ["variant", "steps", "step s", "generation s", "logprobs s", "training s", "refit s", "peak GPU GB",
            "mult_prob_err"]
    print("\n" + " | ".join(head))
    for r in results:
        cells = [r.get(k) for k in PHASES] + [r.get("peak_gpu_gb"), r.get("train/token_mult_prob_error")]
        print(" | ".join([r["variant"], str(r["steps"])] + [f"{c:.3g}" if isinstance(c, (int, float)) else "-"
                                                            for c in cells]) + (f" ({r['note']})" if r["note"] else ""))


if __name__ == "__main__":
    main()
