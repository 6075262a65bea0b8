"""Decode speed on one GPU: gymv's HF loop (old), gymv's static-cache graph decoder (new), and transformers'
`generate` with its dynamic and static (compiled) caches, in one run, on a ~0.8B LLaVA-shaped model.

Per path and batch size: decode ms/step = (time to generate 128 tokens - time to generate 1) / 127, both
after a warm-up call, so prefill and image encoding fall out; tokens/s = batch / (ms/step); and the fraction
of the bandwidth limit, where the limit is the bytes one step must read (the text model's weights once, plus
the KV cache of every row at its mean length) over the device-to-device copy bandwidth measured in the same
run. Also: the new path's graph replay alone (device events), its logprobs against the trainer's
(token_mult_prob_error, bf16), greedy agreement with the HF loop, and a kernel-time profile of one eager step.

Paths: old (HFGenerationBackend), new (StaticDecodeBackend: compiled step on CUDA, the split-sequence triton
decode-attention kernel where triton is present), new_sdpa (the same with PyTorch's SDPA for attention),
new_eager (compile=False: graphs of uncompiled kernels), hf_dynamic and hf_static (transformers `generate`,
cache_implementation unset or "static").

Usage (on a GPU machine): python bench/gpu_decode.py --out DIR [--batches 1,16,64,256] [--paths new,old,...]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
import traceback
from pathlib import Path

MODEL = dict(hidden=2048, layers=16, heads=16, kv_heads=8, intermediate=5632, vision_hidden=256, vision_layers=4,
             vision_heads=4, image_size=224, patch_size=14, vocab_size=1024)
NEW_TOKENS = 128
GROUP = 8  # rows that share a prompt and image, as the G samples of a GRPO group


DEVICE = "cuda"


def sync():
    import torch

    if DEVICE == "cuda":
        torch.cuda.synchronize()


def timed(fn) -> float:
    sync()
    t0 = time.perf_counter()
    fn()
    sync()
    return time.perf_counter() - t0


def make_requests(policy, batch: int):
    import numpy as np
    from PIL import Image

    from gymv.backends.generation.base import GenerationRequest

    reqs = []
    for g in range(-(-batch // GROUP)):
        rng = np.random.default_rng(g)
        image = Image.fromarray(rng.integers(0, 255, (224, 224, 3), dtype=np.uint8))
        text = f"How many circles of colour {g} are in this picture? Think step by step."
        content = [{"type": "image"}, {"type": "text", "text": text}]
        rendered = policy.tokenizer.apply_chat_template([{"role": "user", "content": content}], tokenize=False,
                                                        add_generation_prompt=True, chat_template=policy.chat_template)
        ids = policy.adapter.encode_text(rendered, [image])
        reqs += [GenerationRequest(ids, [image], where=f"group {g}")] * min(GROUP, batch - g * GROUP)
    return reqs


def limit_ms(policy, batch: int, mean_len: float, copy_bw: float) -> float:
    """The fewest milliseconds one decode step can take: its bytes over the measured copy bandwidth."""
    from gymv.backends.generation.static import text_model

    tm = text_model(policy.model)
    params = sum(p.numel() * p.element_size() for p in tm.layers.parameters())
    params += sum(p.numel() * p.element_size() for m in (tm.norm, tm.lm_head) for p in m.parameters())
    params += batch * tm.embed.weight.shape[1] * tm.embed.weight.element_size()  # the embedding rows read
    kv = batch * mean_len * len(tm.layers) * 2 * tm.kv_heads * tm.head_dim * tm.embed.weight.element_size()
    return (params + kv) / copy_bw * 1e3


def copy_bandwidth() -> float:
    import torch

    if DEVICE != "cuda":
        return 20e9
    a = torch.empty(2 << 30, dtype=torch.uint8, device="cuda")
    b = torch.empty_like(a)
    for _ in range(3):
        b.copy_(a)
    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    s.record()
    for _ in range(10):
        b.copy_(a)
    e.record()
    sync()
    bw = 2 * a.numel() * 10 / (s.elapsed_time(e) / 1e3)
    del a, b
    return bw


def gymv_path(policy, backend_cls, batch: int, **kw):
    from gymv.backends.generation.base import SamplingParams

    backend = backend_cls.from_policy(policy, **kw)
    reqs = make_requests(policy, batch)

    def run(n):
        return lambda: backend.generate(reqs, SamplingParams(temperature=1.0, max_new_tokens=n, ignore_eos=True,
                                                             seed=1))
    first = timed(run(NEW_TOKENS))  # warm-up: captures the graphs of this shape
    timed(run(1))
    t1 = statistics.median(timed(run(1)) for _ in range(3))
    tn = statistics.median(timed(run(NEW_TOKENS)) for _ in range(2))
    return backend, reqs, {"first_call_s": first, "t1_s": t1, "t128_s": tn, "timing": dict(backend.last_timing)}


def hf_inputs(policy, reqs):
    import torch

    pad = policy.tokenizer.pad_token_id or 0
    L = max(len(r.prompt_token_ids) for r in reqs)
    ids = torch.full((len(reqs), L), pad, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for b, r in enumerate(reqs):
        ids[b, L - len(r.prompt_token_ids):] = torch.tensor(r.prompt_token_ids)
        mask[b, L - len(r.prompt_token_ids):] = 1
    pixels = policy.adapter.preprocess([r.images[0] for r in reqs]).pixel_values
    dt = next(policy.model.parameters()).dtype
    return dict(input_ids=ids.to(DEVICE), attention_mask=mask.to(DEVICE), pixel_values=pixels.to(DEVICE, dt))


def hf_path(policy, batch: int, static: bool):
    import torch

    reqs = make_requests(policy, batch)
    inputs = hf_inputs(policy, reqs)
    extra = {"cache_implementation": "static"} if static else {}

    def run(n):
        def go():
            with torch.no_grad():
                policy.model.generate(**inputs, do_sample=True, max_new_tokens=n, min_new_tokens=n,
                                      pad_token_id=policy.tokenizer.pad_token_id, **extra)
        return go
    first = timed(run(NEW_TOKENS))
    timed(run(1))
    t1 = statistics.median(timed(run(1)) for _ in range(3))
    tn = statistics.median(timed(run(NEW_TOKENS)) for _ in range(2))
    return {"first_call_s": first, "t1_s": t1, "t128_s": tn}


def replay_ms(backend, batch: int) -> float | None:
    """Median ms of one graph replay (device events), the decode step without any host work."""
    import torch

    st = next((s for k, s in reversed(backend._states.items()) if s.graphs and k[0] >= batch), None)
    if DEVICE != "cuda":
        return None
    if st is None:
        return None
    times = []
    window = max(st.graphs)  # the last window: the one that reads the most cache
    for _ in range(20):
        st.col.fill_(window - 11)  # the columns written stay inside the window
        st.step.zero_()
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        for _ in range(10):
            st.graphs[window].replay()
        e.record()
        sync()
        times.append(s.elapsed_time(e) / 10)
    return statistics.median(times)


def parity(policy) -> dict:
    """token_mult_prob_error of the new path against the trainer's logprobs, and greedy agreement with the old."""
    import torch

    from gymv.backends.generation.base import SamplingParams
    from gymv.backends.generation.hf import HFGenerationBackend
    from gymv.backends.generation.static import StaticDecodeBackend
    from gymv.backends.logprobs import right_pad, sequence_logprobs

    reqs = make_requests(policy, 16)
    backend = StaticDecodeBackend.from_policy(policy)
    outs = backend.generate(reqs, SamplingParams(temperature=1.0, max_new_tokens=64, ignore_eos=True, seed=2))
    batch = right_pad([r.prompt_token_ids + o.token_ids for r, o in zip(reqs, outs)], [r.images for r in reqs],
                      policy.tokenizer.pad_token_id)
    with torch.no_grad():
        train = sequence_logprobs(policy.model, policy.adapter, batch, temperature=1.0).float().cpu()
    deltas = [train[b, len(r.prompt_token_ids):len(r.prompt_token_ids) + len(o.token_ids)] - torch.tensor(o.logprobs)
              for b, (r, o) in enumerate(zip(reqs, outs))]
    err = torch.exp(torch.cat(deltas).abs()).mean().item()
    greedy = SamplingParams(temperature=0, max_new_tokens=32, ignore_eos=True)
    new = backend.generate(reqs[::GROUP], greedy)
    old = HFGenerationBackend.from_policy(policy).generate(reqs[::GROUP], greedy)
    same = [next((j for j, (a, b) in enumerate(zip(x.token_ids, y.token_ids)) if a != b), len(x.token_ids))
            for x, y in zip(new, old)]
    vision = set(policy.adapter.vision_token_ids)
    # graphs against the same step run eagerly: same seed, same samples (capture changed no state)
    sampled = SamplingParams(temperature=1.0, max_new_tokens=40, ignore_eos=True, seed=7)
    eager = StaticDecodeBackend.from_policy(policy, cuda_graphs=False).generate(reqs, sampled)
    graphed = backend.generate(reqs, sampled)
    graph_equal = sum(a.token_ids == b.token_ids for a, b in zip(eager, graphed))
    # a stop token ends every row of a group (greedy: the rows are alike); the loop then ends early
    stop = new[0].token_ids[2]
    stopped = backend.generate(reqs[:GROUP], SamplingParams(temperature=0, max_new_tokens=128, stop_token_ids=(stop,)))
    stop_steps = backend.last_timing["decode_steps"]
    # continuous batching: 16 requests through 4 slots give each request what it gets in one batch of 16
    slots = StaticDecodeBackend.from_policy(policy, max_batch=4)
    spread = SamplingParams(temperature=1.0, max_new_tokens=40, stop_token_ids=(stop,), seed=9)
    slotted, together = slots.generate(reqs, spread), backend.generate(reqs, spread)
    # no slots, a larger batch (16 more requests after these: same indices, so the same seeds)
    larger = backend.generate(reqs + make_requests(policy, 32)[16:], spread)[:len(reqs)]

    def compare(xs, ys):
        """Rows equal; per differing row, where it first differs and the largest logprob gap before."""
        diff = []
        for x, y in zip(xs, ys):
            if x.token_ids != y.token_ids:
                j = next((i for i, (a, b) in enumerate(zip(x.token_ids, y.token_ids)) if a != b),
                         min(len(x.token_ids), len(y.token_ids)))
                gap = max((abs(a - b) for a, b in zip(x.logprobs[:j], y.logprobs[:j])), default=0.0)
                diff.append({"first_diff": j, "max_logprob_gap_before": gap})
        return {"rows_equal": f"{len(xs) - len(diff)}/{len(xs)}", "differing": diff}
    cb = {"slotted_vs_one_batch": compare(slotted, together), "batch_of_32_vs_one_batch": compare(larger, together),
          "refills": slots.last_timing.get("refills"), "lengths": [len(o.token_ids) for o in together]}
    return {"token_mult_prob_error": err, "greedy_first_divergence_per_row": same, "continuous_batching": cb,
            "vision_tokens_sampled": sum(t in vision for o in outs for t in o.token_ids),
            "graph_equals_eager_rows": f"{graph_equal}/{len(reqs)}",
            "stop_rows": sum(o.finish_reason == "stop" and o.token_ids[-1] == stop for o in stopped),
            "stop_decode_steps": stop_steps,
            "longest_row": max(len(o.token_ids) for o in stopped)}


