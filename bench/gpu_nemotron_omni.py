"""Nemotron 3 Nano Omni on one GPU: a GRPO trainer step, and decode ms/step at batch 64 on gymv's static decoder
against transformers' own `generate`, in one run.

The model is `NemotronH_Omni_Reasoning_V3` built in memory (random init) with the widths of
Nemotron-3-Nano-Omni-30B-A3B: its language model's hidden size 2688, 32 query / 2 KV heads of 128, Mamba-2
layers of 64 heads of 64 with 8 groups and state 128, MoE layers of 128 routed experts (top 6, width 1856,
sigmoid router, scaling 2.5) plus a shared expert of width 3712, vocabulary 131072; its RADIO-H tower (1280 wide,
32 layers, 16 heads, patch 16) and projector (20480 wide). Only the depth is cut: the layers are the first
ones of the 52-layer pattern `MEMEM*EMEMEM*...` (M Mamba-2, E MoE, * attention), as many as fit. Tokenizer,
image processor and chat template are those of `gymv model init tiny-nemotron-omni` (so token ids stay below
its vocabulary; the embedding and LM head still have the full 131072 rows).

train   GRPO on synthetic rollouts: groups of G=8 samples sharing a prompt (one 512x512 image, 256 image
        tokens, and chat text) with responses of log-normal length (median 300, 16..1536 tokens), random
        advantages, the clipped policy loss; the fsdp2 backend on one rank (--backend: fsdp2, fsdp2-keep with
        the gathered weights kept to the backward, torch (one cast of the weights a step), torch-autocast (a cast at
        every use); a list runs each in turn), fp32 master weights
        computing in bf16, activation checkpointing (--no-vision-checkpointing: the decoder's layers only),
        packed rows on the gymv path, each group's prompt once in its row (--whole-rows: every sequence whole,
        its prompt repeated, as before prompts were shared).
        After one warm-up step, the median of --steps timed `train_step` calls. Reported: tokens/s (every
        token), unique tokens/s (each group's prompt once), MFU = (6 * N_active * D_unique + 6 * N_head *
        D_generated) / time / 989e12, where N_active counts the decoder's parameters a token uses (the top 6
        of the 128 routed experts, the shared expert, every Mamba, attention and norm weight; no embedding,
        no LM head, no vision tower) and attention-score FLOPs are left out, as in gpu_train.py; the same
        with every token (mfu_all_tokens); peak memory (max_memory_allocated). If a depth does not fit, the
        next smaller one in --train-layers is tried, each depth in a fresh process.
decode  batch 64 (8 prompts x 8 samples), text prompts of about 300 tokens, 128 new tokens, sampled at
        temperature 1; ms/step = (t(128 tokens) - t(1 token)) / 127 after a warm-up call, so prefill falls
        out. Paths: `static` (StaticDecodeBackend: per-row Mamba states, CUDA graphs, compiled step, grouped
        experts), `static_eager` (the same, graphs of uncompiled kernels), `hf_generate`
        (`model.generate`, its dynamic hybrid cache), `gymv_hf` (gymv's HF loop). Also, for the static
        decoder: greedy agreement with gymv's HF loop (first divergence per row) and token_mult_prob_error
        against the trainer's logprobs.

layers  one MoE layer and one Mamba-2 mixer at the Nano widths, 16,384 tokens (8 sequences of 2,048),
        forward and backward, median ms and peak memory, each path beside the others: MoE `hf_eager`
        (transformers' expert loop), `hf_grouped_mm` (its `experts_implementation="grouped_mm"`), `gymv`
        (gymv.backends.moe_experts, its passes between the products on Triton), `gymv_torch` (the same with
        those passes in torch, GYMV_MOE_KERNELS=0), `gymv_first_micro_batch` (gymv with no gradient to add
        to, as in a step's first micro-batch; every other path adds each call's gradients to the last's, as a
        step's later micro-batches do), with the layer's MFU; Mamba `hf_per_segment` (transformers' mixer once
        per sequence, gymv's old packed path), `hf_rows` (transformers' mixer on 8 rows of 2,048),
        `gymv_torch` (one call over the packed row, gymv's torch scan), `gymv_triton` (the same on
        mamba_ssm's kernels, the convolution on causal_conv1d where it imports, else on gymv's Triton
        convolution; skipped with the reason where they do not import), `gymv_triton_torch_conv` (the same
        with gymv's torch convolution, where the Triton one runs). Before the mixer, its causal convolution
        alone (`mamba_conv`: conv_dim channels, bias, silu, the packed row's seq_idx): `torch`
        (ssd_scan.segment_conv1d), `triton` (gymv.backends.conv_kernel, with its largest error against the
        torch convolution), `causal_conv1d` (where it imports), each also forward alone (`..._forward`),
        and the Triton kernel with other tiles (`triton_tiles_<forward>_<backward>`, CONV_TILES). Then the
        RADIO tower and projector (`vision`: 1 and 4 distinct images a call, `--vision-paths` eager or
        compiled, checkpointed or not, with the host's time to queue the call beside the device's).
        `--layer-kinds` picks among moe, conv, mamba, vision; gymv's MoE and Mamba rows and the 4-image
        vision rows carry the operators with the most device time (`top_ops`).

Kernel paths beside transformers': the trainer runs `--train-paths` (`gymv`: gymv's experts and packed rows
with one Mamba call per row on the kernels; `megatron`: gymv's Megatron backend at TP 1 / EP 1 / CP 1, its
hybrid twin of the decoder on the same kernels, with its bf16 logprobs on one group against the HF model's on
the same weights; `hf`: transformers' expert loop, rows not packed, torch scan),
the decoder `--paths` (`static` on the kernels where they import, `static_torch` with GYMV_MAMBA_KERNELS=0,
`hf_generate`, ...). Each part (layers, each train path, decode) runs in a process of its own (`--part`),
since one starves the next of memory; `--part all` (the default) runs them one after another and merges
their results. `--profile` adds the trainer step's time split by layer kind (Mamba, MoE, attention, MLP, the
vision tower and projector; forward, recomputation and backward, timed by CUDA events around each module)
and the operators with the most device time in one more step (torch.profiler; for the `megatron` path,
whose twin replaces the HF layers the split watches, the operators alone), with the device's busy share of
that step and, per trainer phase (`gymv/plan`, `gymv/step_images`, `gymv/collate`, `gymv/forward`,
`gymv/backward`, `gymv/optimizer`, `gymv/read`), its host milliseconds beside the milliseconds the device
ran anything in that window (`phases`; `before_first_kernel_ms`: the device's wait for the step's first
kernel). A phase whose host time far exceeds its device time is where the step waits on the host. Each
trainer row carries `optimizer_floor_s`, the least time float32 AdamW can take over its parameters at the
card's bandwidth.
The decode rows carry the bandwidth limit: the bytes one step must read (every decoder weight but the routed
experts, the routed experts a batch of this size touches in expectation under uniform routing, the LM head,
the KV cache and the Mamba states) over --hbm-tbps.

Usage:
  python bench/gpu_nemotron_omni.py --device cuda --out /tmp/omni_bench     # one H200: under 10 minutes
  python bench/gpu_nemotron_omni.py --device cpu --out /tmp/omni_bench      # tiny widths: checks the script
  python bench/gpu_nemotron_omni.py --device cpu --out /tmp/omni_bench --part layers   # the CPU layer figures
Results: --json (default bench/results/gpu_nemotron_omni_h200.json on CUDA, OUT/gpu_nemotron_omni.json on CPU).
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import dataclasses
import gc
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from gpu_train import device_spans, phase_busy, union_us  # noqa: E402

PEAK_FLOPS = 989e12  # H200 bf16 dense
PATTERN = "MEMEM*EMEMEM*EMEMEM*EMEMEM*EMEMEM*EMEMEMEM*EMEMEMEME"  # the 52 layers of the 30B-A3B model
LETTERS = {"M": "linear_attention", "E": "moe", "*": "full_attention", "-": "mlp"}
NANO_TEXT = dict(hidden_size=2688, num_attention_heads=32, num_key_value_heads=2, head_dim=128,
                 intermediate_size=1856, mamba_num_heads=64, mamba_head_dim=64, n_groups=8, ssm_state_size=128,
                 conv_kernel=4, chunk_size=128, n_routed_experts=128, num_experts_per_tok=6,
                 moe_intermediate_size=1856, moe_shared_expert_intermediate_size=3712, routed_scaling_factor=2.5,
                 n_group=1, topk_group=1, norm_topk_prob=True, vocab_size=131072, layer_norm_epsilon=1e-5)
NANO_VISION = dict(hidden_size=1280, num_hidden_layers=32, num_attention_heads=16, mlp_ratio=4.0)
NANO_OMNI = dict(vision_hidden_size=1280, projector_hidden_size=20480)
TINY_TEXT = dict(NANO_TEXT, hidden_size=64, num_attention_heads=4, head_dim=16, intermediate_size=64,
                 mamba_num_heads=4, mamba_head_dim=16, n_groups=2, ssm_state_size=16, chunk_size=16,
                 n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
                 moe_shared_expert_intermediate_size=64, vocab_size=2048)
TINY_VISION = dict(hidden_size=32, num_hidden_layers=1, num_attention_heads=4, mlp_ratio=2.0)
TINY_OMNI = dict(vision_hidden_size=32, projector_hidden_size=128)
GROUP = 8
DECODE_BATCH = 64
HBM_TBPS = {"H200": 4.8, "H100": 3.35}  # HBM bandwidth, TB/s, the data sheets' figures (H100: SXM)


def hbm_tbps(device_name: str) -> float:
    """The card's HBM bandwidth by its name; an H200's where the name is not known (say so with --hbm-tbps)."""
    return next((tbps for card, tbps in HBM_TBPS.items() if card in device_name), HBM_TBPS["H200"])


# the layers part on a CPU: widths a CPU runs in seconds, the Nano's shape otherwise
CPU_LAYER_TEXT = dict(NANO_TEXT, hidden_size=256, mamba_num_heads=8, mamba_head_dim=32, n_groups=2,
                      ssm_state_size=32, chunk_size=64, n_routed_experts=32, num_experts_per_tok=4,
                      moe_intermediate_size=128, moe_shared_expert_intermediate_size=256)
# (rows, channels, warps) of the Triton convolution's forward and backward tiles the layers part times
CONV_TILES = [((32, 64, 8), (16, 64, 4)), ((16, 64, 4), (16, 64, 8)), ((32, 128, 8), (8, 128, 4)),
              ((64, 64, 8), (32, 64, 8))]
VISION_PATHS = ("gymv", "copy", "eager", "eager_no_ckpt", "compiled", "compiled_no_ckpt")
KIND_OF = {"linear_attention": "mamba", "mamba": "mamba", "moe": "moe", "full_attention": "attention",
           "attention": "attention", "mlp": "mlp"}


@dataclasses.dataclass
class Mode:
    device: str
    text: dict
    vision: dict
    omni: dict
    image_side: int
    patch: int
    median_response: int
    max_response: int
    new_tokens: int
    precision: str


def mode_for(device: str) -> Mode:
    if device == "cuda":
        return Mode("cuda", NANO_TEXT, NANO_VISION, NANO_OMNI, 512, 16, 300, 1536, 128, "bf16")
    return Mode("cpu", TINY_TEXT, TINY_VISION, TINY_OMNI, 64, 8, 20, 60, 8, "fp32")


def sync(mode: Mode) -> None:
    import torch

    if mode.device == "cuda":
        torch.cuda.synchronize()


def timed(mode: Mode, fn) -> float:
    sync(mode)
    t0 = time.perf_counter()
    fn()
    sync(mode)
    return time.perf_counter() - t0


def base_policy(out: Path, mode: Mode):
    """The tiny checkpoint whose tokenizer, processor and chat template every built model shares."""
    import torch

    from gymv.backends.policy import load_policy
    from gymv.models.tiny import init_tiny

    path = init_tiny("tiny-nemotron-omni", out / "base", force=True, hidden=64, layers=4, heads=4, kv_heads=2,
                     intermediate=128, vision_hidden=32, vision_layers=1, vision_heads=4,
                     image_size=mode.image_side, patch_size=mode.patch)
    return load_policy(path, device="cpu", dtype=torch.float32)


def build_policy(base, mode: Mode, layers: int, dtype):
    """`base` with its model replaced by a random Nano-Omni-shaped one of the first `layers` layers of the
    pattern, built on the device in `dtype` (the router's gates in float32, as transformers loads them).

    transformers builds a model in its config's `dtype`, whatever torch's default: the base checkpoint loads in
    float32, so each config is set to `dtype` first (without it a "bfloat16" decode model was float32)."""
    import torch
    import transformers

    config = copy.deepcopy(base.model.config)
    for c in [config, *(v for v in vars(config).values() if isinstance(v, transformers.PretrainedConfig))]:
        c.dtype = dtype
    text = dict(mode.text, layers_block_type=[LETTERS[c] for c in PATTERN[:layers]])
    for k, v in text.items():
        setattr(config.text_config, k, v)
    for k, v in mode.vision.items():
        setattr(config.vision_config, k, v)
    for k, v in mode.omni.items():
        setattr(config, k, v)
    torch.manual_seed(0)
    default = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(mode.device):
            model = type(base.model)(config).eval()
    finally:
        torch.set_default_dtype(default)
    stray = [n for n, p in model.named_parameters() if p.dtype != dtype and not n.endswith("mixer.gate.weight")]
    if stray:
        raise SystemExit(f"build_policy: {len(stray)} parameters are not {dtype} (first: {stray[0]})")
    return dataclasses.replace(base, model=model)


def param_counts(model) -> dict:
    """Parameters by part; `active_decoder`: the decoder's weights one token uses (top-k of the routed
    experts, the shared expert, Mamba, attention and norms)."""
    lm = model.language_model
    text = lm.config
    embed = lm.model.embeddings.weight.numel()
    head = lm.lm_head.weight.numel()
    decoder = sum(p.numel() for p in lm.model.layers.parameters()) + lm.model.norm_f.weight.numel()
    routed = sum(p.numel() for layer in lm.model.layers if layer.block_type == "moe"
                 for p in (layer.mixer.experts.up_proj, layer.mixer.experts.down_proj))
    active = decoder - routed + routed * text.num_experts_per_tok // text.n_routed_experts
    total = sum(p.numel() for p in model.parameters())
    return {"total": total, "decoder": decoder, "active_decoder": active, "routed_experts": routed,
            "embedding": embed, "head": head, "vision_and_projector": total - decoder - embed - head}


def image(mode: Mode, seed: int):
    import numpy as np
    from PIL import Image

    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 255, (mode.image_side, mode.image_side, 3), dtype=np.uint8))


def prompt_ids(policy, text: str, images) -> list[int]:
    content = [{"type": "image"} for _ in images] + [{"type": "text", "text": text}]
    rendered = policy.tokenizer.apply_chat_template([{"role": "user", "content": content}], tokenize=False,
                                                    add_generation_prompt=True, chat_template=policy.chat_template)
    return policy.adapter.encode_text(rendered, images)


def rollouts(policy, mode: Mode, groups: int, seed: int) -> list[dict]:
    """GRPO samples as gpu_train.py draws them: G per prompt (an image and chat text), log-normal responses."""
    import numpy as np

    from gymv.backends.training.samples import training_sample

    rng = np.random.default_rng(seed)
    forbidden = set(policy.adapter.vision_token_ids)
    vocab = [t for t in range(3, len(policy.tokenizer)) if t not in forbidden]
    out = []
    for g in range(groups):
        img = image(mode, seed * 1000 + g)
        words = " ".join(f"w{int(x)}" for x in rng.integers(0, 500, int(rng.integers(20, 120))))
        prompt = prompt_ids(policy, f"Count the circles. {words}", [img])
        for _ in range(GROUP):
            n = int(np.clip(rng.lognormal(math.log(mode.median_response), 0.6), 4, mode.max_response))
            gen = [vocab[int(i)] for i in rng.integers(0, len(vocab), n)]
            out.append(training_sample(prompt + gen, [0] * len(prompt) + [1] * n, images=[img], where=f"group {g}",
                                       logp_behaviour=[0.0] * len(prompt) + list(-rng.exponential(1.0, n)),
                                       advantage=float(rng.normal())))
    return out


def use_path(model, path: str) -> bool | str:
    """Set `model` up for a trainer path (module docstring); returns its sequence_packing setting."""
    from gymv.backends import moe_experts

    if path == "gymv":
        os.environ.pop("GYMV_MAMBA_KERNELS", None)
        moe_experts.install(model)
        return "auto"
    if path == "megatron":  # the twin runs its own experts and mixers on the kernels; the HF model is the reference
        os.environ.pop("GYMV_MAMBA_KERNELS", None)
        return "auto"
    if path not in ("hf", "hf_grouped_mm"):
        raise SystemExit(f"unknown train path {path!r}: gymv, megatron, hf or hf_grouped_mm")
    os.environ["GYMV_MAMBA_KERNELS"] = "0"
    moe_experts.uninstall(model)
    for m in model.modules():
        if type(m).__name__ == "NemotronHExperts":
            m.config._experts_implementation = "eager" if path == "hf" else "grouped_mm"
    return False


# fsdp2-keep: training.fsdp.reshard_after_forward false; torch-autocast: training.weight_copy false
BACKENDS = ("fsdp2", "fsdp2-keep", "torch", "torch-autocast")


def train(base, mode: Mode, layers: int, a, path: str = "gymv", variant: str = "fsdp2") -> dict:
    """One GRPO trainer configuration: warm-up step, then the median of `a.steps` timed steps."""
    import torch

    from gymv.algorithms.loss_fns import PolicyLoss
    from gymv.backends import mamba_kernels, packed_mamba
    from gymv.backends.training.base import TrainingSetup
    from gymv.backends.training.hf_fsdp import HFFSDPBackend
    from gymv.backends.training.hf_torch import HFTorchBackend
    from gymv.backends.training.samples import as_tensors
    from gymv.config.schema import TrainingSection

    policy = build_policy(base, mode, layers, torch.float32)
    packing = use_path(policy.model, path)
    counts = param_counts(policy.model)
    policy.model.gradient_checkpointing_enable()
    training = TrainingSection(lr=1e-6, weight_decay=0.01, dtype={"fp32": "float32", "bf16": "bfloat16"}[mode.precision],
                               micro_batch_tokens=a.micro_batch_tokens, gradient_checkpointing=True,
                               optimizer_state_dtype="bfloat16" if a.adam16 else "float32",
                               sequence_packing=packing,
                               backend="megatron" if path == "megatron" else variant.split("-")[0],
                               fsdp={"reshard_after_forward": variant != "fsdp2-keep"},
                               weight_copy=variant != "torch-autocast",
                               vision_checkpointing=not a.no_vision_checkpointing)
    setup = TrainingSetup(model_path=str(policy.path), training=training, device=mode.device, seed=0)
    samples = rollouts(policy, mode, a.groups, seed=0)
    agreement = None
    if path == "megatron":
        backend, agreement = megatron_backend(policy, setup, mode, samples[:GROUP])
    else:
        cls = HFFSDPBackend if training.backend == "fsdp2" else HFTorchBackend
        backend = cls(policy, setup, device=mode.device, rank=0, world_size=1)
    layout = getattr(backend.trainer.plan_fn, "__self__", None)
    if a.whole_rows and layout is not None:
        layout.shares_in_row = False
    total = sum(len(s["input_ids"]) for s in samples)
    generated = sum(sum(s["loss_mask"]) for s in samples)
    unique = total - sum((GROUP - 1) * s["loss_mask"].index(True) for s in samples[::GROUP])
    loss, times, metrics = PolicyLoss(), [], {}
    if mode.device == "cuda":
        torch.cuda.reset_peak_memory_stats()
    for step in range(a.steps + 1):
        batch = [as_tensors(dict(s)) for s in samples]
        t = timed(mode, lambda: metrics.update(backend.train_step(batch, loss)))
        times.append(t)
    t = statistics.median(times[1:])
    flops = 6 * counts["active_decoder"] * unique + 6 * counts["head"] * generated
    flops_all = 6 * counts["active_decoder"] * total + 6 * counts["head"] * generated
    profile = None
    if a.profile and path == "megatron":  # the kind profile watches the HF model's layers, which the twin replaced
        try:
            profile = {"top_ops": op_profile(mode, lambda: backend.train_step(
                [as_tensors(dict(s)) for s in samples], loss))}
        except Exception as e:  # noqa: BLE001
            profile = f"failed: {type(e).__name__}: {str(e)[:200]}"
    elif a.profile:
        try:  # the timed steps' figures are kept whatever the extra profiled step does
            profile = kind_profile(policy.model, mode, lambda: backend.train_step(
                [as_tensors(dict(s)) for s in samples], loss))
            profile["top_ops"] = op_profile(mode, lambda: backend.train_step(
                [as_tensors(dict(s)) for s in samples], loss), top=30, busy=profile)
        except Exception as e:  # noqa: BLE001
            profile = f"failed: {type(e).__name__}: {str(e)[:200]}"
    row = {"path": path, "layers": layers, "pattern": PATTERN[:layers], "backend": variant,
           "optimizer_state_dtype": training.optimizer_state_dtype, "params": counts,
           "logprobs_against_hf": agreement,
           "vision_checkpointing": training.vision_checkpointing,
           "sequence_packing": packing, "shared_prompts": bool(getattr(layout, "shares_in_row", False)),
           "mamba_scan": packed_mamba.path(mode.device) if packing else "transformers",
           "mamba_kernels_why_not": mamba_kernels.why_not(mode.device), "profile_s_by_kind": profile,
           "samples": len(samples), "tokens": total, "unique_tokens": unique, "generated_tokens": generated,
           "first_step_s": times[0], "step_s": t, "step_s_all": times[1:], "tokens_per_s": total / t,
           "unique_tokens_per_s": unique / t, "mfu": flops / t / PEAK_FLOPS,
           "mfu_all_tokens": flops_all / t / PEAK_FLOPS, "loss": metrics.get("train/loss"),
           "optimizer_floor_s": optimizer_floor_s(counts["total"], a, mode),
           "micro_batches": metrics.get("train/num_micro_batches")}
    row.update({k: v for k, v in metrics.items() if "moe" in k})  # the routers' load-balancing terms
    if mode.device == "cuda":
        row["peak_mem_gb"] = torch.cuda.max_memory_allocated() / 2**30
        row["peak_reserved_gb"] = torch.cuda.max_memory_reserved() / 2**30
    backend.close()
    del backend, policy
    free(mode)
    return row


def optimizer_floor_s(params: int, a, mode: Mode) -> float | None:
    """The least time float32 AdamW can take over `params` on this card: it reads the weight, its gradient and
    two moments and writes the weight and moments back, 28 bytes a parameter, at the card's HBM bandwidth. With
    every parameter on one card (128 routed experts a MoE layer, 6 of them used by a token) this alone bounds
    the step's MFU, whatever the kernels."""
    if mode.device != "cuda":
        return None
    import torch

    return 28 * params / ((a.hbm_tbps or hbm_tbps(torch.cuda.get_device_name(0))) * 1e12)


