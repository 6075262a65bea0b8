"""Decode attention alone, at the static decoder's shapes: which kernel reads a KV cache fastest.

One query token per row, the query heads that share a kv head as a short query sequence (as
gymv.backends.generation.static does), an additive mask over the window; each variant's median over 50
timed repeats (device events), against the bytes it must read (K and V of the window) at the measured
copy bandwidth. Checks every variant against float32 math on the same inputs.

Usage (on a GPU machine): python bench/decode_attention.py [--batch 64] [--window 448]
"""

from __future__ import annotations

import argparse
import json
import statistics


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--window", type=int, default=448)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--groups", type=int, default=2)
    ap.add_argument("--head-dim", type=int, default=128)
    a = ap.parse_args()
    import torch
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    B, H, G, D, A = a.batch, a.kv_heads, a.groups, a.head_dim, a.window
    dt = torch.bfloat16
    q = torch.randn(B, H, G, D, device="cuda", dtype=dt)
    k = torch.randn(B, H, A + 64, D, device="cuda", dtype=dt)[:, :, :A]  # a window of a longer buffer
    v = torch.randn(B, H, A + 64, D, device="cuda", dtype=dt)[:, :, :A]
    valid = torch.rand(B, A, device="cuda") > 0.2
    valid[:, 0] = True
    bias = torch.zeros(B, 1, 1, A, device="cuda", dtype=dt).masked_fill(~valid[:, None, None, :], float("-inf"))
    scale = D ** -0.5
    ref = torch.softmax((q.float() @ k.float().transpose(-1, -2)) * scale + bias.float(), -1) @ v.float()

    def sdpa(backend):
        def f():
            with sdpa_kernel([backend]):
                return F.scaled_dot_product_attention(q, k, v, attn_mask=bias, scale=scale)
        return f

    def manual():
        s = torch.matmul(q, k.transpose(-1, -2)).float() * scale + bias
        return torch.matmul(torch.softmax(s, -1).to(dt), v)

    def default():
        return F.scaled_dot_product_attention(q, k, v, attn_mask=bias, scale=scale)

    variants = {"default": default, "cudnn": sdpa(SDPBackend.CUDNN_ATTENTION),
                "efficient": sdpa(SDPBackend.EFFICIENT_ATTENTION), "math": sdpa(SDPBackend.MATH), "manual": manual}
    a_big = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
    b_big = torch.empty_like(a_big)
    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    b_big.copy_(a_big)
    s.record()
    for _ in range(10):
        b_big.copy_(a_big)
    e.record()
    torch.cuda.synchronize()
    bw = 2 * a_big.numel() * 10 / (s.elapsed_time(e) / 1e3)
    need_us = 2 * B * H * A * D * 2 / bw * 1e6
    out = {"shape": dict(batch=B, kv_heads=H, groups=G, head_dim=D, window=A), "copy_bandwidth": bw,
           "bytes_floor_us": need_us, "variants": {}}
    for name, f in variants.items():
        try:
            got = f()
            err = ((got.float() - ref).norm() / ref.norm()).item()
            for _ in range(5):
                f()
            times = []
            for _ in range(50):
                s.record()
                for _ in range(10):
                    f()
                e.record()
                torch.cuda.synchronize()
                times.append(s.elapsed_time(e) / 10 * 1e3)
            us = statistics.median(times)
            out["variants"][name] = {"us": us, "rel_err": err, "of_floor": need_us / us}
        except Exception as ex:  # noqa: BLE001 - a backend may not take these inputs
            out["variants"][name] = {"error": f"{type(ex).__name__}: {str(ex)[:200]}"}
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
