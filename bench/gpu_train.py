"""GRPO training throughput of the fsdp2 backend: the trainer alone, on synthetic rollouts, per layout.

Builds models in memory on the device (random init; tokenizer, processor and chat template of a locally
written tiny checkpoint of the family): `0.8b` is the LLaVA shape of gpu_decode.py (hidden 2048, 16 layers,
vocab 1024, its 4-layer CLIP tower), `3b` a LLaVA with the language config of Qwen2.5-VL-3B (hidden 2048,
36 layers, 16 heads, 2 KV heads, intermediate 11008, vocab 151936, untied head), `7b` Qwen2.5-VL-7B's own
config (language and vision tower; 3-D rotary positions). Rollouts: groups of G=8 samples sharing a prompt
(one image of 256 image tokens, plus chat text of varying length) with response lengths drawn from a
log-normal (median 300 tokens, clipped to 16..1536), random advantages, the GRPO clipped policy loss.

Per run (backend, sequence packing on/off, activation checkpointing on/off), after one warm-up step, the
median of the timed optimizer steps (`train_step` only: no generation, no logprob pass) gives the figures
below. Packing on: packed rows in which each group's prompt runs once (gymv.backends.packing), so the
trainer computes the unique tokens; off: padded micro-batches (fsdp2 has no shared-prompt path there, so
every sample's prompt is computed; torch runs each group's prompt once and its completions on that KV
cache, padded to the longest: the path before packing).
  tokens_per_s         every token of every sample (what the trainer sees)
  unique_tokens_per_s  each group's shared prompt counted once
  mfu                  6 * N * D_unique / time / peak, N = the language model's non-embedding parameters
                       without the LM head (decoder layers and final norm), plus 6 * N_head * D_generated
                       for the head, which runs on generated tokens only; vision tower not counted;
                       peak = 989e12 FLOP/s per H200 (bf16 dense) times the ranks
  mfu_all_tokens       the same with D = every token
  peak_mem_gb          torch.cuda.max_memory_allocated on rank 0
Before the runs, `parity`: packed against padded logprobs of the same weights (bf16 autocast).

--ranks N spawns N processes (NCCL on 127.0.0.1, one GPU each); the groups are split over the ranks.

--compile off|on|both runs each run eager, with training.compile (each decoder layer compiled), or both;
`first_step_s` is the warm-up step (with compile: the compilation). --runs picks runs by name
(`<shape>-<backend>-packed|padded[-ckpt]`), `@TOKENS` sets micro_batch_tokens, `:eager` or `:compile` one
variant, `:keep` training.fsdp.reshard_after_forward false, `:adam16` AdamW moments in bfloat16
(training.optimizer_state_dtype), `:nodefer` gradients reduced after every micro-batch on one rank, `:autocast`
the torch backend without its working copy (training.weight_copy false).
computed_tokens_rank0: the tokens rank 0's forward passes run
(packed rows' lengths, or padded rows x longest), to check that each group's prompt runs once.

Usage: python bench/gpu_train.py --out DIR [--shapes 0.8b,3b,7b] [--runs SPEC] [--compile off|on|both]
                                 [--ranks 1] [--steps 3] [--budget-s 170] [--profile [compile]] [--trace]
       python bench/gpu_train.py --out DIR --cpu-smoke     (tiny shapes, fp32, CPU: checks the script)
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import math
import os
import socket
import statistics
import sys
import time
import traceback
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

PEAK_FLOPS = 989e12  # H200 bf16 dense, per GPU
RESULT_NAME = "gpu_train.json"
# the base checkpoints (tokenizer, processor, chat template; tiny text model) every shape of a family builds on
BASES = {
    "llava": dict(vision_hidden=256, vision_layers=4, vision_heads=4, image_size=224, patch_size=14),
    "qwen2_5vl": dict(vision_hidden=64, vision_layers=2, vision_heads=4, image_size=448, patch_size=14),
}
SMOKE_BASES = {
    "llava": dict(vision_hidden=32, vision_layers=1, vision_heads=4, image_size=56, patch_size=14),
    "qwen2_5vl": dict(vision_hidden=32, vision_layers=2, vision_heads=4, image_size=56, patch_size=14),
}
IMAGE_SIDE = {"llava": 224, "qwen2_5vl": 448}  # 256 image tokens each (Qwen2.5-VL: 32x32 patches merged 2x2)
# shape -> (family, text config, vision config overrides)
SHAPES = {
    "0.8b": ("llava", dict(hidden_size=2048, num_hidden_layers=16, num_attention_heads=16, num_key_value_heads=8,
                           intermediate_size=5632, vocab_size=1024), {}),
    "3b": ("llava", dict(hidden_size=2048, num_hidden_layers=36, num_attention_heads=16, num_key_value_heads=2,
                         intermediate_size=11008, vocab_size=151936), {}),
    # Qwen2.5-VL-7B-Instruct's config (random init)
    "7b": ("qwen2_5vl", dict(hidden_size=3584, num_hidden_layers=28, num_attention_heads=28, num_key_value_heads=4,
                             intermediate_size=18944, vocab_size=152064, mrope_section=[16, 24, 24]),
           dict(depth=32, hidden_size=1280, intermediate_size=3420, num_heads=16, out_hidden_size=3584,
                window_size=112, fullatt_block_indexes=[7, 15, 23, 31])),
}
SMOKE_SHAPES = {
    "0.8b": ("llava", dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                           intermediate_size=128, vocab_size=1024), {}),
    "3b": ("llava", dict(hidden_size=64, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=1,
                         intermediate_size=160, vocab_size=2048), {}),
    "7b": ("qwen2_5vl", dict(hidden_size=64, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
                             intermediate_size=160, vocab_size=2048, mrope_section=[2, 3, 3]),
           dict(depth=2, hidden_size=32, intermediate_size=64, num_heads=4, out_hidden_size=64)),
}
GROUP = 8
# (shape, backend, sequence_packing, gradient_checkpointing, groups per step and rank)
RUNS = [  # most telling first: a run that would start after --budget-s is skipped
    ("0.8b", "fsdp2", True, False, 16),
    ("0.8b", "fsdp2", False, False, 16),
    ("3b", "fsdp2", True, True, 8),
    ("7b", "fsdp2", True, True, 6),
    ("7b", "fsdp2", False, True, 6),
    ("0.8b", "fsdp2", True, True, 16),
    ("0.8b", "torch", False, False, 16),  # padded, each group's prompt once through its KV cache: the old path
    ("0.8b", "torch", True, False, 16),
    ("0.8b", "fsdp2", False, True, 16),
]


def rollouts(policy, groups: int, seed: int, smoke: bool) -> list[dict]:
    """GRPO samples: G per prompt, each prompt an image and chat text, responses of log-normal length."""
    import numpy as np
    from PIL import Image

    from gymv.backends.training.samples import training_sample

    rng = np.random.default_rng(seed)
    family = "qwen2_5vl" if policy.adapter.style == "grid" else "llava"
    side = SMOKE_BASES[family]["image_size"] if smoke else IMAGE_SIDE[family]
    forbidden = set(policy.adapter.vision_token_ids)
    vocab = [t for t in range(3, len(policy.tokenizer)) if t not in forbidden]
    out = []
    for g in range(groups):
        image = Image.fromarray(rng.integers(0, 255, (side, side, 3), dtype=np.uint8))
        words = " ".join(f"w{int(x)}" for x in rng.integers(0, 500, int(rng.integers(20, 120))))
        content = [{"type": "image"}, {"type": "text", "text": f"Count the circles. {words}"}]
        rendered = policy.tokenizer.apply_chat_template([{"role": "user", "content": content}], tokenize=False,
                                                        add_generation_prompt=True, chat_template=policy.chat_template)
        prompt = policy.adapter.encode_text(rendered, [image])
        for _ in range(GROUP):
            n = int(np.clip(rng.lognormal(math.log(300 if not smoke else 20), 0.6), 4 if smoke else 16,
                            60 if smoke else 1536))
            gen = [vocab[int(i)] for i in rng.integers(0, len(vocab), n)]
            ids = prompt + gen
            out.append(training_sample(ids, [0] * len(prompt) + [1] * n, images=[image], where=f"group {g}",
                                       logp_behaviour=[0.0] * len(prompt) + list(-rng.exponential(1.0, n)),
                                       advantage=float(rng.normal())))
    return out


def shaped_config(config, shape_name: str, smoke: bool):
    """`config` (a family base's, changed in place and returned) with the text and vision sizes of the shape."""
    _, text, vision = (SMOKE_SHAPES if smoke else SHAPES)[shape_name]
    for k, v in text.items():
        if k == "mrope_section":
            config.text_config.rope_parameters["mrope_section"] = v
        else:
            setattr(config.text_config, k, v)
    config.text_config.head_dim = text["hidden_size"] // text["num_attention_heads"]
    if getattr(config.text_config, "layer_types", None) is not None:
        config.text_config.layer_types = ["full_attention"] * text["num_hidden_layers"]
    for k, v in vision.items():
        setattr(config.vision_config, k, v)
    return config


def build_policy(bases: dict, shape_name: str, device: str, seed: int, smoke: bool):
    """The family's base policy with its model replaced by a random one of the shape, built on `device`
    (fp32 master weights)."""
    import copy

    import torch
    import transformers

    family = (SMOKE_SHAPES if smoke else SHAPES)[shape_name][0]
    base = bases[family]
    config = shaped_config(copy.deepcopy(base.model.config), shape_name, smoke)
    cls = getattr(transformers, type(base.model).__name__)
    torch.manual_seed(seed)
    with torch.device(device):
        model = cls(config).float()
    return dataclasses.replace(base, model=model)


def param_counts(model) -> dict:
    lm = model.model.language_model
    embed = sum(p.numel() for p in lm.embed_tokens.parameters())
    decoder = sum(p.numel() for p in lm.parameters()) - embed
    head = sum(p.numel() for p in model.lm_head.parameters())
    vision = sum(p.numel() for p in model.parameters()) - decoder - embed - head
    return {"decoder": decoder, "embedding": embed, "head": head, "vision": vision}


def run_name(run) -> str:
    shape, backend, packing, ckpt, _ = run
    return f"{shape}-{backend}-{'packed' if packing else 'padded'}{'-ckpt' if ckpt else ''}"


# profiler rows (kernel and op names) by kind, to sum a step's device time
KINDS = [("matmul", ("gemm", "matmul", "aten::mm", "aten::addmm", "aten::bmm", "cutlass", "sm90_xmma", "nvjet")),
         ("attention", ("flash", "attn", "fmha", "attention")),
         ("compiled (triton)", ("triton_",)),
         ("communication", ("nccl",)),
         ("optimizer", ("adam", "foreach", "multi_tensor")),
         ("dtype copies", ("copy_", "_to_copy", "cast", "convert")),
         ("indexing", ("index", "gather", "scatter")),
         ("elementwise", ("elementwise", "mul", "add", "silu", "pow", "rsqrt", "neg", "cat", "where", "exp", "sub",
                          "div", "mean", "sum", "reduce"))]


def profile_summary(averages, key: str, limit: int = 25, kernels_only: bool = False) -> dict:
    """The profiled step's device (or CPU) time: the top rows by self time and a sum per kind of kernel.
    `kernels_only`: device kernels alone (an operator's self device time repeats its kernels' time)."""
    from torch.autograd import DeviceType

    def collect(skip_host_ops: bool) -> list[dict]:
        rows = []
        for e in averages:
            if skip_host_ops and getattr(e, "device_type", None) == DeviceType.CPU:
                continue
            t = getattr(e, key, 0.0) or 0.0
            if t > 0:
                rows.append({"name": e.key, "self_ms": t / 1e3, "calls": e.count})
        return rows

    rows = collect(kernels_only) or collect(False)
    rows.sort(key=lambda r: -r["self_ms"])
    kinds: dict[str, float] = {}
    for r in rows:
        name = r["name"].lower()
        kind = next((k for k, words in KINDS if any(w in name for w in words)), "other")
        kinds[kind] = kinds.get(kind, 0.0) + r["self_ms"]
    total = sum(r["self_ms"] for r in rows)
    return {"by": key, "total_self_ms": total, "by_kind_ms": dict(sorted(kinds.items(), key=lambda kv: -kv[1])),
            "top": rows[:limit]}


# :adam16 training.optimizer_state_dtype bfloat16; :nodefer training.fsdp.defer_gradient_reduction false;
# :autocast training.weight_copy false (the torch backend casts each weight at each use)
EXTRA_OPTIONS = ("adam16", "nodefer", "autocast")


def select_runs(spec: str, shapes: list[str], variants: list[bool]) -> list[tuple]:
    """(run, compile, micro_batch_tokens or None, keep_gathered) to measure, in order. `spec`: comma-separated
    `NAME[@TOKENS][:eager|:compile][:keep]` (TOKENS: micro_batch_tokens instead of the default; without
    eager/compile, each of `variants`; keep: training.fsdp.reshard_after_forward false, the gathered weights
    kept from forward to backward); empty: every run of `shapes`, each variant."""
    if not spec:
        return [(run, c, None, False, frozenset()) for run in RUNS if run[0] in shapes for c in variants]
    by_name = {run_name(run): run for run in RUNS}
    out = []
    for item in spec.split(","):
        head, *options = item.split(":")
        name, _, tokens = head.partition("@")
        if name not in by_name or not set(options) <= {"eager", "compile", "keep", *EXTRA_OPTIONS}:
            sys.exit(f"--runs: unknown run {item!r} (known: {', '.join(by_name)}; options :eager, :compile, :keep, "
                     f"{', '.join(':' + o for o in EXTRA_OPTIONS)})")
        modes = [o == "compile" for o in options if o in ("eager", "compile")] or variants
        extra = frozenset(o for o in options if o in EXTRA_OPTIONS)
        out += [(by_name[name], c, int(tokens) if tokens else None, "keep" in options, extra) for c in modes]
    return out


def computed_tokens(backend, batch) -> int:
    """Tokens the trainer's forward actually runs: the packed rows' lengths (each group's prompt once per row it
    lands in), or the padded micro-batches' rows x longest sample."""
    from gymv.backends.logprobs import packed_prefixes
    from gymv.backends.packing import pack

    layout = backend.trainer.plan_fn.__self__
    total = 0
    for indices in backend.trainer._plan(batch):
        mb = layout.collate([batch[i] for i in indices])
        if not layout.packed:
            total += int(mb["input_ids"].numel())
            continue
        share = packed_prefixes(mb["input_ids"], mb["loss_mask"], mb["images"], layout.adapter.image_token_id) \
            if layout.shares_in_row else None
        total += int(pack(mb["input_ids"], mb["attention_mask"], mb["images"], share).input_ids.numel())
    return total


def recorded_memory_phases(backend, batch: list, loss) -> dict:
    """`memory_phases` of one more step; with GYMV_BENCH_MEM_SNAPSHOT set (a path), the allocator's history of
    that step written there, gzipped."""
    import torch

    snapshot = os.environ.get("GYMV_BENCH_MEM_SNAPSHOT")
    if snapshot:
        torch.cuda.memory._record_memory_history(max_entries=200_000)
    phases = memory_phases(backend, batch, loss)
    if snapshot:
        import gzip
        import pickle

        with gzip.open(snapshot, "wb") as fh:
            pickle.dump(torch.cuda.memory._snapshot(), fh)
        torch.cuda.memory._record_memory_history(enabled=None)
    return phases


def phase_busy(events, spans: list[tuple[float, float]]) -> dict:
    """Per `gymv/*` range of the step (gymv.backends.training.torch_trainer's phases): its host milliseconds and
    the milliseconds of that window in which the device ran something; `before_first_kernel_ms`: how long the
    device waited from the step's first host event to its first kernel (host work nothing overlaps)."""
    from torch.autograd import DeviceType

    host = [e for e in events if e.device_type == DeviceType.CPU]
    out: dict = {}
    for e in host:
        if not e.name.startswith("gymv/"):
            continue
        a, b = e.time_range.start, e.time_range.end
        row = out.setdefault(e.name, {"host_ms": 0.0, "device_busy_ms": 0.0, "calls": 0})
        row["host_ms"] += (b - a) / 1e3
        row["device_busy_ms"] += union_us([(max(x, a), min(y, b)) for x, y in spans if y > a and x < b]) / 1e3
        row["calls"] += 1
    if host and spans:
        out["before_first_kernel_ms"] = (min(x for x, _ in spans) - min(e.time_range.start for e in host)) / 1e3
    return {k: ({kk: round(vv, 3) for kk, vv in v.items()} if isinstance(v, dict) else round(v, 3))
            for k, v in out.items()}


def device_spans(events) -> list[tuple[float, float]]:
    """(start, end) microseconds of each kernel or copy the device ran in a profile (ranges' device-side copies
    left out: they would cover their kernels twice)."""
    from torch.autograd import DeviceType

    return [(e.time_range.start, e.time_range.end) for e in events
            if e.device_type != DeviceType.CPU and not getattr(e, "is_user_annotation", False)]


def union_us(spans: list[tuple[float, float]]) -> float:
    """The length of the union of (start, end) intervals: time in which at least one of them ran."""
    length, end = 0.0, float("-inf")
    for a, b in sorted(spans):
        if b > end:
            length += b - max(a, end)
            end = b
    return length


def profiled_step(backend, batch: list, loss, device: str, trace: str | None, label: str) -> dict:
    """One training step under torch.profiler: its tables printed, the top operators by device and by host time
    returned, on CUDA with each trainer phase's host and device-busy time (`phase_busy`), and with `trace` its
    timeline written gzipped (chrome://tracing, Perfetto)."""
    import torch
    from torch.profiler import ProfilerActivity, profile as torch_profile

    cuda = device.startswith("cuda")
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with torch_profile(activities=activities) as prof:
        backend.train_step(batch, loss)
        if cuda:
            torch.cuda.synchronize()
    if trace:
        import gzip
        import shutil

        prof.export_chrome_trace(trace)
        with open(trace, "rb") as src, gzip.open(trace + ".gz", "wb") as dst:
            shutil.copyfileobj(src, dst)
        os.remove(trace)
    averages = prof.key_averages()
    key = "self_cuda_time_total" if cuda else "self_cpu_time_total"
    print(f"profile of one step of {label}, by {key}:", flush=True)
    print(averages.table(sort_by=key, row_limit=18, max_name_column_width=60), flush=True)
    print("by cpu_time_total:", flush=True)
    print(averages.table(sort_by="cpu_time_total", row_limit=18, max_name_column_width=60), flush=True)
    attr = "self_device_time_total" if cuda else "self_cpu_time_total"
    out = {"device": profile_summary(averages, attr, kernels_only=cuda),
           "host": profile_summary(averages, "cpu_time_total", 15)}
    if cuda:
        out["phases"] = phase_busy(prof.events(), device_spans(prof.events()))
    return out


def one_run(run, base: dict, rank: int, world: int, device: str, steps: int, seed: int, smoke: bool,
            profile: bool = False, compile_layers: bool = False, micro_batch_tokens: int | None = None,
            keep_gathered: bool = False, trace: str | None = None, groups_override: int | None = None,
            options: frozenset = frozenset(), mem_phases: bool = False) -> dict:
    import torch

    from gymv.algorithms.loss_fns import PolicyLoss
    from gymv.backends.training.base import TrainingSetup
    from gymv.backends.training.samples import as_tensors
    from gymv.backends.training.hf_fsdp import HFFSDPBackend
    from gymv.backends.training.hf_torch import HFTorchBackend
    from gymv.config.schema import FsdpSection, TrainingSection

    shape_name, backend_name, packing, ckpt, groups = run
    groups = 2 if smoke else (groups_override or groups)
    policy = build_policy(base, shape_name, device, seed, smoke)
    counts = param_counts(policy.model)
    if ckpt:
        policy.model.gradient_checkpointing_enable()
    training = TrainingSection(lr=1e-6, weight_decay=0.01, dtype="float32" if smoke else "bfloat16",
                               micro_batch_tokens=micro_batch_tokens or (2048 if smoke else 16384),
                               optimizer_state_dtype="bfloat16" if "adam16" in options else "float32",
                               gradient_checkpointing=ckpt, sequence_packing=packing, compile=compile_layers,
                               weight_copy="autocast" not in options,
                               fsdp=FsdpSection(reshard_after_forward=not keep_gathered,
                                                **({"defer_gradient_reduction": False} if "nodefer" in options else {})))
    setup = TrainingSetup(model_path=str(policy.path), training=training, device=device, seed=seed)
    cls = HFFSDPBackend if backend_name == "fsdp2" else HFTorchBackend
    backend = cls(policy, setup, device=device, rank=rank, world_size=world)
    all_samples = rollouts(policy, groups * world, seed, smoke)
    mine = all_samples[rank * groups * GROUP:(rank + 1) * groups * GROUP]
    total = sum(len(s["input_ids"]) for s in all_samples)
    generated = sum(sum(s["loss_mask"]) for s in all_samples)
    unique = total - sum((GROUP - 1) * s["loss_mask"].index(True) for s in all_samples[::GROUP])
    loss = PolicyLoss()
    times, metrics, first_step_s = [], {}, None
    if device.startswith("cuda"):
        torch.cuda.reset_peak_memory_stats()
    for step in range(steps + 1):
        batch = [as_tensors(dict(s)) for s in mine]
        if device.startswith("cuda"):
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        metrics = backend.train_step(batch, loss)
        if device.startswith("cuda"):
            torch.cuda.synchronize()
        if step > 0:
            times.append(time.perf_counter() - t0)
        else:
            first_step_s = time.perf_counter() - t0  # with training.compile: the compilation
    profiled = None
    if profile and rank == 0:  # one more step, profiled: where a step's time goes (not in the figures)
        profiled = profiled_step(backend, [as_tensors(dict(s)) for s in mine], loss, device, trace,
                                 f"{list(run)} (compile {compile_layers})")
    elif profile and world > 1:
        backend.train_step([as_tensors(dict(s)) for s in mine], loss)  # rank 0's profiled step is collective
    t = statistics.median(times)
    flops = 6 * counts["decoder"] * unique + 6 * counts["head"] * generated
    flops_all = 6 * counts["decoder"] * total + 6 * counts["head"] * generated
    out = {"run": run_name(run), "compile": compile_layers, "first_step_s": first_step_s, "options": sorted(options),
           "groups": groups, "optimizer_state_dtype": training.optimizer_state_dtype,
           "micro_batch_tokens": training.micro_batch_tokens, "reshard_after_forward": not keep_gathered,
           "shape": shape_name, "backend": backend_name, "sequence_packing": packing, "activation_checkpointing": ckpt,
           "ranks": world, "samples": len(all_samples), "tokens": total, "unique_tokens": unique,
           "computed_tokens_rank0": computed_tokens(backend, [as_tensors(dict(s)) for s in mine]),
           "generated_tokens": generated, "params": counts, "step_s": t, "step_s_all": times,
           "tokens_per_s": total / t, "unique_tokens_per_s": unique / t,
           "mfu": flops / t / (PEAK_FLOPS * world), "mfu_all_tokens": flops_all / t / (PEAK_FLOPS * world),
           "micro_batches": metrics.get("train/num_micro_batches"), "packed": backend.trainer.plan_fn.__self__.packed,
           "loss": metrics.get("train/loss")}
    if device.startswith("cuda"):
        stats = torch.cuda.memory_stats()
        out["peak_mem_gb"] = torch.cuda.max_memory_allocated() / 2**30
        out["peak_reserved_gb"] = torch.cuda.max_memory_reserved() / 2**30
        out["alloc_retries"] = stats.get("num_alloc_retries", 0)  # cudaFree-and-retry: a device sync each
        out["alloc_conf"] = os.environ.get("PYTORCH_CUDA_ALLOC_CONF", "")
    if profiled is not None:
        out["profile"] = profiled
    if mem_phases and device.startswith("cuda"):
        out["memory_phases"] = recorded_memory_phases(backend, [as_tensors(dict(s)) for s in mine], loss)
    from gymv.backends import packed_attention

    out["packed_attention"] = packed_attention.active(backend.model)
    out["varlen_kernel"] = packed_attention._varlen_kernel() is not None
    backend.close()
    del backend, policy
    gc.collect()
    if device.startswith("cuda"):
        torch.cuda.empty_cache()
    return out


def memory_phases(backend, batch, loss) -> list[dict]:
    """One more step with the allocator read at each micro-batch's start and around the optimizer step: memory
    held, and the peak since the previous mark (host-side counters: no device sync)."""
    import torch

    trainer, marks = backend.trainer, []

    def mark(at: str) -> None:
        marks.append({"at": at, "allocated_gb": round(torch.cuda.memory_allocated() / 2**30, 2),
                      "peak_since_last_gb": round(torch.cuda.max_memory_allocated() / 2**30, 2)})
        torch.cuda.reset_peak_memory_stats()

    start, step = trainer._start_micro_batch, trainer.optimizer.step

    def on_start(last):
        mark("micro-batch start")
        start(last)

    def on_step(*a, **k):
        mark("optimizer step start")
        out = step(*a, **k)
        mark("optimizer step end")
        return out

    trainer._start_micro_batch, trainer.optimizer.step = on_start, on_step
    try:
        mark("step start")
        backend.train_step(batch, loss)
        mark("step end")
    finally:
        trainer._start_micro_batch, trainer.optimizer.step = start, step
    return marks


def parity(base: dict, device: str, smoke: bool) -> dict:
    """Packed rows (prompts shared in the row) against padded rows, same weights, 2 groups, bf16 autocast on
    CUDA: the mean over scored tokens of exp(|logp_packed - logp_padded|) (1 = equal) and the largest gap."""
    import torch

    from gymv.backends import packed_attention
    from gymv.backends.logprobs import MultimodalBatch, packed_prefixes, token_scores
    from gymv.backends.training.micro_batches import pad_collate
    from gymv.backends.training.samples import as_tensors

    policy = build_policy(base, "0.8b", device, 1, smoke)
    samples = [as_tensors(s) for s in rollouts(policy, 2, 7, smoke)]
    mb = pad_collate([{k: s[k] for k in ("input_ids", "loss_mask")} for s in samples], {"input_ids": 0})
    batch = MultimodalBatch(mb["input_ids"], mb["attention_mask"], [s["images"] for s in samples])
    cast = torch.autocast("cuda", torch.bfloat16) if device.startswith("cuda") else torch.autocast("cpu", enabled=False)
    with torch.no_grad(), cast:
        padded = token_scores(policy.model, policy.adapter, batch, score_mask=mb["loss_mask"]).logp.float()
        installed = packed_attention.install(policy.model)
        prefixes = packed_prefixes(batch.input_ids, mb["loss_mask"], batch.images, policy.adapter.image_token_id)
        packed = token_scores(policy.model, policy.adapter, batch, score_mask=mb["loss_mask"], packed=True,
                              prefixes=prefixes).logp.float()
    m = mb["loss_mask"].to(padded.device)
    gap = (packed - padded).abs()[m]
    dtype = torch.bfloat16 if device.startswith("cuda") else torch.float32
    out = {"mult_prob_error": float(gap.exp().mean()), "max_abs_gap": float(gap.max()), "scored": int(m.sum()),
           "packed_attention": installed, "varlen_kernel": packed_attention._varlen_kernel() is not None,
           "varlen_checks": packed_attention._varlen_checks(torch.device(device), dtype)}
    del policy
    gc.collect()
    return out


def worker(rank: int, world: int, port: int, a) -> None:
    import torch
    import torch.distributed as dist

    from gymv.backends.policy import load_policy

    smoke = a.cpu_smoke
    device = "cpu" if smoke else f"cuda:{rank}"
    if not smoke:
        torch.cuda.set_device(rank)
    if world > 1:
        dist.init_process_group("gloo" if smoke else "nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                                world_size=world)
    base = {family: load_policy(a.out / f"base-{family}", device="cpu", dtype=torch.float32) for family in BASES}
    shapes = a.shapes.split(",")
    result = {"device": "cpu" if smoke else torch.cuda.get_device_name(rank), "torch": torch.__version__,
              "ranks": world, "peak_flops_per_gpu": PEAK_FLOPS, "runs": []}
    import transformers

    result["transformers"] = transformers.__version__
    start = time.time()
    if rank == 0 and not a.no_parity:
        try:
            result["parity"] = parity(base, device, smoke)
        except Exception as e:  # noqa: BLE001 - a benchmark reports and goes on
            result["parity"] = {"error": f"{type(e).__name__}: {e}", "trace": traceback.format_exc()[-2000:]}
        print("parity", json.dumps(result["parity"]), flush=True)
    profiled = False
    selected = select_runs(a.runs, shapes, {"off": [False], "on": [True], "both": [False, True]}[a.compile])
    for run, compiled, tokens, keep, extra in selected:
        # --profile: the first run's first variant; --profile compile: its compiled variant
        profile_this = a.profile is not None and not profiled and (a.profile != "compile" or compiled)
        if time.time() - start > a.budget_s:
            row = {"run": run_name(run), "compile": compiled, "micro_batch_tokens": tokens,
                   "reshard_after_forward": not keep, "error": "skipped: time budget"}
        else:
            try:
                row = one_run(run, base, rank, world, device, a.steps, a.seed, smoke, profile=profile_this,
                              compile_layers=compiled, micro_batch_tokens=tokens, keep_gathered=keep,
                              trace=str(a.out / "trace.json") if a.trace and profile_this else None,
                              groups_override=a.groups, options=extra, mem_phases=a.mem_phases)
                profiled = profiled or profile_this
            except Exception as e:  # noqa: BLE001 - a benchmark reports and goes on
                row = {"run": run_name(run), "compile": compiled, "micro_batch_tokens": tokens,
                       "reshard_after_forward": not keep, "error": f"{type(e).__name__}: {e}",
                       "trace": traceback.format_exc()[-3000:]}
                gc.collect()
                if not smoke:
                    torch.cuda.empty_cache()
        if rank == 0:
            result["runs"].append(row)
            brief = {k: (round(v, 4) if isinstance(v, float) else v) for k, v in row.items()
                     if k not in ("step_s_all", "params", "trace", "profile", "memory_phases")}
            print(json.dumps(brief), flush=True)
            (a.out / RESULT_NAME).write_text(json.dumps(result, indent=2))
    if world > 1:
        from gymv.backends.training.process_group import leave_process_group

        leave_process_group()


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--shapes", default="0.8b,3b")
    ap.add_argument("--ranks", type=int, default=1)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--mem-phases", action="store_true",
                    help="one more step per run with the allocator read at each phase (memory_phases in the JSON)")
    ap.add_argument("--json-name", help="results file name under --out (default gpu_train.json)")
    ap.add_argument("--groups", type=int, help="groups of G=8 samples per step and rank (default: the run's own)")
    ap.add_argument("--budget-s", type=float, default=170.0, help="start no new run after this many seconds")
    ap.add_argument("--cpu-smoke", action="store_true")
    ap.add_argument("--no-parity", action="store_true", help="skip the packed-vs-padded logprob check")
    ap.add_argument("--profile", nargs="?", const="first", choices=["first", "compile"], default=None,
                    help="profile one extra step of the first run (`compile`: of its compiled variant); printed, "
                         "and summed by kind of kernel in the JSON")
    ap.add_argument("--trace", action="store_true", help="with --profile: also write the profiled step's timeline "
                                                         "as OUT/trace.json.gz (chrome://tracing, Perfetto)")
    ap.add_argument("--runs", default="", help="comma-separated NAME[@TOKENS][:eager|:compile][:keep], in this order "
                                               "(e.g. 0.8b-fsdp2-packed,0.8b-fsdp2-packed@32768:compile); "
                                               "default: every run of --shapes")
    ap.add_argument("--compile", choices=["off", "on", "both"], default="off",
                    help="training.compile for each run: off, on, or both (eager first)")
    a = ap.parse_args()
    a.out.mkdir(parents=True, exist_ok=True)
    if a.json_name:
        global RESULT_NAME
        RESULT_NAME = a.json_name
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    if not a.cpu_smoke:
        import torch

        if not torch.cuda.is_available():
            sys.exit("no CUDA device: this benchmark needs a GPU (or --cpu-smoke)")
    from gymv.models.tiny import init_tiny_llava, init_tiny_qwen2vl

    # the tokenizer, processor and chat template every shape of a family shares (each run builds its model)
    bases = SMOKE_BASES if a.cpu_smoke else BASES
    small = dict(force=True, hidden=64, layers=1, heads=4, kv_heads=2, intermediate=128)
    init_tiny_llava(a.out / "base-llava", **small, **bases["llava"])
    init_tiny_qwen2vl(a.out / "base-qwen2_5vl", arch="tiny-qwen2_5vl", **small, **bases["qwen2_5vl"])
    if a.ranks == 1:
        worker(0, 1, 0, a)
        return
    import torch.multiprocessing as mp

    mp.spawn(worker, args=(a.ranks, _port(), a), nprocs=a.ranks, join=True)


if __name__ == "__main__":
    main()