def megatron_backend(policy, setup, mode: Mode, group: list[dict]):
    """gymv's Megatron backend at TP 1 / EP 1 / CP 1 on this policy, and its logprobs on `group` against the HF
    model's on the same weights (the HF model scores first, through the torch backend, then gives its weights to
    the Megatron twin): token_mult_prob_error (mean exp|difference| over the scored tokens) and the largest
    difference."""
    import torch

    from gymv.backends.training.hf_torch import HFTorchBackend
    from gymv.backends.training.megatron import MegatronBackend
    from gymv.backends.training.megatron_model import init_parallel
    from gymv.backends.training.samples import as_tensors

    hf = HFTorchBackend(policy, setup, device=mode.device, rank=0, world_size=1)
    want = hf.compute_logprobs([as_tensors(dict(s)) for s in group])
    hf.close()
    del hf
    free(mode)
    init_parallel(1, torch.device(mode.device), seed=0)
    backend = MegatronBackend(policy, setup, device=mode.device, rank=0, world_size=1)
    got = backend.compute_logprobs([as_tensors(dict(s)) for s in group])
    diffs = torch.cat([(g.float() - w.float()).abs()[torch.as_tensor(s["loss_mask"], dtype=torch.bool)]
                       for g, w, s in zip(got, want, group)])
    agreement = {"samples": len(group), "tokens": int(diffs.numel()),
                 "token_mult_prob_error": float(diffs.exp().mean()), "max_abs_diff": float(diffs.max()),
                 "mean_abs_diff": float(diffs.mean()), "precision": mode.precision}
    print(f"megatron logprobs against HF: {agreement}", flush=True)
    return backend, agreement


