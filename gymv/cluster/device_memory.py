"""A worker's GPU memory over one phase: its peak, and the cache it hands back when it shares the GPU.

Colocated workers (a generator and a trainer on one GPU, in separate processes) see each other's cached blocks
as memory in use. A trainer whose allocator keeps its activations' blocks after a step leaves the generator's
next batch that much less room: the static decoder sizes its batch from the free memory and runs the rest of
the requests in later waves. So a worker that shares its GPU hands its cache back at the end of each step
(`torch.cuda.empty_cache`; live tensors stay where they are), and every step's row says what the phase took.
"""

from __future__ import annotations

from typing import Any

GB = 1024**3


def phase_memory(device: Any, phase: str, *, release: bool) -> dict[str, float]:
    """`memory/<phase>_peak_gb` (the most allocated at once since the last call) and
    `memory/<phase>_reserved_gb` (the most the allocator held), then, with `release`, the cache handed back
    (`memory/<phase>_released_gb`). Peaks restart for the next phase. Nothing on a CPU."""
    import torch

    device = torch.device(device)
    if device.type != "cuda" or not torch.cuda.is_available():
        return {}
    out = {f"memory/{phase}_peak_gb": torch.cuda.max_memory_allocated(device) / GB,
           f"memory/{phase}_reserved_gb": torch.cuda.max_memory_reserved(device) / GB}
    torch.cuda.reset_peak_memory_stats(device)
    if release:
        before = torch.cuda.memory_reserved(device)
        torch.cuda.empty_cache()
        out[f"memory/{phase}_released_gb"] = (before - torch.cuda.memory_reserved(device)) / GB
    return out
