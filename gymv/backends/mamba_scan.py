"""Mamba-2's causal convolution and SSD scan over rows given by segment starts: thin adapters over the shared
torch scan (gymv.backends.ssd_scan, which takes a sequence index) for callers that hold a packed row's
segment starts, such as the context-parallel Mamba mixer (gymv.backends.training.megatron_cp). No state or
convolution window crosses a segment start; the arithmetic is ssd_scan's.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from gymv.backends.ssd_scan import chunk_scan, segment_conv1d, seq_idx_from_bounds


def _seq_idx(starts: Sequence[int] | None, batch: int, length: int, device) -> Tensor | None:
    if not starts or len(starts) == 1:
        return None
    return seq_idx_from_bounds([*starts, length], length, device).expand(batch, length).contiguous()


def causal_conv(x: Tensor, weight: Tensor, bias: Tensor | None, starts: Sequence[int] | None = None) -> Tensor:
    """Depthwise causal convolution over time, no activation. x [B, T, C], weight [C, K], bias [C] -> [B, T, C];
    with `starts` (segment starts, 0 first), every segment sees zeros before its first position."""
    return segment_conv1d(x, weight, bias, _seq_idx(starts, x.shape[0], x.shape[1], x.device))


def ssd_scan(x: Tensor, dt: Tensor, A: Tensor, B: Tensor, C: Tensor, D: Tensor | None, chunk: int,
             starts: Sequence[int] | None = None) -> Tensor:
    """The SSD scan in float32. x [b, T, heads, P], dt [b, T, heads] (after bias, softplus and clamping),
    A [heads] (negative), B and C [b, T, groups, N], D [heads] -> y [b, T, heads, P]; `starts` as in
    `causal_conv`."""
    seq_idx = _seq_idx(starts, x.shape[0], x.shape[1], x.device)
    return chunk_scan(x, dt.float(), A, B, C, chunk, D=D, seq_idx=seq_idx).to(torch.float32)
