"""Helpers over named weights that every backend and transport shares."""

from __future__ import annotations

import hashlib
from collections.abc import Mapping

import torch


def weights_hash(state_dict: Mapping[str, torch.Tensor], dtype: torch.dtype | None = None) -> str:
    """Content hash of named weights (optionally cast to `dtype` first): equal weights, equal hash."""
    h = hashlib.blake2b(digest_size=16)
    for name in sorted(state_dict):
        t = state_dict[name].detach()
        if dtype is not None:
            t = t.to(dtype)
        t = t.cpu().contiguous()
        h.update(f"{name}:{tuple(t.shape)}:{t.dtype}:".encode())
        h.update(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return h.hexdigest()