def op_profile(mode: Mode, step, top: int = 20, busy: dict | None = None) -> list[dict]:
    """The operators that took the most device time (CPU: host time) in one `step()`, from torch.profiler: name,
    self milliseconds, calls and share of the step's summed self time. On CUDA each kernel counts once, for
    the host operator or range that launched it (a Triton kernel launched from Python: its enclosing
    `record_function` range, such as gymv/forward). `busy`, if given, gets the step's wall seconds under the
    profiler and the seconds in which the device ran at least one kernel or copy: a device busy far less
    than the wall is waiting on the host."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if mode.device == "cuda" else [])
    with profile(activities=activities) as prof:
        wall = timed(mode, step)
    attr = "self_device_time_total" if mode.device == "cuda" else "self_cpu_time_total"
    # host-side events only: a kernel's own event (and a range's device-side copy) would count its time twice
    events = [e for e in prof.key_averages() if e.device_type == DeviceType.CPU and getattr(e, attr, 0) > 0]
    total = sum(getattr(e, attr) for e in events) or 1.0
    if busy is not None:
        spans = device_spans(prof.events())
        device_s = union_us(spans) / 1e6 if mode.device == "cuda" else total / 1e6
        busy.update(profiled_wall_s=wall, device_s=device_s, device_busy=device_s / wall)
        if mode.device == "cuda":
            busy["phases"] = phase_busy(prof.events(), spans)
    events.sort(key=lambda e: getattr(e, attr), reverse=True)
    return [{"op": e.key[:120], "self_ms": round(getattr(e, attr) / 1e3, 3), "calls": e.count,
             "share": round(getattr(e, attr) / total, 4)} for e in events[:top]]


def kind_profile(model, mode: Mode, step) -> dict:
    """Seconds of one `step()` spent in each layer kind and in the vision tower and projector, forward (with
    activation recomputation) and backward apart: CUDA events (CPU: the clock) around each module, from
    forward and full backward hooks; `step_s` is the whole step, `other` what no module accounts for."""
    import torch

    from collections import defaultdict

    stacks: dict = defaultdict(list)
    spans: dict = defaultdict(list)

    def stamp():
        if mode.device == "cuda":
            e = torch.cuda.Event(enable_timing=True)
            e.record()
            return e
        return time.perf_counter()

    def opener(key):
        return lambda *_: stacks[key].append(stamp())

    def closer(key):
        def close(*_):
            if stacks[key]:
                spans[key].append((stacks[key].pop(), stamp()))
        return close

    handles = []
    watched = [(layer, KIND_OF.get(layer.block_type, layer.block_type)) for layer in model.language_model.model.layers]
    # the tower's blocks, not the whole tower: a full backward hook fires only on a module whose input needs a
    # gradient and whose output is a tensor, and the tower's input is pixels, its output a ModelOutput
    tower = model.vision_model
    blocks = getattr(getattr(tower, "encoder", None), "layer", None) or [tower]
    watched += [(block, "vision") for block in blocks] + [(model.multi_modal_projector, "projector")]
    for module, kind in watched:
        handles += [module.register_forward_pre_hook(opener((kind, "forward"))),
                    module.register_forward_hook(closer((kind, "forward"))),
                    module.register_full_backward_pre_hook(opener((kind, "backward"))),
                    module.register_full_backward_hook(closer((kind, "backward")))]
    try:
        total = timed(mode, step)
    finally:
        for h in handles:
            h.remove()
    sync(mode)

    def seconds(a, b):
        return a.elapsed_time(b) / 1e3 if mode.device == "cuda" else b - a
    out = {f"{kind}/{part}": sum(seconds(a, b) for a, b in v) for (kind, part), v in sorted(spans.items())}
    out["other"] = total - sum(out.values())
    out["step_s"] = total
    return out


def layer_text(mode: Mode) -> dict:
    return NANO_TEXT if mode.device == "cuda" else CPU_LAYER_TEXT


def fwd_bwd(mode: Mode, fns: dict, reps: int, before: dict | None = None) -> dict[str, dict]:
    """Per path: the median ms of its `fn()` (a forward and backward), the paths taking turns round by round
    after a warm-up call each (so that a load that comes and goes touches them alike), and on CUDA its peak
    memory beyond what was allocated before, from one more call; a path that fails gets its error.
    `before[path]`, where given, runs untimed before each of the path's timed calls."""
    import torch

    out: dict[str, dict] = {}
    times: dict[str, list] = {}
    for path, fn in fns.items():
        try:
            fn()
            times[path] = []
        except Exception as e:  # noqa: BLE001 - a benchmark reports and goes on
            out[path] = {"error": f"{type(e).__name__}: {str(e)[:300]}"}
            free(mode)
    for _ in range(reps):
        for path in times:
            if before and path in before:
                before[path]()
            times[path].append(timed(mode, fns[path]))
    for path, ts in times.items():
        out[path] = {"ms": statistics.median(ts) * 1e3}
        if mode.device == "cuda":
            free(mode)
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()
            fns[path]()
            out[path]["peak_extra_gb"] = (torch.cuda.max_memory_allocated() - base) / 2**30
    return out


