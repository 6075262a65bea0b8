"""Decode attention over a static KV cache: one query token per row against a window of cached columns.

PyTorch's SDPA reads a decode step's K and V at under half the copy bandwidth (one block per (row, head)
walks the whole window). The split-sequence kernel here cuts the window into pieces, one program per
(row, kv head, piece), each keeping a running max and sum of its piece (online softmax); a second
kernel merges the pieces. The query heads that share a kv head are handled together, so each K and V
column is read once. Used when triton is importable and the tensors are on CUDA (or when
TRITON_INTERPRET=1, which runs it on the CPU for tests; the interpreter's bf16 matrix product is wrong, so
there the products run in float32); `attend` falls back to SDPA otherwise.
"""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F

try:  # triton is optional: CPU installs run SDPA
    import triton
    import triton.language as tl
except Exception:  # noqa: BLE001 - a broken triton install must not break the CPU path
    triton = None

BLOCK_N = 32  # cache columns per inner iteration
TARGET_PROGRAMS = 512  # enough (row, head, piece) programs to keep an H200's 132 SMs busy


def interpreted() -> bool:
    return os.environ.get("TRITON_INTERPRET", "") == "1"


def available(device: torch.device, head_dim: int) -> bool:
    """Whether the split kernel can run here: triton present, CUDA (or the interpreter), a power-of-two head dim."""
    ok_dim = head_dim >= 16 and head_dim & (head_dim - 1) == 0
    return triton is not None and ok_dim and (device.type == "cuda" or interpreted())


