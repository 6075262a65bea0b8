"""Host-to-GPU copies that do not wait for the GPU.

A copy from pageable host memory to a GPU first waits for every kernel queued before it, so each `.to("cuda")`
of a small index tensor in the middle of a training step lets the GPU run dry while the host prepares the
next micro-batch (packing, image preprocessing). A copy from pinned memory is queued like a kernel and the
host moves on; the pinned buffer is kept until the copy has run.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

_ALIGN = 16  # every tensor's bytes start at a multiple of this in the shared buffer (any dtype can view them)


def to_device(t: torch.Tensor, device) -> torch.Tensor:
    """`t` on `device`; from host memory to a GPU through a pinned buffer, without waiting."""
    import torch

    device = torch.device(device)
    if device.type == "cuda" and t.device.type == "cpu":
        return t.pin_memory().to(device, non_blocking=True)
    return t.to(device)


def to_device_many(tensors: Sequence[torch.Tensor], device) -> list[torch.Tensor]:
    """Host tensors on a GPU through one pinned buffer and one copy: a packed forward pass moves a dozen small
    index tensors, and pinning each costs the host more than copying it. The results are views of one device
    buffer, with each tensor's dtype and shape."""
    import torch

    device = torch.device(device)
    if device.type != "cuda" or any(t.device.type != "cpu" for t in tensors):
        return [to_device(t, device) for t in tensors]
    flat = [t.detach().contiguous().reshape(-1).view(torch.uint8) for t in tensors]
    starts, total = [], 0
    for f in flat:
        starts.append(total)
        total += -(-f.numel() // _ALIGN) * _ALIGN
    buffer = torch.empty(max(total, 1), dtype=torch.uint8, pin_memory=True)
    for f, start in zip(flat, starts):
        buffer[start:start + f.numel()].copy_(f)
    on_device = buffer.to(device, non_blocking=True)
    return [on_device[start:start + f.numel()].view(t.dtype).view(t.shape)
            for t, f, start in zip(tensors, flat, starts)]
