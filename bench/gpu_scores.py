"""Logprobs and entropies over the vocabulary on one GPU: gymv's Triton kernel against its torch chunks.

For each shape (scored tokens x vocabulary, bf16 logits, a few forbidden ids, temperature 1), the median ms
of `gymv.backends.chunked_scores.chunked_scores` forward alone and forward plus backward (the logprobs'
gradient; the entropy returned, as a GRPO step asks for it), with GYMV_SCORES_KERNEL=1 (the Triton kernel,
gymv.backends.scores_kernel) and =0 (the torch chunks), the paths taking turns; with the bytes one pass over
the logits moves and the bandwidth that implies. Shapes: the 3-layer Nemotron Omni step's (12,667 scored
tokens, 131,072 ids) and the 0.8b GRPO shape's of bench/gpu_train.py (45,453 tokens, 151,936 ids).

  python bench/gpu_scores.py [--shapes 12667x131072,45453x151936] [--reps 5] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

SHAPES = "12667x131072,45453x151936"


def timed(fn) -> float:
    import torch

    torch.cuda.synchronize()
    t0 = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    return time.perf_counter() - t0


def measure(n: int, vocab: int, reps: int) -> list[dict]:
    import torch

    from gymv.backends import chunked_scores as cs
    from gymv.backends.sampling import forbidden_mask

    g = torch.Generator(device="cuda").manual_seed(0)
    logits = (3 * torch.randn(n, vocab, device="cuda", generator=g)).to(torch.bfloat16)
    target = torch.randint(0, vocab, (n,), device="cuda", generator=g)
    forbidden = forbidden_mask(vocab, [7, 8, 9], "cuda")
    weight = torch.randn(n, device="cuda", generator=g)
    leaf = logits.requires_grad_()

    def forward():
        with torch.no_grad():
            cs.chunked_scores(logits, target, forbidden, 1.0, True)

    def both():
        leaf.grad = None
        lp, _, _ = cs.chunked_scores(leaf, target, forbidden, 1.0, True)
        (lp * weight).sum().backward()

    times: dict = {}
    for path, switch in (("triton", "1"), ("torch_chunks", "0")):
        os.environ[cs.SWITCH] = switch
        for part, fn in (("forward", forward), ("forward_backward", both)):
            fn()  # warm-up (and the kernel's one-time check)
            times[(path, part)] = []
    for _ in range(reps):
        for (path, part) in times:
            os.environ[cs.SWITCH] = "1" if path == "triton" else "0"
            times[(path, part)].append(timed(forward if part == "forward" else both))
    pass_gb = n * vocab * 2 / 1e9
    rows = []
    for (path, part), ts in times.items():
        ms = statistics.median(ts) * 1e3
        passes = 1 if part == "forward" else 3  # read; read, read and write the gradient
        rows.append({"tokens": n, "vocab": vocab, "path": path, "part": part, "ms": ms,
                     "logits_gb": pass_gb, "gb_per_s_at_fewest_passes": passes * pass_gb / (ms / 1e3)})
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", default=SHAPES, help="tokens x vocabulary, comma separated")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--json", type=Path, help="write the rows here")
    a = ap.parse_args()
    import torch

    if not torch.cuda.is_available():
        sys.exit("no CUDA device: the kernel runs on CUDA only (its CPU test runs it under triton's interpreter)")
    rows = []
    for shape in a.shapes.split(","):
        n, vocab = (int(v) for v in shape.lower().split("x"))
        rows += measure(n, vocab, a.reps)
        torch.cuda.empty_cache()
    print(f"{torch.cuda.get_device_name(0)}, torch {torch.__version__}")
    print(f"{'tokens x vocab':>16} {'part':>17} {'triton ms':>10} {'torch chunks ms':>16} {'speed-up':>9} {'triton GB/s':>12}")
    by = {(r['tokens'], r['vocab'], r['path'], r['part']): r for r in rows}
    for (n, vocab, path, part), r in by.items():
        if path != "triton":
            continue
        peer = by[(n, vocab, "torch_chunks", part)]
        print(f"{f'{n}x{vocab}':>16} {part:>17} {r['ms']:10.2f} {peer['ms']:16.2f} {peer['ms'] / r['ms']:8.2f}x "
              f"{r['gb_per_s_at_fewest_passes']:12.0f}")
    if a.json:
        a.json.write_text(json.dumps({"device": torch.cuda.get_device_name(0), "torch": torch.__version__,
                                      "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
