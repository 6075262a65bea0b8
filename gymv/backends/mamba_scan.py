"""Mamba-2 in plain torch: the depthwise causal convolution and the chunked state-space-duality (SSD) scan, both
taking the starts of a packed row's segments so that no convolution window or SSM state crosses from one
sequence into the next.

Why gymv has its own: megatron-core's Mamba mixer calls the CUDA kernels of `mamba_ssm` and `causal_conv1d`,
and transformers' torch path takes no segment boundaries. This is the CPU (and reference) path of gymv's
Megatron hybrid model (gymv.backends.training.megatron_hybrid); any backend may use it.

The scan, per sequence: h_t = exp(dt_t * A) h_{t-1} + dt_t * B_t x_t^T, y_t = C_t h_t + D x_t, with the state
[heads, head_dim, state] starting at zero. Chunked: within a chunk of `chunk` positions the outputs are a
masked, decay-weighted product of C and B (quadratic in the chunk), and the state passes from chunk to chunk
through one recurrence step per chunk. A packed row is scanned segment by segment (each from a zero state);
the float32 arithmetic matches transformers' torch path to rounding.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import Tensor


def causal_conv(x: Tensor, weight: Tensor, bias: Tensor | None, starts: Sequence[int] | None = None) -> Tensor:
    """Depthwise causal convolution over time. x [B, T, C], weight [C, K], bias [C] -> [B, T, C]; with `starts`
    (segment starts, 0 first), every segment sees zeros before its first position."""
    def one(part: Tensor) -> Tensor:
        k = weight.shape[-1]
        out = F.conv1d(part.transpose(1, 2), weight[:, None, :], bias, padding=k - 1, groups=weight.shape[0])
        return out[..., : part.shape[1]].transpose(1, 2)

    return _per_segment(one, x, starts)


def _per_segment(fn, x: Tensor, starts: Sequence[int] | None, *others: Tensor) -> Tensor:
    if not starts or len(starts) == 1:
        return fn(x, *others)
    bounds = [*starts, x.shape[1]]
    parts = [fn(x[:, a:b], *(o[:, a:b] for o in others)) for a, b in zip(bounds[:-1], bounds[1:]) if b > a]
    return torch.cat(parts, dim=1)


def ssd_scan(x: Tensor, dt: Tensor, A: Tensor, B: Tensor, C: Tensor, D: Tensor | None, chunk: int,
             starts: Sequence[int] | None = None) -> Tensor:
    """The SSD scan in float32. x [b, T, heads, P], dt [b, T, heads] (after bias, softplus and clamping),
    A [heads] (negative), B and C [b, T, groups, N] (groups divide heads; head h reads group h // (heads /
    groups)), D [heads] -> y [b, T, heads, P]; `starts` as in `causal_conv`."""
    heads = x.shape[2]
    rep = heads // B.shape[2]
    B = B.float().repeat_interleave(rep, dim=2)
    C = C.float().repeat_interleave(rep, dim=2)

    def one(xs: Tensor, dts: Tensor, Bs: Tensor, Cs: Tensor) -> Tensor:
        return _scan(xs.float(), dts.float(), A.float(), Bs, Cs, chunk)

    y = _per_segment(one, x, starts, dt, B, C)
    if D is not None:
        y = y + D.float()[:, None] * x.float()
    return y


def _scan(x: Tensor, dt: Tensor, A: Tensor, B: Tensor, C: Tensor, chunk: int) -> Tensor:
    b, t, h, p = x.shape
    n = B.shape[-1]
    pad = (-t) % chunk
    if pad:
        x, dt, B, C = (F.pad(v, (0, 0) * (v.dim() - 2) + (0, pad)) for v in (x, dt, B, C))
    c = (t + pad) // chunk
    xdt = (x * dt[..., None]).reshape(b, c, chunk, h, p)
    B, C = B.reshape(b, c, chunk, h, n), C.reshape(b, c, chunk, h, n)
    a = (dt * A).reshape(b, c, chunk, h)
    cum = a.cumsum(dim=2)  # [b, c, l, h]: log-decay from the chunk's start through position l
    # within a chunk: y_l = sum_{s <= l} exp(cum_l - cum_s) (C_l . B_s) xdt_s
    diff = cum[:, :, :, None, :] - cum[:, :, None, :, :]  # [b, c, l, s, h]
    causal = torch.ones(chunk, chunk, dtype=torch.bool, device=x.device).tril()
    decay = torch.where(causal[None, None, :, :, None], diff, torch.full_like(diff, float("-inf"))).exp()
    scores = torch.einsum("bclhn,bcshn->bclsh", C, B) * decay
    y = torch.einsum("bclsh,bcshp->bclhp", scores, xdt)
    # each chunk's own contribution to the state at its end, then the state carried chunk to chunk
    to_end = (cum[:, :, -1:, :] - cum).exp()  # [b, c, l, h]
    own = torch.einsum("bclhn,bclh,bclhp->bchpn", B, to_end, xdt)
    state = x.new_zeros(b, h, p, n)
    carried = []
    for i in range(c):
        carried.append(state)
        state = state * cum[:, i, -1, :].exp()[..., None, None] + own[:, i]
    start = torch.stack(carried, dim=1)  # [b, c, h, p, n]: the state entering each chunk
    y = y + torch.einsum("bclhn,bchpn,bclh->bclhp", C, start, cum.exp())
    return y.reshape(b, c * chunk, h, p)[:, :t]