def moe_layer_rows(mode: Mode, tokens: int, reps: int) -> list[dict]:
    """One NemotronH MoE layer (router, routed and shared experts), forward and backward over `tokens`."""
    import torch
    from transformers import NemotronHConfig
    from transformers.models.nemotron_h.modeling_nemotron_h import NemotronHMoE

    from gymv.backends import moe_experts

    text = layer_text(mode)
    dtype = torch.bfloat16 if mode.device == "cuda" else torch.float32
    cfg = NemotronHConfig(**{**text, "layers_block_type": ["moe"]})
    torch.manual_seed(0)
    layer = NemotronHMoE(cfg).to(mode.device, dtype)
    with torch.no_grad():
        for p in layer.parameters():
            p.normal_(0, 0.02)
        layer.gate.weight.normal_(0, 1.0)  # routes spread over the experts (a zero router ties them all)
    x = torch.randn(1, tokens, text["hidden_size"], device=mode.device, dtype=dtype, requires_grad=True)
    d, k, i, si = text["hidden_size"], text["num_experts_per_tok"], text["moe_intermediate_size"], \
        text["moe_shared_expert_intermediate_size"]
    flops = 6 * tokens * (k * 2 * d * i + 2 * d * si + d * text["n_routed_experts"])

    def use(path):
        moe_experts.uninstall(layer)
        os.environ[moe_experts.SWITCH] = "0" if path == "gymv_torch" else "1"
        if path.startswith("gymv"):
            moe_experts.install(layer)
        else:
            cfg._experts_implementation = path[3:]

    def run(path):
        def go():
            use(path)
            layer(x).float().pow(2).mean().backward()
        return go
    rows = []
    for what in ("moe", "moe_experts"):  # the whole layer, then its routed experts alone (the same routes)
        if what == "moe_experts":
            with torch.no_grad():
                _, w, ids = layer.gate(x.detach())
            h = x.detach().view(tokens, -1).requires_grad_()
            flops = 6 * tokens * k * 2 * d * i

            def run(path):
                def go():
                    use(path)
                    layer.experts(h, ids, w).float().pow(2).mean().backward()
                return go
        fns = {p: run(p) for p in ("hf_eager", "hf_grouped_mm", "gymv_torch", "gymv")}
        # a step's first micro-batch: the gradients start from none, so the weight gradients are not added to
        # (every other path adds each call's gradients to the last's, as a step's later micro-batches do)
        fns["gymv_first_micro_batch"] = fns["gymv"]
        leaves = [x, *layer.parameters()] if what == "moe" else [h, *layer.experts.parameters()]
        fresh = {"gymv_first_micro_batch": lambda: [setattr(t, "grad", None) for t in leaves]}
        measured = fwd_bwd(mode, fns, reps, before=fresh)
        part = []
        for path, r in measured.items():
            if "ms" in r and mode.device == "cuda":
                r["mfu"] = flops / (r["ms"] / 1e3) / PEAK_FLOPS
            part.append({"layer": what, "path": path, "tokens": tokens, "flops": flops, **r})
            print(json.dumps(part[-1]), flush=True)
        profile_rows(mode, part, {"gymv": fns["gymv"]})
        rows += part
    return rows


def vision_blocks(model) -> list:
    """The tower's blocks: the longest ModuleList on the vision side (RADIO's encoder layers)."""
    import torch

    from gymv.backends.training.fsdp import is_vision

    lists = [m for n, m in model.named_modules() if isinstance(m, torch.nn.ModuleList) and n and is_vision(n)]
    return list(max(lists, key=len)) if lists else []