def splits_for(batch: int, kv_heads: int, window: int) -> int:
    """How many pieces to cut a window into: enough programs for the GPU, at least BLOCK_N columns each."""
    most = max(1, -(-window // BLOCK_N))
    return max(1, min(most, -(-TARGET_PROGRAMS // max(1, batch * kv_heads))))


def sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, valid: torch.Tensor, window: int,
         scale: float) -> torch.Tensor:
    """q [B, H, G, D] against k, v [B, H, S, D] over columns < window where `valid` [B, S] holds."""
    bias = torch.zeros(q.shape[0], 1, 1, window, dtype=q.dtype, device=q.device)
    bias = bias.masked_fill(~valid[:, None, None, :window], float("-inf"))
    return F.scaled_dot_product_attention(q, k[:, :, :window], v[:, :, :window], attn_mask=bias, scale=scale)


if triton is not None:
    @triton.jit
    def _piece(Q, K, V, VALID, O, M, L,
               s_qb, s_qh, s_qg, s_kb, s_kh, s_ks, s_vb, s_vh, s_vs, s_valid,
               s_ob, s_oh, s_os, s_og, s_mb, s_mh, s_ms,
               window, per_piece, scale, G,
               BLOCK_G: tl.constexpr, BLOCK_N: tl.constexpr, D: tl.constexpr, DOT_F32: tl.constexpr):
        b = tl.program_id(0)
        h = tl.program_id(1)
        s = tl.program_id(2)
        offs_g = tl.arange(0, BLOCK_G)
        offs_d = tl.arange(0, D)
        offs_n = tl.arange(0, BLOCK_N)
        q = tl.load(Q + b * s_qb + h * s_qh + offs_g[:, None] * s_qg + offs_d[None, :],
                    mask=offs_g[:, None] < G, other=0.0)
        if DOT_F32:
            q = q.to(tl.float32)
        m_i = tl.full([BLOCK_G], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_G], tl.float32)
        acc = tl.zeros([BLOCK_G, D], tl.float32)
        start = s * per_piece
        end = tl.minimum(start + per_piece, window)
        for n0 in range(start, end, BLOCK_N):
            cols = n0 + offs_n
            ok = (tl.load(VALID + b * s_valid + cols, mask=cols < end, other=0) != 0) & (cols < end)
            k = tl.load(K + b * s_kb + h * s_kh + cols[:, None] * s_ks + offs_d[None, :], mask=ok[:, None], other=0.0)
            if DOT_F32:
                k = k.to(tl.float32)
            sc = tl.dot(q, tl.trans(k)) * scale
            sc = tl.where(ok[None, :], sc, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(sc, 1))
            m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
            alpha = tl.exp(m_i - m_use)
            p = tl.exp(sc - m_use[:, None])
            l_i = l_i * alpha + tl.sum(p, 1)
            v = tl.load(V + b * s_vb + h * s_vh + cols[:, None] * s_vs + offs_d[None, :], mask=ok[:, None], other=0.0)
            if DOT_F32:
                v = v.to(tl.float32)
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
            m_i = m_new
        gm = offs_g < G
        tl.store(O + b * s_ob + h * s_oh + s * s_os + offs_g[:, None] * s_og + offs_d[None, :], acc,
                 mask=gm[:, None])
        tl.store(M + b * s_mb + h * s_mh + s * s_ms + offs_g, m_i, mask=gm)
        tl.store(L + b * s_mb + h * s_mh + s * s_ms + offs_g, l_i, mask=gm)

    @triton.jit
    def _merge(O, M, L, OUT, s_ob, s_oh, s_os, s_og, s_mb, s_mh, s_ms, s_rb, s_rh, s_rg, pieces, G,
               BLOCK_S: tl.constexpr, BLOCK_G: tl.constexpr, D: tl.constexpr):
        b = tl.program_id(0)
        h = tl.program_id(1)
        offs_s = tl.arange(0, BLOCK_S)
        offs_g = tl.arange(0, BLOCK_G)
        offs_d = tl.arange(0, D)
        sg = (offs_s[:, None] < pieces) & (offs_g[None, :] < G)
        at = b * s_mb + h * s_mh + offs_s[:, None] * s_ms + offs_g[None, :]
        m = tl.load(M + at, mask=sg, other=float("-inf"))
        top = tl.max(m, 0)
        top = tl.where(top == float("-inf"), 0.0, top)
        w = tl.exp(m - top[None, :])
        den = tl.sum(w * tl.load(L + at, mask=sg, other=0.0), 0)
        o = tl.load(O + b * s_ob + h * s_oh + offs_s[:, None, None] * s_os + offs_g[None, :, None] * s_og
                    + offs_d[None, None, :], mask=sg[:, :, None], other=0.0)
        num = tl.sum(o * w[:, :, None], 0)
        den = tl.where(den == 0.0, 1.0, den)
        out = num / den[:, None]
        tl.store(OUT + b * s_rb + h * s_rh + offs_g[:, None] * s_rg + offs_d[None, :],
                 out.to(OUT.dtype.element_ty), mask=offs_g[:, None] < G)


def split_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, valid: torch.Tensor, window: int,
                    scale: float, pieces: int | None = None, block_n: int = BLOCK_N) -> torch.Tensor:
    """The split-sequence kernel: same contract as `sdpa` (k, v may be longer than `window`; the last dim of
    every tensor contiguous). A row with no valid column gets zeros, where SDPA gives NaN."""
    B, H, G, D = q.shape
    pieces = splits_for(B, H, window) if pieces is None else pieces
    per_piece = -(-(-(-window // pieces)) // block_n) * block_n
    pieces = -(-window // per_piece)
    o = torch.empty(B, H, pieces, G, D, dtype=torch.float32, device=q.device)
    m = torch.empty(B, H, pieces, G, dtype=torch.float32, device=q.device)
    lsum = torch.empty_like(m)
    out = torch.empty_like(q)
    ok = valid.view(torch.uint8) if valid.dtype == torch.bool else valid
    block_g = max(16, triton.next_power_of_2(G))
    _piece[(B, H, pieces)](q, k, v, ok, o, m, lsum,
                           q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2),
                           v.stride(0), v.stride(1), v.stride(2), ok.stride(0),
                           o.stride(0), o.stride(1), o.stride(2), o.stride(3), m.stride(0), m.stride(1), m.stride(2),
                           window, per_piece, scale, G, BLOCK_G=block_g, BLOCK_N=block_n, D=D,
                           DOT_F32=interpreted())
    _merge[(B, H)](o, m, lsum, out, o.stride(0), o.stride(1), o.stride(2), o.stride(3),
                   m.stride(0), m.stride(1), m.stride(2), out.stride(0), out.stride(1), out.stride(2), pieces, G,
                   BLOCK_S=max(2, triton.next_power_of_2(pieces)), BLOCK_G=max(2, triton.next_power_of_2(G)), D=D)
    return out


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, valid: torch.Tensor, window: int, scale: float, *,
           kernel: str = "auto") -> torch.Tensor:
    """Decode attention with `kernel` "split" (the triton kernel), "sdpa", or "auto" (split where available)."""
    if kernel == "split" or (kernel == "auto" and available(q.device, q.shape[-1])):
        return split_attention(q, k, v, valid, window, scale)
    return sdpa(q, k, v, valid, window, scale)
