"""Decode attention alone, at the static decoder's shapes: which kernel reads a KV cache fastest.

One query token per row, the query heads that share a kv head as a short query sequence (as
gymv.backends.generation.static does), an additive mask over the window; each variant's median over 50
timed repeats (device events), against the bytes it must read (K and V of the window) at the measured
copy bandwidth. Checks every variant against float32 math on the same inputs. `split` is gymv's
split-sequence triton kernel (gymv.backends.generation.decode_attention), reading the window of the
full-length cache in place as the decoder does.

Usage (on a GPU machine): python bench/decode_attention.py [--batches 1,64,256] [--window 448] [--out FILE]
       on a CPU, to check the script: TRITON_INTERPRET=1 python bench/decode_attention.py --cpu-smoke
"""

from __future__ import annotations

import argparse
import json
import statistics
import time


def measure(B: int, H: int, G: int, D: int, A: int, device: str, repeats: int) -> dict:
    import torch
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from gymv.backends.generation.decode_attention import split_attention, splits_for

    cuda = device == "cuda"
    dt = torch.bfloat16 if cuda else torch.float32
    q = torch.randn(B, H, G, D, device=device, dtype=dt)
    k_full = torch.randn(B, H, A + 64, D, device=device, dtype=dt)
    v_full = torch.randn(B, H, A + 64, D, device=device, dtype=dt)
    k, v = k_full[:, :, :A], v_full[:, :, :A]  # a window of a longer buffer
    valid_full = torch.rand(B, A + 64, device=device) > 0.2
    valid_full[:, 0] = True
    valid = valid_full[:, :A]
    bias = torch.zeros(B, 1, 1, A, device=device, dtype=dt).masked_fill(~valid[:, None, None, :], float("-inf"))
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

    def split():
        return split_attention(q, k_full, v_full, valid_full, A, scale)

    def split_with(pieces, block_n):
        return lambda: split_attention(q, k_full, v_full, valid_full, A, scale, pieces=pieces, block_n=block_n)

    variants = {"split": split, "default": default, "manual": manual}
    for pieces in (1, 2, 4, 8, 16):  # how the piece count and block size trade off on this device
        if pieces * 32 <= A:
            variants[f"split_p{pieces}_n32"] = split_with(pieces, 32)
        if pieces * 64 <= A:
            variants[f"split_p{pieces}_n64"] = split_with(pieces, 64)
    if cuda:
        variants.update(cudnn=sdpa(SDPBackend.CUDNN_ATTENTION), efficient=sdpa(SDPBackend.EFFICIENT_ATTENTION),
                        math=sdpa(SDPBackend.MATH))
    out = {"shape": dict(batch=B, kv_heads=H, groups=G, head_dim=D, window=A), "split_pieces": splits_for(B, H, A),
           "variants": {}}
    for name, f in variants.items():
        try:
            got = f()
            err = ((got.float() - ref).norm() / ref.norm()).item()
            for _ in range(3):
                f()
            times = []
            for _ in range(repeats):
                if cuda:
                    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                    s.record()
                    for _ in range(10):
                        f()
                    e.record()
                    torch.cuda.synchronize()
                    times.append(s.elapsed_time(e) / 10 * 1e3)
                else:
                    t0 = time.perf_counter()
                    f()
                    times.append((time.perf_counter() - t0) * 1e6)
            out["variants"][name] = {"us": statistics.median(times), "rel_err": err}
        except Exception as ex:  # noqa: BLE001 - a backend may not take these inputs
            out["variants"][name] = {"error": f"{type(ex).__name__}: {str(ex)[:200]}"}
    return out


def copy_bandwidth(device: str) -> float:
    import torch

    if device != "cuda":
        return 20e9
    a_big = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
    b_big = torch.empty_like(a_big)
    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    b_big.copy_(a_big)
    s.record()
    for _ in range(10):
        b_big.copy_(a_big)
    e.record()
    torch.cuda.synchronize()
    return 2 * a_big.numel() * 10 / (s.elapsed_time(e) / 1e3)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batches", default="1,64,256")
    ap.add_argument("--window", type=int, default=448)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--groups", type=int, default=2)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--out", default=None, help="also write the JSON here")
    ap.add_argument("--cpu-smoke", action="store_true", help="tiny shapes on the CPU (set TRITON_INTERPRET=1)")
    a = ap.parse_args()
    device, repeats = ("cpu", 2) if a.cpu_smoke else ("cuda", 50)
    H, G, D, A = a.kv_heads, a.groups, a.head_dim, a.window
    if a.cpu_smoke:
        H, D, A = 2, 32, 96
    bw = copy_bandwidth(device)
    result = {"copy_bandwidth": bw, "shapes": []}
    for B in (int(b) for b in a.batches.split(",")):
        row = measure(B if not a.cpu_smoke else min(B, 4), H, G, D, A, device, repeats)
        need_us = 2 * row["shape"]["batch"] * H * A * D * 2 / bw * 1e6
        row["bytes_floor_us"] = need_us
        for r in row["variants"].values():
            if "us" in r:
                r["of_floor"] = need_us / r["us"]
        result["shapes"].append(row)
        print(json.dumps(row), flush=True)
        if a.out:  # after every shape: a run cut short keeps what it measured
            with open(a.out, "w") as f:
                json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