def vision_rows(mode: Mode, reps: int, counts=(1, 4), paths=VISION_PATHS) -> list[dict]:
    """The RADIO tower and projector as the fsdp2 trainer runs them (gymv's adapter, float32 replicated weights
    computing in bfloat16), forward and backward over 1 and 4 distinct 512 px images in one call, per path:
    `eager` (activation checkpointing, autocast, transformers' attention), `eager_no_ckpt` (the tower's blocks not
    checkpointed), `compiled` (each block's forward under torch.compile, dynamic shapes) and
    `compiled_no_ckpt`. Per row: device ms, the host's ms to queue the call (from a drained queue to the call's
    return; near the device's, the host is the bound), MFU of the tower's matrix products (8 x parameters x
    patches: forward, recomputation, backward), peak extra memory; the operators of each 4-image call. `copy`:
    `eager` inside a training step (one cast copy of the weights a call, autocast off:
    gymv.backends.training.replicated_precision); `gymv`: `copy` with gymv's attention for the packed images
    (gymv.backends.vision_attention), as `gymv train` runs the tower."""
    import torch

    from gymv.backends import vision_attention
    from gymv.backends.compile_limits import lift_recompile_limit
    from gymv.backends.training.fsdp import autocast_replicated, is_vision

    base = base_policy(Path(tempfile.mkdtemp(prefix="omni_vision_")), mode)
    rows = []
    for path in paths:
        policy = build_policy(base, mode, 1, torch.float32)
        model, adapter = policy.model, policy.adapter
        model.gradient_checkpointing_enable()
        model.train()
        precision = autocast_replicated(model, "cuda", torch.bfloat16) if mode.device == "cuda" else None
        if path == "gymv":
            vision_attention.install(model)
        blocks = vision_blocks(model)
        for block in blocks:
            block.gradient_checkpointing = not path.endswith("no_ckpt")
            if path.startswith("compiled"):
                block.forward = torch.compile(block.forward, dynamic=True)
        lift_recompile_limit(8 * len(blocks), 32 * len(blocks))
        tower = sum(p.numel() for n, p in model.named_parameters() if is_vision(n))
        for n in counts:
            inputs = adapter.preprocess([image(mode, 7000 + i) for i in range(n)])
            patches = int(inputs.pixel_values.shape[0])

            def go():
                from_copy = path in ("gymv", "copy") and precision is not None
                step = precision.working_copy() if from_copy else contextlib.nullcontext()
                with step:
                    feats = adapter.image_features(model, inputs)
                    sum(f.float().pow(2).mean() for f in feats).backward()
            first = timed(mode, go)
            measured = fwd_bwd(mode, {path: go}, reps)[path]
            hosts = []
            for _ in range(reps):
                sync(mode)
                t0 = time.perf_counter()
                go()
                hosts.append(time.perf_counter() - t0)
            measured.update(first_call_s=first, host_ms=statistics.median(hosts) * 1e3)
            if "ms" in measured and mode.device == "cuda":
                measured["mfu"] = 8 * tower * patches / (measured["ms"] / 1e3) / PEAK_FLOPS
            if n == 4:
                measured["top_ops"] = op_profile(mode, go, top=25)
            model.zero_grad(set_to_none=True)
            rows.append({"layer": "vision", "path": path, "images": n, "tokens": patches, "params": tower, **measured})
            print(json.dumps({k: v for k, v in rows[-1].items() if k != "top_ops"}), flush=True)
        del policy, model
        free(mode)
    return rows


def profile_rows(mode: Mode, rows: list[dict], fns: dict) -> None:
    """The operators with the most device time in one call of each of `fns`, onto its row (by path)."""
    for path, fn in fns.items():
        row = next((r for r in rows if r["path"] == path and "error" not in r), None)
        if row is not None:
            try:
                row["top_ops"] = op_profile(mode, fn, top=20)
            except Exception as e:  # noqa: BLE001
                row["top_ops_error"] = f"{type(e).__name__}: {str(e)[:200]}"


