"""One training step of the 0.8B text decoder shape (gpu_decode.py's language model: hidden 2048, 16 layers,
16 heads, 8 kv heads, MLP 5632) through Megatron-core's GPTModel (local layer spec, TP=1, loaded by gymv's
weight mapping; its attention either gymv's fused SDPA slot or megatron's local one) and through the HF
model gymv's torch backend trains, on the same weights and batch. All three models stay on the GPU, so
each path's peak memory includes the others' weights.

A step is what gymv's trainer does: fp32 weights, bf16 autocast, token logprobs, a loss over them,
backward, AdamW. Reported per path: median step seconds over the timed steps, tokens/s, MFU = 6·N·tokens /
step time / peak (N: every parameter; peak 989 TFLOP/s, an H200's dense bf16), peak memory; and the two
models' bf16 logprob difference on the batch.

`--packing`: instead, sequence packing against padding on the same shape, on a GRPO-like batch: `--batch`
rows in groups of `--group` sharing a prompt (--seq/8..--seq/4 tokens), each with its own answer
(--seq/8..3·--seq/4 tokens), seeded; the loss scores the answer tokens. One step each through GPTModel and
the HF model, as padded rows [batch, longest], as one packed row of the real tokens (each prompt repeated),
and as one packed row with each group's prompt once (gymv.backends.packing; each segment's attention kept
to its own keys by gymv.backends.packed_attention: varlen flash on CUDA); the output layer runs at the
scored positions (`logits_to_keep`), as gymv's trainers do. MFU there counts the unique tokens (prompts
once) for every path; the report also has each path's loss on the starting weights and the packed paths'
logprob difference from their padded twins. `--diagnose` adds, per path, the seconds until a step's work is
queued against until it finished, the synchronising CUDA calls of one step, the top CUDA kernels of one
profiled Megatron step, and a Megatron packed path with one SDPA call per sequence instead of the varlen
kernel.

Usage (GPU): python bench/gpu_megatron.py --out FILE.json [--packing]   (--cpu-smoke: a tiny shape on the CPU, fp32)
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
import traceback
from pathlib import Path

SHAPE = dict(hidden_size=2048, num_hidden_layers=16, num_attention_heads=16, num_key_value_heads=8,
             intermediate_size=5632, vocab_size=1024, max_position_embeddings=4096)
SMOKE = dict(SHAPE, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
             intermediate_size=128)
PEAK_FLOPS = 989e12


class _Done(Exception):
    """The chosen comparison finished: write the report."""


def sync(device):
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize()


def step_fn(model, ids, mask, device):
    import torch

    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-6)
    autocast = torch.autocast("cuda", dtype=torch.bfloat16) if device.type == "cuda" else torch.autocast("cpu", enabled=False)

    def step():
        opt.zero_grad(set_to_none=True)
        with autocast:
            logits = model(input_ids=ids, attention_mask=mask).logits
        logp = torch.log_softmax(logits[:, :-1].float(), -1).gather(-1, ids[:, 1:, None])[..., 0]
        loss = -(logp * mask[:, 1:]).sum() / mask[:, 1:].sum()
        loss.backward()
        opt.step()
        return loss.detach()

    return step


def timed_steps(step, device, warmup: int, steps: int) -> tuple[list[float], list[float]]:
    import torch

    losses = [step() for _ in range(warmup)]
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    times = []
    for _ in range(steps):
        sync(device)
        t0 = time.perf_counter()
        losses.append(step())
        sync(device)
        times.append(time.perf_counter() - t0)
    return times, losses


def logprobs(model, ids, mask, device):
    import torch

    with torch.no_grad(), (torch.autocast("cuda", dtype=torch.bfloat16) if device.type == "cuda"
                           else torch.autocast("cpu", enabled=False)):
        logits = model(input_ids=ids, attention_mask=mask).logits
    return torch.log_softmax(logits[:, :-1].float(), -1).gather(-1, ids[:, 1:, None])[..., 0]


def autocast(device):
    import torch

    if device.type == "cuda":
        return torch.autocast("cuda", dtype=torch.bfloat16)
    return torch.autocast("cpu", enabled=False)


def grouped_batch(vocab: int, count: int, group: int, longest: int):
    """`count` right-padded rows in groups of `group` (GRPO-like): each group's rows share a prompt of
    longest/8..longest/4 tokens, each row has its own answer of longest/8..longest*3/4 tokens (seeded).
    Returns ids, mask, the scored (row, logits column) pairs (the answer's tokens, each predicted by the
    token before it) and each row's shared prefix for gymv.backends.packing.pack."""
    import torch

    g = torch.Generator().manual_seed(2)
    rows, prefixes = [], []
    for first in range(0, count, group):
        plen = int(torch.randint(max(2, longest // 8), max(3, longest // 4) + 1, (1,), generator=g))
        prompt = torch.randint(0, vocab, (plen,), generator=g)
        for _ in range(min(group, count - first)):
            alen = int(torch.randint(max(1, longest // 8), max(2, longest * 3 // 4) + 1, (1,), generator=g))
            rows.append(torch.cat([prompt, torch.randint(0, vocab, (alen,), generator=g)]))
            prefixes.append((first, plen - 1))  # the token that predicts the first answer token is the row's own
    width = max(r.numel() for r in rows)
    ids = torch.zeros(len(rows), width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    wanted = torch.zeros(len(rows), width - 1, dtype=torch.bool)
    for b, r in enumerate(rows):
        ids[b, : r.numel()], mask[b, : r.numel()] = r, 1
        wanted[b, prefixes[b][1]: r.numel() - 1] = True
    return ids, mask, wanted, prefixes


class Layout:
    """One way to run the batch: padded rows, or one packed row (prompts repeated, or once per group)."""

    def __init__(self, ids, mask, wanted, prefixes, device, packed: bool, shared: bool):
        import torch

        from gymv.backends.packing import pack

        self.device, self.packed = device, packed
        rows, cols = wanted.nonzero(as_tuple=True)
        self.targets = ids[rows, cols + 1].to(device)
        if not packed:
            self.ids, self.mask = ids.to(device), mask.to(device)
            self.keep = wanted.any(0).nonzero().squeeze(-1)
            position = torch.searchsorted(self.keep, cols)
            self.pick = (rows.to(device), position.to(device))
            self.tokens = int(mask.numel())  # padding computed too
            return
        self.row = pack(ids, mask, [[] for _ in range(ids.shape[0])], prefixes if shared else None)
        keep = self.row.index(rows, cols)
        order = keep.argsort()
        self.keep, self.targets = keep[order].to(device), self.targets[order.to(device)]
        self.tokens = int(self.row.input_ids.numel())

    def logprobs(self, model):
        import torch

        from gymv.backends import packed_attention

        if self.packed:
            logits = model(input_ids=self.row.input_ids.to(self.device)[None],
                           position_ids=self.row.positions.to(self.device)[None], logits_to_keep=self.keep,
                           **{packed_attention.KEYWORD: self.row.attention_args(self.device)}).logits[0]
        else:
            logits = model(input_ids=self.ids, attention_mask=self.mask, logits_to_keep=self.keep.to(self.device)
                           ).logits[self.pick]
        return torch.log_softmax(logits.float(), -1).gather(-1, self.targets[:, None])[:, 0]


def packing_step_fn(score, params, device):
    import torch

    opt = torch.optim.AdamW(params, lr=1e-6)

    def step():
        opt.zero_grad(set_to_none=True)
        with autocast(device):
            logp = score()
        loss = -logp.float().mean()
        loss.backward()
        opt.step()
        return loss.detach()

    return step


def diagnose(step, device, profile: bool) -> dict:
    """Where one step's time goes: seconds until the step's work is queued (the host side) against until it
    finished, the synchronising CUDA calls it makes (each stalls the host's run-ahead; file:line of the
    caller), and with `profile` the CUDA kernels taking the most time."""
    import warnings

    import torch

    out: dict = {}
    sync(device)
    t0 = time.perf_counter()
    step()
    out["queued_s"] = time.perf_counter() - t0
    sync(device)
    out["finished_s"] = time.perf_counter() - t0
    if device.type != "cuda":
        return out
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            step()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    where: dict = {}
    for w in caught:
        if "synchroniz" in str(w.message):
            key = f"{Path(w.filename).name}:{w.lineno}"
            where[key] = where.get(key, 0) + 1
    out["synchronising_calls"] = where
    if profile:
        from torch.profiler import ProfilerActivity
        from torch.profiler import profile as torch_profile

        with torch_profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            step()
            sync(device)
        rows = sorted(prof.key_averages(), key=lambda e: getattr(e, "self_device_time_total", 0), reverse=True)
        out["cuda_ms_total"] = sum(getattr(e, "self_device_time_total", 0) for e in rows) / 1e3
        out["top_cuda_kernels"] = [{"name": e.key[:90], "ms": getattr(e, "self_device_time_total", 0) / 1e3,
                                    "calls": e.count} for e in rows[:12]]
    return out


def packing_comparison(a, report: dict, device, shape_kw: dict, batch: int, seq: int, steps: int) -> None:
    """Padded rows against one packed row (prompts repeated, and each group's prompt once), through GPTModel
    and through the HF model (the torch/fsdp2 path)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from gymv.backends import packed_attention
    from gymv.backends.training.megatron_model import MegatronCausalLM, build_gpt, init_parallel
    from gymv.backends.training.megatron_weights import DecoderShape, hf_to_megatron

    torch.manual_seed(0)
    cfg = LlamaConfig(**shape_kw, tie_word_embeddings=False)
    with torch.device(device):
        hf = LlamaForCausalLM(cfg)
    n = sum(p.numel() for p in hf.parameters())
    ids, mask, wanted, prefixes = grouped_batch(cfg.vocab_size, batch, a.group, seq)
    layouts = {"padded": Layout(ids, mask, wanted, prefixes, device, packed=False, shared=False),
               "packed": Layout(ids, mask, wanted, prefixes, device, packed=True, shared=False),
               "packed_shared": Layout(ids, mask, wanted, prefixes, device, packed=True, shared=True)}
    unique = layouts["packed_shared"].tokens
    report.update(params=n, group=a.group, lengths=mask.sum(1).tolist(), scored_tokens=int(wanted.sum()),
                  real_tokens=int(mask.sum()), tokens={name: layout.tokens for name, layout in layouts.items()})
    shape = DecoderShape.of(cfg)
    init_parallel(1, device)
    gpt = build_gpt(cfg, shape, device=device)
    gpt.load_state_dict(hf_to_megatron(hf.state_dict(), shape), strict=True)
    twin = MegatronCausalLM(gpt, shape, cfg)
    assert packed_attention.install(hf) and packed_attention.install(twin)
    if device.type == "cuda":
        report["varlen_flash_checks"] = list(packed_attention._varlen_checks(device, torch.bfloat16))
        report["cudnn_version"] = torch.backends.cudnn.version()
        try:  # some torch releases route varlen_attn to cuDNN on sm90/sm100 (a private switch, if present)
            from torch.nn.attention import varlen

            choose = getattr(varlen, "_should_use_cudnn", None)
            report["varlen_uses_cudnn"] = None if choose is None else bool(choose(torch.cuda.current_device()))
        except Exception as e:  # noqa: BLE001
            report["varlen_uses_cudnn"] = repr(e)[:200]
    paths = {f"{family}_{name}": (model, layout, False) for family, model in (("megatron", twin), ("hf", hf))
             for name, layout in layouts.items()}
    if a.diagnose:  # the packed row with one SDPA call per sequence instead of the varlen kernel
        paths = dict(list(paths.items())[:3] + [("megatron_packed_per_segment", (twin, layouts["packed"], True))]
                     + list(paths.items())[3:])
    report["elapsed_s"] = {"setup": time.perf_counter() - a.started}

    def scorer(model, layout, per_segment: bool):
        def score():
            if not per_segment:
                return layout.logprobs(model)
            kernel = packed_attention._varlen
            packed_attention._varlen = lambda *args, **kwargs: None
            try:
                return layout.logprobs(model)
            finally:
                packed_attention._varlen = kernel

        return score

    start = {}
    with torch.no_grad(), autocast(device):
        for name, (model, layout, per_segment) in paths.items():
            start[name] = scorer(model, layout, per_segment)().float()
    for name in paths:
        if not name.endswith("_padded"):
            diff = (start[name] - start[name.rsplit("_packed", 1)[0] + "_padded"]).abs()
            report[f"logprob_abs_diff_{name}_vs_padded"] = {"max": diff.max().item(), "mean": diff.mean().item()}
    report["start_loss"] = {name: -lp.mean().item() for name, lp in start.items()}
    for name, (model, layout, per_segment) in paths.items():
        step = packing_step_fn(scorer(model, layout, per_segment),
                               [p for p in model.parameters() if p.requires_grad], device)
        times, _ = timed_steps(step, device, warmup=1 if a.cpu_smoke else 2, steps=steps)
        t = statistics.median(times)
        peak = torch.cuda.max_memory_allocated() / 2**30 if device.type == "cuda" else None
        report[name] = {"step_s": t, "step_times_s": times, "computed_tokens": layout.tokens,
                        "unique_tokens_per_s": unique / t, "mfu_unique_tokens": 6 * n * unique / t / PEAK_FLOPS,
                        "peak_memory_gb": peak}
        if a.diagnose:
            try:
                report[name]["diagnosis"] = diagnose(step, device, profile=name.startswith("megatron"))
            except Exception as e:  # noqa: BLE001 - a diagnosis that fails leaves the timings standing
                report[name]["diagnosis"] = {"error": repr(e)[:400]}
        report.setdefault("elapsed_s", {})[name] = time.perf_counter() - a.started
        print(name, json.dumps(report[name]), flush=True)
        a.out.parent.mkdir(parents=True, exist_ok=True)
        a.out.write_text(json.dumps(report, indent=1))  # what finished, should a time limit stop the rest
        del step
        if device.type == "cuda":
            torch.cuda.empty_cache()
    for family in ("megatron", "hf"):
        for name in ("packed", "packed_shared"):
            padded, packed = report[f"{family}_padded"]["step_s"], report[f"{family}_{name}"]["step_s"]
            report[f"{family}_{name}_speedup"] = padded / packed


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--cpu-smoke", action="store_true")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=1024)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--packing", action="store_true", help="packed against padded rows of random lengths")
    ap.add_argument("--group", type=int, default=8, help="--packing: rows per group sharing a prompt")
    ap.add_argument("--diagnose", action="store_true",
                    help="--packing: per path, host-queued against finished time, synchronising calls, kernels")
    a = ap.parse_args()
    a.started = time.perf_counter()
    import torch
    import transformers
    from transformers import LlamaConfig, LlamaForCausalLM

    import megatron.core
    from gymv.backends.training.megatron_model import MegatronCausalLM, build_gpt, init_parallel
    from gymv.backends.training.megatron_weights import DecoderShape, hf_to_megatron

    device = torch.device("cpu" if a.cpu_smoke else "cuda")
    shape_kw = SMOKE if a.cpu_smoke else SHAPE
    batch, seq, steps = (2, 32, 2) if a.cpu_smoke else (a.batch, a.seq, a.steps)
    report: dict = {"shape": shape_kw, "batch": batch, "seq": seq, "tokens_per_step": batch * seq, "steps": steps,
                    "torch": torch.__version__, "transformers": transformers.__version__,
                    "megatron_core": megatron.core.__version__, "peak_flops": PEAK_FLOPS,
                    "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu"}
    try:
        if a.packing:
            report["mode"] = "packing"
            report.pop("tokens_per_step")
            packing_comparison(a, report, device, shape_kw, batch, seq, steps)
            raise _Done
        torch.manual_seed(0)
        cfg = LlamaConfig(**shape_kw, tie_word_embeddings=False)
        with torch.device(device):
            hf = LlamaForCausalLM(cfg)
        n = sum(p.numel() for p in hf.parameters())
        report["params"] = n
        g = torch.Generator().manual_seed(1)
        ids = torch.randint(0, cfg.vocab_size, (batch, seq), generator=g).to(device)
        mask = torch.ones_like(ids)
        shape = DecoderShape.of(cfg)
        init_parallel(1, device)
        models = {}
        for attention in ("sdpa", "local"):
            gpt = build_gpt(cfg, shape, device=device, attention=attention)
            gpt.load_state_dict(hf_to_megatron(hf.state_dict(), shape), strict=True)
            models[f"megatron_{attention}"] = MegatronCausalLM(gpt, shape, cfg)
        models["hf"] = hf
        hf_lp = logprobs(hf, ids, mask, device)
        for name in ("megatron_sdpa", "megatron_local"):
            diff = (hf_lp - logprobs(models[name], ids, mask, device)).abs()
            report[f"logprob_abs_diff_{name}"] = {"max": diff.max().item(), "mean": diff.mean().item()}
        for name, model in models.items():
            step = step_fn(model, ids, mask, device)
            times, losses = timed_steps(step, device, warmup=1 if a.cpu_smoke else 2, steps=steps)
            t = statistics.median(times)
            report[name] = {"step_s": t, "step_times_s": times, "tokens_per_s": batch * seq / t,
                            "mfu": 6 * n * batch * seq / t / PEAK_FLOPS, "first_loss": float(losses[0]),
                            "peak_memory_gb": (torch.cuda.max_memory_allocated() / 2**30) if device.type == "cuda" else None}
            print(name, json.dumps(report[name]), flush=True)
            del step
            if device.type == "cuda":
                torch.cuda.empty_cache()
        report["first_loss_diff"] = abs(report["megatron_sdpa"]["first_loss"] - report["hf"]["first_loss"])
        status = 0
    except _Done:
        status = 0
    except Exception:
        report["error"] = traceback.format_exc()
        print(report["error"], file=sys.stderr)
        status = 1
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps(report, indent=1))
    return status


if __name__ == "__main__":
    sys.exit(main())
