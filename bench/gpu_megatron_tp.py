"""A Megatron-core training step at tensor parallel size 2 on the language decoder of Qwen2.5-VL-7B (its real
text config: hidden 3584, 28 layers, 28 heads, 4 kv heads, MLP 18944, vocabulary 152064; random weights),
one rank per GPU, NCCL.

Every rank draws the same full HF-named weights from one seed on its GPU and keeps its shard (gymv's
mapping); rank 0 also loads them into the HF Qwen2 model and compares bf16-autocast token logprobs with the
TP=2 model's. A step is gymv's: fp32 weights, bf16 autocast, token logprobs, a loss, backward, AdamW.
Reported: median step seconds, tokens/s, MFU = 6·N·tokens / step time / (2 × 989 TFLOP/s), peak memory of
each GPU, the logprob gap.

Usage: python bench/gpu_megatron_tp.py --out FILE.json   (--cpu-smoke: a tiny shape on two gloo CPU ranks)
"""

from __future__ import annotations

import argparse
import json
import socket
import statistics
import sys
import time
import traceback
from pathlib import Path

SHAPE = dict(hidden_size=3584, num_hidden_layers=28, num_attention_heads=28, num_key_value_heads=4,
             intermediate_size=18944, vocab_size=152064, max_position_embeddings=32768, rms_norm_eps=1e-6,
             rope_theta=1000000.0, tie_word_embeddings=False)
SMOKE = dict(SHAPE, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
             intermediate_size=128, vocab_size=1024)
PEAK_FLOPS = 989e12
TP = 2


def full_weights(model_cls, cfg, device):
    """The same HF-named weights on every rank: normal(0, 0.02) matrices, unit norms, small biases."""
    import torch

    with torch.device("meta"):
        names = {k: (tuple(v.shape), v.dtype) for k, v in model_cls(cfg).state_dict().items()}
    g = torch.Generator(device=device).manual_seed(0)
    out = {}
    for name in sorted(names):
        shape, _ = names[name]
        if name.endswith("norm.weight"):
            out[name] = torch.ones(shape, device=device)
        else:
            out[name] = torch.randn(shape, device=device, generator=g) * (0.02 if not name.endswith("bias") else 0.1)
    return out


def rank_main(rank: int, port: int, out: str, smoke: bool, batch: int, seq: int, steps: int) -> None:
    import torch
    import torch.distributed as dist
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from gymv.backends.training.megatron_model import MegatronCausalLM, build_gpt, init_parallel
    from gymv.backends.training.megatron_weights import DecoderShape, hf_to_megatron

    device = torch.device("cpu" if smoke else f"cuda:{rank}")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group("gloo" if smoke else "nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=TP)
    report: dict = {}
    try:
        cfg = Qwen2Config(**(SMOKE if smoke else SHAPE))
        shape = DecoderShape.of(cfg)
        init_parallel(TP, device)
        full = full_weights(Qwen2ForCausalLM, cfg, device)
        n_params = sum(t.numel() for t in full.values())
        gpt = build_gpt(cfg, shape, tensor_parallel=TP, device=device)
        gpt.load_state_dict(hf_to_megatron(full, shape, tp_rank=rank, tp_size=TP), strict=True)
        model = MegatronCausalLM(gpt, shape, cfg)
        g = torch.Generator().manual_seed(1)
        ids = torch.randint(0, cfg.vocab_size, (batch, seq), generator=g).to(device)
        mask = torch.ones_like(ids)
        autocast = (torch.autocast("cuda", dtype=torch.bfloat16) if device.type == "cuda"
                    else torch.autocast("cpu", enabled=False))

        def logprobs(m):
            with torch.no_grad(), autocast:
                logits = m(input_ids=ids, attention_mask=mask).logits
            return torch.log_softmax(logits[:, :-1].float(), -1).gather(-1, ids[:, 1:, None])[..., 0]

        mine = logprobs(model)
        if rank == 0:
            with torch.device(device):
                hf = Qwen2ForCausalLM(cfg)
            hf.load_state_dict(full, strict=False)  # the tied-free HF names; rotary buffers keep their own
            want = logprobs(hf.eval())
            gap = (mine - want).abs()
            report["logprob_abs_diff_vs_hf"] = {"max": gap.max().item(), "mean": gap.mean().item()}
            del hf
        del full
        if device.type == "cuda":
            torch.cuda.empty_cache()

        opt = torch.optim.AdamW(model.parameters(), lr=1e-6)

        def step():
            opt.zero_grad(set_to_none=True)
            with autocast:
                logits = model(input_ids=ids, attention_mask=mask).logits
            logp = torch.log_softmax(logits[:, :-1].float(), -1).gather(-1, ids[:, 1:, None])[..., 0]
            loss = -logp.mean()
            loss.backward()
            opt.step()
            return loss.detach()

        def sync():
            if device.type == "cuda":
                torch.cuda.synchronize()

        losses = [step() for _ in range(1 if smoke else 2)]
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats()
        times = []
        for _ in range(steps):
            sync()
            t0 = time.perf_counter()
            losses.append(step())
            sync()
            times.append(time.perf_counter() - t0)
        t = statistics.median(times)
        peak = torch.cuda.max_memory_allocated() / 2**30 if device.type == "cuda" else None
        peaks: list = [None] * TP
        dist.all_gather_object(peaks, peak)
        report.update({"params": n_params, "tokens_per_step": batch * seq, "step_s": t, "step_times_s": times,
                       "tokens_per_s": batch * seq / t, "mfu": 6 * n_params * batch * seq / t / (TP * PEAK_FLOPS),
                       "losses": [float(x) for x in losses], "peak_memory_gb_per_gpu": peaks})
    except Exception:
        report["error"] = traceback.format_exc()
        print(report["error"], file=sys.stderr, flush=True)
    finally:
        if rank == 0:
            Path(out).write_text(json.dumps(report, indent=1))
        from gymv.backends.training.process_group import leave_process_group

        leave_process_group()


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--cpu-smoke", action="store_true")
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seq", type=int, default=1024)
    ap.add_argument("--steps", type=int, default=3)
    a = ap.parse_args()
    import megatron.core
    import torch
    import torch.multiprocessing as mp
    import transformers

    batch, seq, steps = (2, 32, 2) if a.cpu_smoke else (a.batch, a.seq, a.steps)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    rank_out = a.out.with_suffix(".rank0.json")
    try:
        mp.spawn(rank_main, args=(port, str(rank_out), a.cpu_smoke, batch, seq, steps), nprocs=TP, join=True)
        status = 0
    except Exception:
        traceback.print_exc()
        status = 1
    report = json.loads(rank_out.read_text()) if rank_out.exists() else {"error": "rank 0 wrote nothing"}
    rank_out.unlink(missing_ok=True)
    report.update({"shape": SMOKE if a.cpu_smoke else SHAPE, "tensor_parallel": TP, "batch": batch, "seq": seq,
                   "torch": torch.__version__, "transformers": transformers.__version__,
                   "megatron_core": megatron.core.__version__, "peak_flops_per_gpu": PEAK_FLOPS,
                   "device": "cpu (gloo)" if a.cpu_smoke else torch.cuda.get_device_name()})
    a.out.write_text(json.dumps(report, indent=1))
    return status if "error" not in report else 1


if __name__ == "__main__":
    sys.exit(main())
