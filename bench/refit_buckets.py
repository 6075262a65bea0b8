"""Trainer-side peak memory and time of a streamed refit, whole buffer vs buckets.

A sender streams freshly made tensors (as a sharded trainer's gathers) to one receiver process over the
`collective` transport on gloo (the code path behind `nccl`). Each configuration runs in a fresh process, so
its peak resident memory (`ru_maxrss`) is its own; the layout is made from untouched `torch.empty` tensors,
which take no resident memory.

    python bench/refit_buckets.py --tensors 16 --tensor-mb 32 --bucket-mb 0 64 16
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import resource
import subprocess
import sys
import time


def _receive(info, rounds: int) -> None:
    from gymv.cluster.refit import make_receiver

    r = make_receiver("collective", "cpu", info, 1)
    r.connect()
    for _ in range(rounds):
        r.receive(None)


def _rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux: KiB


def run_one(tensors: int, tensor_mb: float, bucket_mb: float, rounds: int = 2) -> dict:
    import torch

    from gymv.cluster.refit import make_sender

    numel = int(tensor_mb * 2**20) // 4
    shapes = {f"layer{i}.weight": (numel,) for i in range(tensors)}
    sender = make_sender("collective", torch.float32, "cpu", num_receivers=1, bucket_mb=bucket_mb)
    info = sender.rendezvous({k: torch.empty(s) for k, s in shapes.items()})
    proc = mp.get_context("spawn").Process(target=_receive, args=(info, rounds))
    proc.start()
    sender.connect()
    base = _rss_mb()
    seconds = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        sender.publish((k, torch.ones(s)) for k, s in shapes.items())  # each a fresh "gathered" tensor
        seconds.append(time.perf_counter() - t0)
    proc.join(timeout=600)
    return {"bucket_mb": bucket_mb, "model_mb": tensors * tensor_mb, "tensor_mb": tensor_mb,
            "peak_extra_mb": round(_rss_mb() - base, 1), "refit_s": round(min(seconds), 3)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tensors", type=int, default=16)
    ap.add_argument("--tensor-mb", type=float, default=32)
    ap.add_argument("--bucket-mb", type=float, nargs="+", default=[0, 64, 16])
    ap.add_argument("--one", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.one:
        print(json.dumps(run_one(args.tensors, args.tensor_mb, args.bucket_mb[0])))
        return
    for b in args.bucket_mb:
        out = subprocess.run([sys.executable, __file__, "--one", "--tensors", str(args.tensors), "--tensor-mb",
                              str(args.tensor_mb), "--bucket-mb", str(b)], check=True, capture_output=True, text=True)
        print(out.stdout.strip().splitlines()[-1])


if __name__ == "__main__":
    main()
