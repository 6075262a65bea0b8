"""Masked reductions that stay finite when masked-out positions hold -inf or NaN.

`x * mask` turns a -inf at a masked position into NaN (and NaN gradients); `torch.where` does not, so every
reduction here selects instead of multiplying.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor


def as_bool(mask: Tensor) -> Tensor:
    return mask if mask.dtype == torch.bool else mask != 0


def masked_fill_zero(x: Tensor, mask: Tensor) -> Tensor:
    """`x` where `mask`, else 0; gradients reach only the kept positions."""
    return torch.where(as_bool(mask), x, torch.zeros((), dtype=x.dtype, device=x.device))


def masked_sum(x: Tensor, mask: Tensor, dim: int | None = None) -> Tensor:
    x = masked_fill_zero(x, mask)
    return x.sum() if dim is None else x.sum(dim)


def masked_mean(x: Tensor, mask: Tensor, dim: int | None = None) -> Tensor:
    """Mean over kept positions; 0 where nothing is kept (never NaN)."""
    count = as_bool(mask).sum() if dim is None else as_bool(mask).sum(dim)
    return masked_sum(x, mask, dim) / count.clamp(min=1).to(x.dtype)


def masked_max(x: Tensor, mask: Tensor) -> Tensor:
    m = as_bool(mask)
    if not bool(m.any()):
        return torch.zeros((), dtype=x.dtype, device=x.device)
    return x[m].max()


def masked_extreme(x: Tensor, mask: Tensor, *, largest: bool) -> Tensor:
    """Max (or min) over kept positions, -inf (or +inf) where none is kept: the neutral element of the max
    (min) that reduces it over micro-batches and ranks, found without the host waiting on the device."""
    fill = -math.inf if largest else math.inf
    if x.numel() == 0:
        return torch.tensor(fill, dtype=x.dtype, device=x.device)
    kept = torch.where(as_bool(mask), x, torch.full((), fill, dtype=x.dtype, device=x.device))
    return kept.amax() if largest else kept.amin()
