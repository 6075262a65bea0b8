"""Host-to-GPU copies that do not wait for the GPU.

A copy from pageable host memory to a GPU first waits for every kernel queued before it, so each `.to("cuda")`
of a small index tensor in the middle of a training step lets the GPU run dry while the host prepares the
next micro-batch (packing, image preprocessing). A copy from pinned memory is queued like a kernel and the
host moves on; the pinned buffer is kept until the copy has run.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch


def to_device(t: torch.Tensor, device) -> torch.Tensor:
    """`t` on `device`; from host memory to a GPU through a pinned buffer, without waiting."""
    import torch

    device = torch.device(device)
    if device.type == "cuda" and t.device.type == "cpu":
        return t.pin_memory().to(device, non_blocking=True)
    return t.to(device)