def conv_rows(mode: Mode, tokens: int, segments: int, reps: int) -> list[dict]:
    """The Mamba-2 mixer's causal convolution alone (conv_dim channels, a slice of the input projection's
    output as in the mixer, with bias, silu and a packed row's seq_idx), forward and backward: `torch`
    (gymv.backends.ssd_scan.segment_conv1d), `triton` (gymv.backends.conv_kernel), `causal_conv1d` (when it
    imports); a path that cannot run here gets the reason."""
    import torch

    from gymv.backends import conv_kernel, mamba_kernels
    from gymv.backends.ssd_scan import segment_conv1d, seq_idx_from_bounds

    text = layer_text(mode)
    dtype = torch.bfloat16 if mode.device == "cuda" else torch.float32
    inner = text["mamba_num_heads"] * text["mamba_head_dim"]
    channels = inner + 2 * text["n_groups"] * text["ssm_state_size"]
    torch.manual_seed(0)
    proj = torch.randn(1, tokens, 2 * inner + channels + text["mamba_num_heads"], device=mode.device, dtype=dtype)
    x = proj[..., inner:inner + channels].requires_grad_()
    weight = (torch.randn(channels, text["conv_kernel"], device=mode.device) * 0.5).to(dtype).requires_grad_()
    bias = torch.randn(channels, device=mode.device, dtype=dtype).requires_grad_()
    bounds = [j * tokens // segments for j in range(segments + 1)]
    seq_idx = seq_idx_from_bounds(bounds, tokens, mode.device)
    kernels = mamba_kernels.load(mode.device)
    paths = {"torch": lambda: segment_conv1d(x, weight, bias, seq_idx, activation="silu")}
    skipped = {}
    if mode.device == "cuda" and conv_kernel.available():
        paths["triton"] = lambda: conv_kernel.segment_conv1d_triton(x, weight, bias, seq_idx, activation="silu")
    else:
        skipped["triton"] = "needs CUDA" if conv_kernel.available() else "triton is not installed"
    if kernels is not None and kernels.conv is not None:
        paths["causal_conv1d"] = lambda: mamba_kernels.causal_conv(kernels, x, weight, bias, seq_idx, "silu")
    else:
        skipped["causal_conv1d"] = "causal_conv1d is not installed" if kernels else mamba_kernels.why_not(mode.device)
    grad = torch.randn(1, tokens, channels, device=mode.device, dtype=dtype)
    timed_fns = {p: (lambda f=f: f().backward(grad)) for p, f in paths.items()}

    def forward_only(f):
        with torch.no_grad():
            f()
    timed_fns.update({f"{p}_forward": (lambda f=f: forward_only(f)) for p, f in paths.items()})
    if "triton" in paths:  # other tiles of the kernel (conv_kernel.FORWARD_TILE, BACKWARD_TILE)
        chosen = conv_kernel.FORWARD_TILE, conv_kernel.BACKWARD_TILE

        def tiled(tiles):
            conv_kernel.FORWARD_TILE, conv_kernel.BACKWARD_TILE = tiles
            try:
                paths["triton"]().backward(grad)
            finally:
                conv_kernel.FORWARD_TILE, conv_kernel.BACKWARD_TILE = chosen
        for tiles in CONV_TILES:
            if tiles != chosen:
                name = "triton_tiles_" + "_".join("x".join(map(str, t)) for t in tiles)
                timed_fns[name] = lambda tiles=tiles: tiled(tiles)
    measured = fwd_bwd(mode, timed_fns, reps)
    if "triton" in paths:  # the kernel against the torch convolution on these inputs (max error / max value)
        got, want = [], []
        for f, into in ((paths["triton"], got), (paths["torch"], want)):
            x.grad = weight.grad = bias.grad = None
            out = f()
            out.backward(grad)
            into += [t.detach().float() for t in (out, x.grad, weight.grad, bias.grad)]
        measured["triton"]["rel_error"] = {n: ((a - b).abs().max() / b.abs().max().clamp(min=1)).item()
                                           for n, a, b in zip(("out", "dx", "dweight", "dbias"), got, want)}
    rows = []
    for path, r in {**measured, **{p: {"error": f"skipped: {why}"} for p, why in skipped.items()}}.items():
        rows.append({"layer": "mamba_conv", "path": path, "tokens": tokens, "segments": segments,
                     "channels": channels, **r})
        print(json.dumps(rows[-1]), flush=True)
    return rows


def mamba_layer_rows(mode: Mode, tokens: int, segments: int, reps: int) -> list[dict]:
    """One NemotronH Mamba-2 mixer (projections, conv, scan, gated norm, out projection), forward and
    backward over a packed row of `segments` sequences of `tokens / segments` (module docstring's paths)."""
    import torch
    from transformers import NemotronHConfig
    from transformers.models.nemotron_h.modeling_nemotron_h import NemotronHMamba2Mixer

    from gymv.backends import mamba_kernels
    from gymv.backends.packed_mamba import mixer_forward
    from gymv.backends.ssd_scan import seq_idx_from_bounds

    text = layer_text(mode)
    dtype = torch.bfloat16 if mode.device == "cuda" else torch.float32
    cfg = NemotronHConfig(**{**text, "layers_block_type": ["mamba"]})
    torch.manual_seed(0)
    m = NemotronHMamba2Mixer(cfg, layer_idx=0).to(mode.device, dtype).train()
    x = torch.randn(1, tokens, text["hidden_size"], device=mode.device, dtype=dtype, requires_grad=True)
    bounds = [j * tokens // segments for j in range(segments + 1)]
    seq_idx = seq_idx_from_bounds(bounds, tokens, mode.device)
    kernels = mamba_kernels.load(mode.device)
    paths = {
        "hf_per_segment": lambda: torch.cat([m(x[:, a:b]) for a, b in zip(bounds[:-1], bounds[1:])], dim=1),
        "hf_rows": lambda: m(x.view(segments, tokens // segments, -1)),
        "gymv_torch": lambda: mixer_forward(m, x, seq_idx, None),
    }
    if kernels is not None:
        paths["gymv_triton"] = lambda: mixer_forward(m, x, seq_idx, kernels)
        if kernels.conv is None and kernels.segment_conv is not None:  # the same, its conv on torch
            torch_conv = dataclasses.replace(kernels, segment_conv=None)
            paths["gymv_triton_torch_conv"] = lambda: mixer_forward(m, x, seq_idx, torch_conv)
    fns = {p: (lambda f=f: f().float().pow(2).mean().backward()) for p, f in paths.items()}
    measured = fwd_bwd(mode, fns, reps)
    if kernels is None:
        measured["gymv_triton"] = {"error": f"skipped: {mamba_kernels.why_not(mode.device)}"}
    rows = []
    for path, r in measured.items():
        rows.append({"layer": "mamba", "path": path, "tokens": tokens, "segments": segments, **r})
        print(json.dumps(rows[-1]), flush=True)
    profile_rows(mode, rows, {p: fns[p] for p in ("gymv_triton",) if p in fns})
    return rows


def decode_limit(model, batch: int, context: int, hbm_tbps: float) -> dict:
    """The bandwidth limit of one decode step (module docstring): bytes read and the ms they take."""
    lm = model.language_model
    cfg = lm.config
    e, k = cfg.n_routed_experts, cfg.num_experts_per_tok
    touched = e * (1 - (1 - k / e) ** batch)  # routed experts at least one of `batch` rows picks, expected
    weights = experts = kv = states = 0
    for layer in lm.model.layers:
        size = {p.dtype.itemsize for p in layer.parameters()}.pop()
        routed = 0
        if KIND_OF.get(layer.block_type) == "moe":
            ex = layer.mixer.experts
            routed = ex.up_proj.numel() + ex.down_proj.numel()
            experts += routed / e * touched * size
        weights += (sum(p.numel() for p in layer.parameters()) - routed) * size
        if KIND_OF.get(layer.block_type) == "attention":
            kv += 2 * cfg.num_key_value_heads * cfg.head_dim * context * batch * size
        if KIND_OF.get(layer.block_type) == "mamba":
            mx = layer.mixer
            # fp32 SSM state read and written, the conv window in the model's dtype
            states += batch * (2 * 4 * mx.num_heads * mx.head_dim * mx.ssm_state_size + mx.conv_dim * mx.conv_kernel_size * size)
    head = lm.lm_head.weight.numel() * lm.lm_head.weight.element_size()
    total = weights + experts + kv + states + head
    return {"bytes": total, "weights_bytes": weights, "routed_expert_bytes": experts, "experts_touched": touched,
            "kv_bytes": kv, "mamba_state_bytes": states, "head_bytes": head, "hbm_tbps": hbm_tbps,
            "limit_ms": total / (hbm_tbps * 1e12) * 1e3}


def free(mode: Mode) -> None:
    import torch

    gc.collect()
    if mode.device == "cuda":
        torch.cuda.empty_cache()


def decode_requests(policy, n: int) -> list:
    """n requests: n / G prompts of about 300 tokens (chat text, no image: decode speed does not depend on
    where the prompt's tokens came from), each G times."""
    from gymv.backends.generation.base import GenerationRequest

    reqs = []
    for g in range(-(-n // GROUP)):
        words = " ".join(f"w{(g * 31 + i) % 500}" for i in range(150))
        ids = prompt_ids(policy, f"Think step by step about case {g}. {words}", [])
        reqs += [GenerationRequest(ids, [], where=f"prompt {g}")] * min(GROUP, n - g * GROUP)
    return reqs


def gymv_path(policy, mode: Mode, path: str, reqs) -> tuple[dict, object]:
    from gymv.backends.generation.base import SamplingParams
    from gymv.backends.generation.hf import HFGenerationBackend
    from gymv.backends.generation.static import StaticDecodeBackend

    if path == "gymv_hf":
        backend = HFGenerationBackend.from_policy(policy)
    else:  # static_torch: the SSM update on the torch step, chosen when the backend is built
        before = os.environ.get("GYMV_MAMBA_KERNELS")
        if path == "static_torch":
            os.environ["GYMV_MAMBA_KERNELS"] = "0"
        try:
            backend = StaticDecodeBackend.from_policy(policy, compile=None if path != "static_eager" else False)
        finally:
            os.environ.pop("GYMV_MAMBA_KERNELS", None)
            if before is not None:
                os.environ["GYMV_MAMBA_KERNELS"] = before

    def run(n):
        return lambda: backend.generate(reqs, SamplingParams(temperature=1.0, max_new_tokens=n, ignore_eos=True, seed=1))
    return {**measure(mode, run), "timing": dict(backend.last_timing)}, backend


def measure(mode: Mode, run) -> dict:
    """Seconds to generate 1 and `mode.new_tokens` tokens (medians), after a warm-up call of each; `run(n)`
    is the call that generates n."""
    first = timed(mode, run(mode.new_tokens))  # warm-up: compiles and captures this shape
    timed(mode, run(1))
    t1 = statistics.median(timed(mode, run(1)) for _ in range(3))
    tn = statistics.median(timed(mode, run(mode.new_tokens)) for _ in range(2))
    return {"first_call_s": first, "t1_s": t1, "tn_s": tn}


def hf_generate_path(policy, mode: Mode, reqs) -> dict:
    import torch

    pad = policy.tokenizer.pad_token_id or 0
    L = max(len(r.prompt_token_ids) for r in reqs)
    ids = torch.full((len(reqs), L), pad, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for b, r in enumerate(reqs):
        ids[b, L - len(r.prompt_token_ids):] = torch.tensor(r.prompt_token_ids)
        mask[b, L - len(r.prompt_token_ids):] = 1
    ids, mask = ids.to(mode.device), mask.to(mode.device)

    def run(n):
        def go():
            with torch.no_grad():
                policy.model.generate(input_ids=ids, attention_mask=mask, do_sample=True, max_new_tokens=n,
                                      min_new_tokens=n, pad_token_id=pad)
        return go
    return measure(mode, run)


def parity(policy, static, reqs) -> dict:
    """The static decoder's greedy tokens against gymv's HF loop, and its sampled logprobs against the
    trainer's (token_mult_prob_error), and both against the model in float32 (bf16's own error beside it); on
    the timed batch (its compiled shapes)."""
    import torch

    from gymv.backends.generation.base import SamplingParams
    from gymv.backends.generation.hf import HFGenerationBackend
    from gymv.backends.logprobs import right_pad, sequence_logprobs

    greedy = SamplingParams(temperature=0, max_new_tokens=32, ignore_eos=True)
    new = static.generate(reqs, greedy)
    old = HFGenerationBackend.from_policy(policy).generate(reqs, greedy)
    first = [next((j for j, (x, y) in enumerate(zip(a.token_ids, b.token_ids)) if x != y), len(a.token_ids))
             for a, b in zip(new, old)]
    outs = static.generate(reqs, SamplingParams(temperature=1.0, max_new_tokens=32, ignore_eos=True, seed=2))
    batch = right_pad([r.prompt_token_ids + o.token_ids for r, o in zip(reqs, outs)], [r.images for r in reqs],
                      policy.tokenizer.pad_token_id)
    with torch.no_grad():
        train_lp = sequence_logprobs(policy.model, policy.adapter, batch, temperature=1.0).float().cpu()
    # bf16's own noise: both paths against the same model in float32 on the same tokens. On random weights
    # with many experts rounding flips top-k choices; an error as large as the trainer's own is bf16's
    lp32 = float32_logprobs(policy, batch)

    def rows(lp):
        return [lp[b, len(r.prompt_token_ids):len(r.prompt_token_ids) + len(o.token_ids)]
                for b, (r, o) in enumerate(zip(reqs, outs))]

    def error(a, b) -> float | None:
        return None if a is None or b is None else torch.exp((torch.cat(a) - torch.cat(b)).abs()).mean().item()

    ours, f32 = [torch.tensor(o.logprobs) for o in outs], (rows(lp32) if lp32 is not None else None)
    return {"greedy_first_divergence_per_prompt": first[::GROUP], "greedy_tokens": len(new[0].token_ids),
            "token_mult_prob_error": error(ours, rows(train_lp)),
            "static_vs_float32_token_mult_prob_error": error(ours, f32),
            "trainer_vs_float32_token_mult_prob_error": error(rows(train_lp), f32)}


def float32_logprobs(policy, batch):
    """The trainer's logprobs of `batch` with the model cast to float32 in place and back (bf16 -> float32 ->
    bf16 is exact; each tensor returns to its own dtype, the routers' float32 gates included); None where the
    float32 copy does not fit."""
    import torch

    from gymv.backends.logprobs import sequence_logprobs

    model = policy.model
    tensors = [*model.parameters(), *model.buffers()]
    dtypes = [t.dtype for t in tensors]
    # transformers casts the pictures to the vision config's dtype
    configs = list({id(m.config): m.config for m in model.modules() if hasattr(m, "config")}.values())
    config_dtypes = [getattr(c, "dtype", None) for c in configs]
    try:
        for t in tensors:
            if t.is_floating_point():
                t.data = t.data.float()
        for c in configs:
            c.dtype = torch.float32
        with torch.no_grad():
            return sequence_logprobs(model, policy.adapter, batch, temperature=1.0).float().cpu()
    except torch.OutOfMemoryError:
        return None
    finally:
        for t, dtype in zip(tensors, dtypes):
            t.data = t.data.to(dtype)
        for c, dtype in zip(configs, config_dtypes):
            c.dtype = dtype
        if torch.cuda.is_available():
            torch.cuda.empty_cache()


def decode(base, mode: Mode, layers: int, a, result: dict, save) -> None:
    import torch

    dtype = torch.bfloat16 if mode.device == "cuda" else torch.float32
    policy = build_policy(base, mode, layers, dtype)
    reqs = decode_requests(policy, a.decode_batch)
    result["decode"] = {"layers": layers, "pattern": PATTERN[:layers], "batch": a.decode_batch,
                        "new_tokens": mode.new_tokens, "prompt_tokens": len(reqs[0].prompt_token_ids),
                        "params": param_counts(policy.model), "rows": [],
                        "limit": decode_limit(policy.model, a.decode_batch,
                                              len(reqs[0].prompt_token_ids) + mode.new_tokens // 2,
                                              a.hbm_tbps or hbm_tbps(result.get("device", "")))}
    for path in a.paths.split(","):
        row = {"path": path}
        if time.time() - a.t0 > a.budget_s:
            row["error"] = "skipped: time budget"
            result["decode"]["rows"].append(row)
            continue
        try:
            if path == "hf_generate":
                row.update(hf_generate_path(policy, mode, reqs))
            else:
                r, backend = gymv_path(policy, mode, path, reqs)
                row.update(r)
                if a.profile and path.startswith("static"):  # where a decode call's device time goes, by kernel
                    from gymv.backends.generation.base import SamplingParams

                    row["top_ops"] = op_profile(mode, lambda: backend.generate(reqs, SamplingParams(
                        temperature=1.0, max_new_tokens=mode.new_tokens, ignore_eos=True, seed=1)))
                if path == "static" and not a.no_parity:
                    row["parity"] = parity(policy, backend, reqs)
                if hasattr(backend, "drop_graphs"):
                    backend.drop_graphs()
                del backend
            row["ms_per_step"] = (row["tn_s"] - row["t1_s"]) / (mode.new_tokens - 1) * 1e3
            row["tokens_per_s"] = a.decode_batch / row["ms_per_step"] * 1e3
            row["x_bandwidth_limit"] = row["ms_per_step"] / result["decode"]["limit"]["limit_ms"]
        except Exception as e:  # noqa: BLE001 - a benchmark reports and goes on
            row["error"] = f"{type(e).__name__}: {str(e)[:400]}"
            traceback.print_exc()
        free(mode)
        result["decode"]["rows"].append(row)
        print(json.dumps({k: v for k, v in row.items() if k != "timing"}), flush=True)
        save()
    del policy
    free(mode)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, required=True, help="scratch directory (the base checkpoint)")
    ap.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    ap.add_argument("--json", type=Path, help="results file (default: see the module docstring)")
    ap.add_argument("--train-layers", default="", help="depths to try, largest first, until one fits "
                                                       "(default 9,7,4 on CUDA, 6 on CPU; 0: no training)")
    ap.add_argument("--decode-layers", type=int, help="depth of the decode model (default 52: all, on CUDA; 6 on CPU)")
    ap.add_argument("--backend", default="fsdp2",
                    help=f"trainer backends, comma-separated, each in turn at the depth that fits: {BACKENDS} "
                         "(fsdp2-keep: the gathered bf16 weights kept from forward to backward, no second gather)")
    ap.add_argument("--groups", type=int, help="GRPO groups of 8 samples per step (default 4 on CUDA, 2 on CPU)")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--micro-batch-tokens", type=int, default=16384)
    ap.add_argument("--no-vision-checkpointing", action="store_true",
                    help="train: training.vision_checkpointing false (the tower's activations kept, not recomputed)")
    ap.add_argument("--whole-rows", action="store_true",
                    help="train: pack every sequence whole (each sample repeats its group's prompt), for comparison")
    ap.add_argument("--adam16", action="store_true",
                    help="AdamW's moments in bfloat16 (training.optimizer_state_dtype): room for the torch "
                         "backend's copy")
    ap.add_argument("--decode-batch", type=int, default=DECODE_BATCH)
    ap.add_argument("--paths", default="static,static_torch,hf_generate,static_eager,gymv_hf")
    ap.add_argument("--train-paths", default="gymv,hf", help="trainer paths: gymv, megatron, hf, hf_grouped_mm")
    ap.add_argument("--part", default="all", choices=["all", "layers", "train", "decode"],
                    help="all: each part (and each train path) in a process of its own, results merged")
    ap.add_argument("--layer-tokens", type=int, help="tokens of the layers part (default 16384 on CUDA, 4096 on CPU)")
    ap.add_argument("--layer-reps", type=int, default=5)
    ap.add_argument("--vision-paths", default=",".join(VISION_PATHS), help=f"the vision rows' paths: {VISION_PATHS}")
    ap.add_argument("--layer-kinds", default="moe,conv,mamba,vision",
                    help="the layers part's rows: moe, conv, mamba, vision (the RADIO tower, 1-8 images)")
    ap.add_argument("--profile", action="store_true", help="the trainer step's time by layer kind (the megatron "
                    "path and the static decoder: the operators with the most device time)")
    ap.add_argument("--hbm-tbps", type=float, help="HBM bandwidth for the decode limit (default: the card's, "
                    f"by name: {HBM_TBPS}; an H200's for another card)")
    ap.add_argument("--no-parity", action="store_true")
    ap.add_argument("--budget-s", type=float, default=400.0, help="start no decode path after this many seconds")
    a = ap.parse_args()
    import torch
    import transformers

    if a.device == "cuda" and not torch.cuda.is_available():
        sys.exit("no CUDA device: run with --device cpu for the tiny check")
    if not hasattr(transformers, "NemotronH_Omni_Reasoning_V3"):
        sys.exit(f"transformers {transformers.__version__} has no NemotronH_Omni_Reasoning_V3: install 5.24 or later")
    mode = mode_for(a.device)
    cuda = a.device == "cuda"
    train_layers = [int(x) for x in (a.train_layers or ("9,7,4" if cuda else "6")).split(",") if int(x) > 0]
    backends = [b for b in a.backend.split(",") if b]
    if not backends or set(backends) - set(BACKENDS):
        sys.exit(f"--backend: {a.backend!r}; choose from {BACKENDS}, comma-separated")
    a.groups = a.groups or (4 if cuda else 2)
    decode_layers = a.decode_layers or (len(PATTERN) if cuda else 6)
    a.out.mkdir(parents=True, exist_ok=True)
    out_json = a.json or (Path(__file__).parent / "results" / "gpu_nemotron_omni_h200.json" if cuda
                          else a.out / "gpu_nemotron_omni.json")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    t0 = a.t0 = time.time()
    result = {"device": torch.cuda.get_device_name(0) if cuda else "cpu", "torch": torch.__version__,
              "transformers": transformers.__version__, "peak_flops": PEAK_FLOPS, "text_config": mode.text,
              "vision_config": mode.vision, "omni": mode.omni, "train": [], "decode": None}

    def save():
        result["wall_s"] = time.time() - t0
        out_json.parent.mkdir(parents=True, exist_ok=True)
        out_json.write_text(json.dumps(result, indent=2))

    print(f"{result['device']}, torch {torch.__version__}, transformers {transformers.__version__}", flush=True)
    if a.part == "all":
        run_parts(a, result, save)
        save()
        report(result, out_json)
        return
    result["layers"] = []
    if a.part == "layers":
        layer_rows(a, mode, result, save)
        save()
        report(result, out_json)
        return
    if a.part == "train" and len(train_layers) > 1:
        train_depths(a, train_layers, result, save)
        report(result, out_json)
        return
    base = base_policy(a.out, mode)
    for layers in train_layers if a.part == "train" else ():
        rows = [train_row(base, mode, layers, a, backend) for backend in backends]
        result["train"] += rows
        save()
        if "out of memory" not in rows[0].get("error", ""):
            break
    if a.part == "decode":
        decode(base, mode, decode_layers, a, result, save)
    save()
    report(result, out_json)


def train_row(base, mode: Mode, layers: int, a, backend: str) -> dict:
    """One trainer configuration's row, or its error (printed as it ends)."""
    import torch

    try:
        row = train(base, mode, layers, a, a.train_paths.split(",")[0], backend)
    except torch.OutOfMemoryError as e:
        row = {"layers": layers, "backend": backend, "error": f"out of memory: {str(e)[:200]}"}
    except Exception as e:  # noqa: BLE001
        row = {"layers": layers, "backend": backend, "error": f"{type(e).__name__}: {str(e)[:400]}",
               "trace": traceback.format_exc()[-2000:]}
    free(mode)
    print(json.dumps({k: v for k, v in row.items() if k not in ("trace", "step_s_all", "params")}), flush=True)
    return row


def layer_rows(a, mode: Mode, result: dict, save) -> None:
    """The layers part: the kinds `--layer-kinds` names, each saved as it ends."""
    import torch

    cuda = mode.device == "cuda"
    tokens = a.layer_tokens or (16384 if cuda else 4096)
    if not cuda:  # one thread: on a shared CPU, more threads than free cores make every figure noise
        torch.set_num_threads(1)
        result["cpu_threads"] = 1
    kinds = {k.strip() for k in a.layer_kinds.split(",") if k.strip()}
    unknown = kinds - {"moe", "conv", "mamba", "vision"}
    if unknown:
        sys.exit(f"--layer-kinds: unknown {sorted(unknown)} (moe, conv, mamba, vision)")
    parts = [("moe", lambda: moe_layer_rows(mode, tokens, a.layer_reps)),
             ("conv", lambda: conv_rows(mode, tokens, 8, a.layer_reps)),
             ("mamba", lambda: mamba_layer_rows(mode, tokens, 8, a.layer_reps)),
             ("vision", lambda: vision_rows(mode, a.layer_reps, paths=tuple(a.vision_paths.split(","))))]
    for kind, rows_of in parts:
        if kind in kinds:
            result["layers"] += rows_of()
            save()


def child_argv(drop: tuple[str, ...]) -> list[str]:
    """This run's command-line options less those in `drop` (each with its value)."""
    argv, skip = [], False
    for arg in sys.argv[1:]:
        if skip:
            skip = False
        elif arg in drop:
            skip = True
        elif not arg.startswith(tuple(f"{d}=" for d in drop)):
            argv.append(arg)
    return argv


def train_depths(a, depths: list[int], result: dict, save) -> None:
    """Each depth in a fresh interpreter, largest first, until one does not run out of memory: in one process a
    depth that ran out of memory leaves enough allocated to sink the smaller ones after it."""
    argv = child_argv(("--train-layers", "--json"))
    for layers in depths:
        out = a.out / f"train_{a.train_paths.split(',')[0]}_{layers}.json"
        cmd = [sys.executable, str(Path(__file__).resolve()), *argv, "--train-layers", str(layers), "--json", str(out)]
        print("$", " ".join(cmd[1:]), flush=True)
        code = subprocess.run(cmd).returncode
        rows = json.loads(out.read_text()).get("train") if out.exists() else None
        if not rows:
            rows = [{"layers": layers, "error": f"exit {code}, no results"}]
        result["train"] += rows
        save()
        if "out of memory" not in rows[-1].get("error", ""):
            return


def run_parts(a, result: dict, save) -> None:
    """Each part in a fresh interpreter (one starves the next of memory in one process), merged into `result`:
    the layers, the trainer once per train path, the decoder."""
    argv = child_argv(("--part", "--json", "--train-paths"))  # the part and results file each child gets its own
    result["layers"] = []
    jobs = [("layers", [])] + [("train", ["--train-paths", p]) for p in a.train_paths.split(",") if p] + [("decode", [])]
    for part, extra in jobs:
        if part == "train" and a.train_layers.strip() == "0":
            continue
        out = a.out / f"part_{part}{'_' + extra[1] if extra else ''}.json"
        cmd = [sys.executable, str(Path(__file__).resolve()), *argv, "--part", part, "--json", str(out), *extra]
        print("$", " ".join(cmd[1:]), flush=True)
        code = subprocess.run(cmd).returncode
        if not out.exists():
            result.setdefault("errors", []).append(f"{part} {' '.join(extra)}: exit {code}, no results")
            continue
        got = json.loads(out.read_text())
        result["layers"] += got.get("layers") or []
        result["train"] += got.get("train") or []
        result["decode"] = got.get("decode") or result["decode"]
        save()


def report(result: dict, out_json: Path) -> None:
    for r in result.get("layers") or []:
        if "error" in r:
            print(f"layer {r['layer']:<11} {r['path']:<15} {r['error'][:100]}")
            continue
        extra = f", MFU {r['mfu']:.1%}" if r.get("mfu") else ""
        mem = f", +{r['peak_extra_gb']:.1f} GB" if "peak_extra_gb" in r else ""
        if r.get("rel_error"):
            extra += f", largest error against torch {max(r['rel_error'].values()):.1e}"
        what = "fwd" if r["path"].endswith("_forward") else "fwd+bwd"
        if "host_ms" in r:
            extra += f", host {r['host_ms']:.1f} ms"
        label = f"{r['path']} {r['images']} img" if "images" in r else r["path"]
        print(f"layer {r['layer']:<11} {label:<15} {r['tokens']} tokens {what}: {r['ms']:.1f} ms{extra}{mem}")
        if r.get("top_ops"):
            print("      top operators: " + ", ".join(f"{o['op'][:40]} {o['self_ms']:.1f} ms ({o['share']:.0%})"
                                                    for o in r["top_ops"][:8]))
    for r in result["train"]:
        if "error" in r:
            print(f"train {r['layers']} layers: {r['error'][:100]}")
            continue
        mem = f"{r['peak_mem_gb']:.1f} GB" if "peak_mem_gb" in r else "-"
        rows = "prompts shared" if r.get("shared_prompts") else "whole rows"
        rows += "" if r.get("vision_checkpointing", True) else ", tower not recomputed"
        print(f"train {r.get('path', 'gymv')} {r.get('backend', '')} {r['layers']} layers {r['pattern']} ({rows}, "
              f"{r.get('micro_batches')} micro-batches): {r['step_s']:.2f} s/step, {r['tokens_per_s']:.0f} tok/s, "
              f"{r['unique_tokens_per_s']:.0f} unique tok/s, MFU {r['mfu']:.1%} (active params), peak {mem}")
        if r.get("logprobs_against_hf"):
            g = r["logprobs_against_hf"]
            print(f"      logprobs against HF ({g['precision']}, {g['tokens']} tokens): token_mult_prob_error "
                  f"{g['token_mult_prob_error']:.4f}, largest difference {g['max_abs_diff']:.3f}")
        prof = r.get("profile_s_by_kind")
        if isinstance(prof, dict) and prof.get("top_ops"):
            print("      top operators: " + ", ".join(f"{o['op']} {o['self_ms']:.1f} ms ({o['share']:.0%})"
                                                    for o in prof["top_ops"][:8]))
        if isinstance(prof, dict) and "device_busy" in prof:
            print(f"      profiled step {prof['profiled_wall_s']:.3f} s, device busy {prof['device_s']:.3f} s "
                  f"({prof['device_busy']:.0%})")
    d = result["decode"] or {"rows": []}
    if d.get("limit"):
        lim = d["limit"]
        print(f"decode bandwidth limit: {lim['limit_ms']:.2f} ms/step ({lim['bytes'] / 1e9:.2f} GB a step at "
              f"{lim['hbm_tbps']} TB/s; {lim['experts_touched']:.1f} routed experts touched per MoE layer)")
    for r in d["rows"]:
        if "error" in r:
            print(f"decode {r['path']:<13} {r['error'][:100]}")
        else:
            print(f"decode {r['path']:<13} batch {d['batch']}: {r['ms_per_step']:.2f} ms/step, "
                  f"{r['tokens_per_s']:.0f} tok/s (first call {r['first_call_s']:.1f} s)")
            if r.get("top_ops"):
                print("      top operators: " + ", ".join(f"{o['op']} {o['self_ms']:.1f} ms ({o['share']:.0%})"
                                                        for o in r["top_ops"][:8]))
            if r.get("parity"):
                q = r["parity"]
                f32 = (f"; against float32: the static decoder {q['static_vs_float32_token_mult_prob_error']:.4f}, "
                       f"the trainer {q['trainer_vs_float32_token_mult_prob_error']:.4f}"
                       if q.get("static_vs_float32_token_mult_prob_error") else "")
                print(f"      against the trainer's logprobs: token_mult_prob_error {q['token_mult_prob_error']:.4f}"
                      f"{f32}; greedy first divergence per prompt {q['greedy_first_divergence_per_prompt']} of "
                      f"{q['greedy_tokens']}")
    print(f"wrote {out_json} in {result['wall_s']:.0f} s")


if __name__ == "__main__":
    main()
