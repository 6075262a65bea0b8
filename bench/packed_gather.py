"""The key/value gather of a packed row with shared prompts, forward and backward: index_select's autograd
(backward: index_add_, atomic adds on CUDA) against gymv.backends.packed_gather (backward: gathers and a
reduction over each position's copies, no atomics), and torch.segment_reduce over the copies sorted by
position for comparison.

The row is a GRPO-like micro-batch as `pack` lays it out: 16 groups of 8 members, prompts of ~400 tokens,
completions lognormal with median 300 clipped to 16..1536; keys [N, 8 kv heads, 128]; K and V gathered
together, as packed attention does once per layer. Then the gathered keys and values widened to the 16
query heads, as packed attention does for a varlen kernel without grouped-query attention (torch 2.11):
repeat_interleave's autograd against gymv.backends.packed_attention.repeat_heads. On CUDA, one layer's whole
packed attention (gather, widening, varlen kernel) with the keys widened and copied, against the input layout
the kernel's one-time check accepted. Each variant's median over the timed repeats (device
events on CUDA), its largest difference from index_select's gradient, and whether two backwards agree bit
for bit.

Usage (on a GPU machine): python bench/packed_gather.py [--groups 16] [--members 8] [--repeats 50]
       on a CPU, to check the script: python bench/packed_gather.py --cpu [--groups 2]
"""

from __future__ import annotations

import argparse
import json
import math
import random
import statistics
import time


def layout(groups: int, members: int, prompt: int, seed: int):
    import torch

    from gymv.backends.packing import pack

    rng = random.Random(seed)
    prefixes, lengths = [], []
    for g in range(groups):
        plen = rng.randint(int(prompt * 0.85), int(prompt * 1.15))
        for _ in range(members):
            prefixes.append((g, plen))
            lengths.append(plen + min(1536, max(16, round(rng.lognormvariate(math.log(300), 0.6)))))
    width = max(lengths)
    ids = torch.zeros(len(lengths), width, dtype=torch.long)
    mask = (torch.arange(width)[None] < torch.tensor(lengths)[:, None]).long()
    return pack(ids, mask, [[] for _ in lengths], prefixes)


def _segment_reduce_plan(index, n: int, device):
    import torch

    order = torch.sort(index.cpu(), stable=True).indices
    lengths = torch.bincount(index.cpu(), minlength=n)
    return order.to(device), lengths.to(device)


def _segment_reduce_gather(index, order, lengths):
    """index_select forward; backward: the gradients sorted by position, then torch.segment_reduce."""
    import torch

    class Fn(torch.autograd.Function):
        @staticmethod
        def forward(ctx, *ts):
            return tuple(t.index_select(0, index) for t in ts)

        @staticmethod
        def backward(ctx, *gs):
            return tuple(torch.segment_reduce(g.index_select(0, order), "sum", lengths=lengths, axis=0) for g in gs)

    return Fn.apply


def measure(args) -> dict:
    import torch

    from gymv.backends.packed_attention import repeat_heads
    from gymv.backends.packed_gather import KeyGather, gather

    device = "cpu" if args.cpu or not torch.cuda.is_available() else "cuda"
    dtype = torch.float32 if device == "cpu" else torch.bfloat16
    row = layout(args.groups, args.members, args.prompt, args.seed)
    n = row.input_ids.numel()
    t0 = time.perf_counter()
    KeyGather.build(row.keys.index, n)
    build_ms = (time.perf_counter() - t0) * 1e3
    plan = row.keys.to(device)
    index = plan.index
    order, lengths = _segment_reduce_plan(index, n, device)
    g = torch.Generator(device="cpu").manual_seed(0)
    k, v = (torch.randn(n, args.kv_heads, args.head_dim, generator=g).to(device, dtype).requires_grad_(True)
            for _ in range(2))
    grads = [torch.randn(index.numel(), args.kv_heads, args.head_dim, generator=g).to(device, dtype)
             for _ in range(2)]
    variants = {
        "index_select (autograd)": lambda: (k.index_select(0, index), v.index_select(0, index)),
        "KeyGather (gymv)": lambda: gather(plan, k, v),
        "segment_reduce": lambda f=_segment_reduce_gather(index, order, lengths): f(k, v),
    }
    # the gathered keys and values widened to the query heads, for a kernel without grouped-query attention
    kg, vg = (t.detach().index_select(0, index).requires_grad_(True) for t in (k, v))
    groups = args.q_heads // args.kv_heads
    wide = [torch.randn(index.numel(), args.q_heads, args.head_dim, generator=g).to(device, dtype) for _ in range(2)]
    head_variants = {
        "heads: repeat_interleave": lambda: (kg.repeat_interleave(groups, 1), vg.repeat_interleave(groups, 1)),
        "heads: repeat_heads (gymv)": lambda: (repeat_heads(kg, groups), repeat_heads(vg, groups)),
    }
    cuda = device == "cuda"

    def clock(fn) -> float:
        if cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            return start.elapsed_time(end)
        t = time.perf_counter()
        fn()
        return (time.perf_counter() - t) * 1e3

    rows = _time(variants, (k, v), grads, clock, args) + _time(head_variants, (kg, vg), wide, clock, args)
    rows += _attention_rows(row, n, device, dtype, g, clock, args) if cuda else []
    return {"device": torch.cuda.get_device_name() if cuda else "cpu", "dtype": str(dtype).split(".")[-1],
            "row_tokens": n, "gathered_keys": index.numel(), "repeated_positions": plan.repeated.numel(),
            "copy_counts": [t.shape[0] for t in plan.tables], "plan_build_ms": build_ms, "torch": torch.__version__,
            "rows": rows}


