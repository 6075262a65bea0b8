"""GPU refit transports: CUDA IPC between two processes on one GPU, NCCL broadcast between two GPUs.

Skipped without CUDA (tests/conftest.py); the same sender/receiver code paths run on CPU in
test_train_refit.py (object_store, shm, and the collective path over gloo).
"""

from __future__ import annotations

import pytest
import torch
import torch.multiprocessing as mp

from gymv.cluster.refit import make_receiver, make_sender, weights_hash

pytestmark = pytest.mark.gpu


def _state(device):
    g = torch.Generator().manual_seed(0)
    return {"a.weight": torch.randn(64, 32, generator=g).to(device), "a.bias": torch.randn(64, generator=g).to(device),
            "b.weight": torch.randn(8, 64, generator=g).to(device)}


def _ipc_child(payload, out):
    torch.cuda.set_device(0)
    got = make_receiver("cuda_ipc", "cuda:0").receive(payload)
    out.put(weights_hash(got))
    torch.cuda.synchronize()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cuda_ipc_hands_the_weights_to_another_process_on_the_same_gpu(dtype):
    sd = _state("cuda:0")
    sender = make_sender("cuda_ipc", dtype, "cuda:0")
    payload = sender.publish(sd)
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    p = ctx.Process(target=_ipc_child, args=(payload, out))
    p.start()
    got = out.get(timeout=120)
    p.join(timeout=60)
    assert got == weights_hash(sd, dtype)


def _nccl_receiver(info, out):
    torch.cuda.set_device(1)
    r = make_receiver("nccl", "cuda:1", info, rank=1)
    r.connect()
    out.put(weights_hash(r.receive(None)))


@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_nccl_broadcasts_the_weights_to_a_generator_on_another_gpu():
    torch.cuda.set_device(0)
    sd = _state("cuda:0")
    sender = make_sender("nccl", torch.bfloat16, "cuda:0", num_receivers=1)
    info = sender.rendezvous(sd)
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    p = ctx.Process(target=_nccl_receiver, args=(info, out))
    p.start()
    sender.connect()
    sender.publish(sd)
    got = out.get(timeout=120)
    p.join(timeout=60)
    assert got == weights_hash(sd, torch.bfloat16)


def _nccl_sharing_sender(rank, infos, go):
    """Training rank `rank` of two, both on GPU 0 (two processes; each group holds one device per rank)."""
    torch.cuda.set_device(0)
    sd = _state("cuda:0")
    sender = make_sender("nccl", torch.bfloat16, "cuda:0", num_receivers=1, bucket_mb=0.002, rank=rank, senders=2)
    infos.put((rank, sender.rendezvous(sd)))
    go.get(timeout=120)
    sender.connect()
    sender.publish(iter(sd.items()))  # its share: buckets rank, rank + 2, ...
    torch.cuda.synchronize()
    sender.close()


@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_two_ranks_broadcast_their_shares_of_a_refit_over_nccl_to_a_generator_on_another_gpu():
    ctx = mp.get_context("spawn")
    infos, go = ctx.Queue(), ctx.Queue()
    senders = [ctx.Process(target=_nccl_sharing_sender, args=(r, infos, go)) for r in range(2)]
    for p in senders:
        p.start()
    got = dict(infos.get(timeout=120) for _ in senders)
    assert len(got[0]["spans"]) > 2  # several buckets, so each rank sends some
    for _ in senders:
        go.put(True)
    torch.cuda.set_device(1)
    receiver = make_receiver("nccl", "cuda:1", [got[0], got[1]], rank=1)
    receiver.connect()
    received = weights_hash(receiver.receive(None))
    for p in senders:
        p.join(timeout=60)
    assert received == weights_hash(_state("cuda:0"), torch.bfloat16)