def profile(policy, batch: int, top: int = 15) -> list[dict]:
    """CUDA kernel time of eager decode steps (the kernels a graph replays), grouped by kernel name."""
    import torch
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    from gymv.backends.generation.base import SamplingParams
    from gymv.backends.generation.static import StaticDecodeBackend

    backend = StaticDecodeBackend.from_policy(policy, cuda_graphs=False)
    reqs = make_requests(policy, batch)
    params = SamplingParams(temperature=1.0, max_new_tokens=16, ignore_eos=True, seed=1)
    backend.generate(reqs, params)
    with torch_profile(activities=[ProfilerActivity.CUDA if DEVICE == "cuda" else ProfilerActivity.CPU]) as prof:
        backend.generate(reqs, params)
    rows = []
    for ev in prof.key_averages():
        t = (getattr(ev, "device_time_total", None) or getattr(ev, "cuda_time_total", 0)) if DEVICE == "cuda" \
            else ev.self_cpu_time_total
        if t > 0:
            rows.append({"kernel": ev.key[:90], "calls": ev.count, "ms_per_step": t / 1e3 / 16})
    rows.sort(key=lambda r: -r["ms_per_step"])
    return rows[:top]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--batches", default="1,16,64,256")
    ap.add_argument("--paths", default="new,new_sdpa,new_eager,old,hf_dynamic,hf_static")
    ap.add_argument("--no-parity", action="store_true")
    ap.add_argument("--profile-batch", type=int, default=64)
    ap.add_argument("--budget-s", type=float, default=1e9, help="skip paths that start after this many seconds")
    ap.add_argument("--cpu-smoke", action="store_true", help="a tiny model on the CPU: checks this script, not speed")
    a = ap.parse_args()
    global DEVICE, MODEL
    import torch
    import transformers

    from gymv.backends.generation.hf import HFGenerationBackend
    from gymv.backends.generation.static import StaticDecodeBackend
    from gymv.backends.policy import load_policy
    from gymv.models.tiny import init_tiny_llava

    if a.cpu_smoke:
        DEVICE, MODEL = "cpu", dict(MODEL, hidden=64, layers=2, heads=4, kv_heads=2, intermediate=128, vision_hidden=32,
                                    vision_layers=1, image_size=56)
    elif not torch.cuda.is_available():
        sys.exit("no CUDA device: this benchmark needs a GPU")
    t_start = time.time()
    a.out.mkdir(parents=True, exist_ok=True)
    model_dir = init_tiny_llava(a.out / "model", force=True, **MODEL)
    policy = load_policy(model_dir, device=DEVICE, dtype="bfloat16" if DEVICE == "cuda" else "float32")
    n_params = sum(p.numel() for p in policy.model.parameters())
    bw = copy_bandwidth()
    result = {"device": torch.cuda.get_device_name(0) if DEVICE == "cuda" else "cpu", "torch": torch.__version__,
              "transformers": transformers.__version__, "model": MODEL, "params": n_params,
              "copy_bandwidth_B_per_s": bw, "new_tokens": NEW_TOKENS, "group": GROUP, "rows": []}
    print(f"model {n_params / 1e6:.0f}M params, {result['device']}, copy {bw / 1e12:.2f} TB/s, torch "
          f"{torch.__version__}, transformers {transformers.__version__}", flush=True)

    def save():
        (a.out / "gpu_decode.json").write_text(json.dumps(result, indent=2))

    if not a.no_parity:
        try:
            result["parity"] = parity(policy)
        except Exception as e:  # noqa: BLE001 - a benchmark reports and goes on
            result["parity"] = {"error": f"{type(e).__name__}: {e}"}
        print("parity", json.dumps(result["parity"]), flush=True)
        save()
    batches = [int(b) for b in a.batches.split(",")]
    for path in a.paths.split(","):
        for batch in batches:
            if time.time() - t_start > a.budget_s:
                result["rows"].append({"path": path, "batch": batch, "error": "skipped: time budget"})
                continue
            row = {"path": path, "batch": batch}
            try:
                if path in ("new", "new_eager", "new_sdpa", "old"):
                    cls = HFGenerationBackend if path == "old" else StaticDecodeBackend
                    kw = {"new_eager": {"compile": False}, "new_sdpa": {"attention": "sdpa"}}.get(path, {})
                    backend, reqs, r = gymv_path(policy, cls, batch, **kw)
                    row.update(r)
                    if path != "old":
                        row["replay_ms"] = replay_ms(backend, batch)
                        backend.drop_graphs()
                    del backend
                else:
                    reqs = make_requests(policy, batch)
                    row.update(hf_path(policy, batch, static=path == "hf_static"))
                ms = (row["t128_s"] - row["t1_s"]) / (NEW_TOKENS - 1) * 1e3
                mean_len = statistics.mean(len(r.prompt_token_ids) for r in reqs) + NEW_TOKENS / 2
                lim = limit_ms(policy, batch, mean_len, bw)
                row.update(ms_per_step=ms, tokens_per_s=batch / ms * 1e3, limit_ms=lim, fraction_of_limit=lim / ms)
            except Exception as e:  # noqa: BLE001
                row["error"] = f"{type(e).__name__}: {str(e)[:300]}"
                traceback.print_exc()
                if "CUDA error" in str(e):  # the context is broken: nothing after this can run
                    result["rows"].append(row)
                    save()
                    raise
            if DEVICE == "cuda":
                torch.cuda.empty_cache()
            result["rows"].append(row)
            print(json.dumps(row), flush=True)
            save()
    if a.profile_batch and time.time() - t_start < a.budget_s:
        try:
            result["profile"] = profile(policy, a.profile_batch)
        except Exception as e:  # noqa: BLE001
            result["profile"] = [{"error": f"{type(e).__name__}: {e}"}]
        save()
    print(f"\n{'path':<11}{'batch':>6}{'ms/step':>10}{'tok/s':>10}{'limit ms':>10}{'of limit':>9}{'replay ms':>10}")
    for r in result["rows"]:
        if "error" in r:
            print(f"{r['path']:<11}{r['batch']:>6}  {r['error'][:80]}")
            continue
        rep = f"{r['replay_ms']:.3f}" if r.get("replay_ms") else ""
        print(f"{r['path']:<11}{r['batch']:>6}{r['ms_per_step']:>10.3f}{r['tokens_per_s']:>10.0f}{r['limit_ms']:>10.3f}"
              f"{r['fraction_of_limit']:>9.1%}{rep:>10}")
    for p in result.get("profile", []):
        print(json.dumps(p))


if __name__ == "__main__":
    main()