def _attention_rows(row, n: int, device, dtype, g, clock, args) -> list[dict]:
    """One layer's packed attention through the varlen kernel (gather, widening, kernel), forward and backward:
    keys widened to the query heads and contiguous copies, against the input layout the one-time check
    accepted (grouped-query keys with their own heads, strided views)."""
    import torch

    from gymv.backends import packed_attention

    dev = torch.device(device)
    if packed_attention._varlen_kernel() is None or not all(packed_attention._varlen_checks(dev, dtype)):
        return []
    gqa, views = packed_attention._varlen_inputs(dev, dtype)
    attn = row.attention_args(device)
    q, k, v = (torch.randn(1, h, n, args.head_dim, generator=g).to(device, dtype).requires_grad_(True)
               for h in (args.q_heads, args.kv_heads, args.kv_heads))
    out_grad = [torch.randn(1, n, args.q_heads, args.head_dim, generator=g).to(device, dtype)]
    call = packed_attention._call_varlen
    variants = {"attention: widened heads, copies": lambda: (call(q, k, v, attn, None),)}
    if gqa or views:
        variants[f"attention: own heads {gqa}, views {views}"] = lambda: (call(q, k, v, attn, None, gqa=gqa,
                                                                               views=views),)
    return _time(variants, (q, k, v), out_grad, clock, args)


def _time(variants: dict, inputs: tuple, grads: list, clock, args) -> list[dict]:
    """Median forward and backward times of each variant; gradients compared with the first variant's."""
    import torch

    ref = None
    rows = []
    for name, fwd in variants.items():
        def backward(out):
            return torch.autograd.grad(out, inputs, grads)

        got = backward(fwd())
        again = backward(fwd())
        if ref is None:
            ref = got
        diff = max(float((a.float() - b.float()).abs().max()) for a, b in zip(got, ref))
        same = all(torch.equal(a, b) for a, b in zip(got, again))
        for _ in range(args.warmup):
            backward(fwd())
        fwd_ms, bwd_ms = [], []
        for _ in range(args.repeats):
            box = {}
            fwd_ms.append(clock(lambda: box.setdefault("out", fwd())))
            bwd_ms.append(clock(lambda: backward(box["out"])))
        rows.append({"variant": name, "forward_ms": statistics.median(fwd_ms),
                     "backward_ms": statistics.median(bwd_ms), "max_grad_diff": diff, "deterministic": same})
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--cpu", action="store_true", help="run on the CPU (fp32), to check the script")
    p.add_argument("--groups", type=int, default=16)
    p.add_argument("--members", type=int, default=8)
    p.add_argument("--prompt", type=int, default=400)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--q-heads", type=int, default=16)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--repeats", type=int, default=50)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", help="also write the result as JSON here")
    args = p.parse_args()
    if args.cpu:
        args.repeats, args.warmup = min(args.repeats, 3), min(args.warmup, 1)
    res = measure(args)
    print(f"{res['device']} {res['dtype']} torch {res['torch']}: row of {res['row_tokens']} tokens, "
          f"{res['gathered_keys']} gathered keys, {res['repeated_positions']} shared-prompt positions, "
          f"copies per position {res['copy_counts']}, plan built in {res['plan_build_ms']:.1f} ms on the host")
    print(f"{'variant':<44}{'forward ms':>12}{'backward ms':>13}{'max |grad diff|':>17}{'deterministic':>15}")
    for r in res["rows"]:
        print(f"{r['variant']:<44}{r['forward_ms']:>12.3f}{r['backward_ms']:>13.3f}{r['max_grad_diff']:>17.3g}"
              f"{str(r['deterministic']):>15}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
