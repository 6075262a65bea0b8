"""The Mamba-2 causal depthwise convolution with segment masking as one Triton kernel each way.

gymv.backends.ssd_scan.segment_conv1d (the reference, and the path on CPU) builds the convolution from K
shifted multiply-adds over [B, L, C] with a mask per tap: a dozen elementwise kernels forward and more
backward, each reading and writing the whole activation. `segment_conv1d_triton` computes the same thing
(same layout, same masking) reading x once forward and x and dy once backward:

forward   out[t] = act(bias + sum_k w[:, k] * x[t - K + 1 + k]), a term zero where its input lies before
          the row or in another sequence than t's (per seq_idx [B, L]); float32 accumulation, out in x's dtype.
backward  for each pair (t, u = t + d), d < K, where x[t] reaches out[u]: g[u] = dy[u] * act'(z[u]) (z, the
          pre-activation, recomputed from x rather than kept from the forward), dx[t] += w[K-1-d] g[u],
          dweight[:, K-1-d] += x[t] g[u], dbias += g[t]. Each program walks a span of rows of one block of
          channels and keeps its dweight and dbias sums in registers; the spans' sums are written apart and
          added up by torch afterwards, so the gradients are deterministic (no atomics).

Used on CUDA when `causal_conv1d` (a compiled extension) is not installed (gymv.backends.mamba_kernels), and
under TRITON_INTERPRET=1 on a CPU for the tests. triton is imported here only: the module imports without it.
"""

from __future__ import annotations

import torch

try:  # triton is optional: CPU installs run gymv.backends.ssd_scan.segment_conv1d
    import triton
    import triton.language as tl
except Exception:  # noqa: BLE001 - a broken triton install must not break the CPU path
    triton = None

# (rows, channels, warps) of a tile: 8 bf16 channels (16 bytes) a thread. The backward holds more tiles at
# once (the pre-activation of each tap recomputed), so it takes fewer rows to stay near 128 registers a thread
# (sm_90: 58 forward, 128 backward, no spills); bench/gpu_nemotron_omni.py times other tiles beside these.
FORWARD_TILE = (32, 64, 8)
BACKWARD_TILE = (16, 64, 4)
TARGET_PROGRAMS = 1024  # backward programs to aim for: several per SM, and few partial sums to add


def available() -> bool:
    return triton is not None


if triton is not None:
    @triton.jit
    def _forward(X, W, BIAS, SEQ, OUT, L, C, s_xb, s_xl, s_ob, s_ol, s_sb,
                 K: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_SEQ: tl.constexpr, SILU: tl.constexpr,
                 BLOCK_L: tl.constexpr, BLOCK_C: tl.constexpr):
        b = tl.program_id(2).to(tl.int64)
        t = tl.program_id(0) * BLOCK_L + tl.arange(0, BLOCK_L)
        c = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
        tm = t < L
        cm = c < C
        if HAS_SEQ:
            seg = tl.load(SEQ + b * s_sb + t, mask=tm, other=0)
        acc = tl.zeros([BLOCK_L, BLOCK_C], tl.float32)
        for k in tl.static_range(K):
            src = t - (K - 1) + k
            m = tm & (src >= 0)
            if HAS_SEQ:
                if k < K - 1:  # the last tap is t itself
                    m = m & (tl.load(SEQ + b * s_sb + src, mask=m, other=0) == seg)
            xv = tl.load(X + b * s_xb + src.to(tl.int64)[:, None] * s_xl + c[None, :],
                         mask=m[:, None] & cm[None, :], other=0.0).to(tl.float32)
            acc += xv * tl.load(W + c * K + k, mask=cm, other=0.0).to(tl.float32)[None, :]
        if HAS_BIAS:
            acc += tl.load(BIAS + c, mask=cm, other=0.0).to(tl.float32)[None, :]
        if SILU:
            acc = acc * tl.sigmoid(acc)
        tl.store(OUT + b * s_ob + t.to(tl.int64)[:, None] * s_ol + c[None, :], acc.to(OUT.dtype.element_ty),
                 mask=tm[:, None] & cm[None, :])

    @triton.jit
    def _backward(X, W, BIAS, SEQ, DY, DX, DW, DB, L, C, span, s_xb, s_xl, s_yb, s_yl, s_dxb, s_dxl, s_sb,
                  K: tl.constexpr, KP: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_SEQ: tl.constexpr,
                  SILU: tl.constexpr, BLOCK_L: tl.constexpr, BLOCK_C: tl.constexpr):
        pid_l = tl.program_id(0)
        b = tl.program_id(2).to(tl.int64)
        c = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
        cm = c < C
        taps = tl.arange(0, KP)
        dw = tl.zeros([BLOCK_C, KP], tl.float32)
        db = tl.zeros([BLOCK_C], tl.float32)
        if HAS_BIAS:
            bias = tl.load(BIAS + c, mask=cm, other=0.0).to(tl.float32)
        start = pid_l * span
        end = tl.minimum(start + span, L)
        for t0 in range(start, end, BLOCK_L):
            t = t0 + tl.arange(0, BLOCK_L)
            tm = t < end
            if HAS_SEQ:
                seg_t = tl.load(SEQ + b * s_sb + t, mask=tm, other=0)
            xt = tl.load(X + b * s_xb + t.to(tl.int64)[:, None] * s_xl + c[None, :],
                         mask=tm[:, None] & cm[None, :], other=0.0).to(tl.float32)
            dx = tl.zeros([BLOCK_L, BLOCK_C], tl.float32)
            # out[u], u = t + d, reads x[t] through tap K - 1 - d; a loop, not unrolled (unrolled, every tap's
            # loads are live at once: half again the registers)
            for d in range(K):
                u = t + d
                um = u < L
                if HAS_SEQ:
                    seg_u = tl.load(SEQ + b * s_sb + u, mask=um, other=0)
                g = tl.load(DY + b * s_yb + u.to(tl.int64)[:, None] * s_yl + c[None, :],
                            mask=um[:, None] & cm[None, :], other=0.0).to(tl.float32)
                if SILU:
                    z = tl.zeros([BLOCK_L, BLOCK_C], tl.float32)
                    if HAS_BIAS:
                        z += bias[None, :]
                    for k in tl.static_range(K):
                        src = u - (K - 1) + k
                        m = um & (src >= 0)
                        if HAS_SEQ:
                            if k < K - 1:
                                m = m & (tl.load(SEQ + b * s_sb + src, mask=m, other=0) == seg_u)
                        xv = tl.load(X + b * s_xb + src.to(tl.int64)[:, None] * s_xl + c[None, :],
                                     mask=m[:, None] & cm[None, :], other=0.0).to(tl.float32)
                        z += xv * tl.load(W + c * K + k, mask=cm, other=0.0).to(tl.float32)[None, :]
                    s = tl.sigmoid(z)
                    g = g * s * (1.0 + z * (1.0 - s))
                pair = tm & um
                if HAS_SEQ:
                    pair = pair & (seg_u == seg_t)
                g = tl.where(pair[:, None], g, 0.0)
                dx += g * tl.load(W + c * K + (K - 1 - d), mask=cm, other=0.0).to(tl.float32)[None, :]
                part = tl.sum(g * xt, axis=0)
                dw += tl.where(taps[None, :] == K - 1 - d, part[:, None], 0.0)
                db += tl.where(d == 0, tl.sum(g, axis=0), 0.0)
            tl.store(DX + b * s_dxb + t.to(tl.int64)[:, None] * s_dxl + c[None, :], dx.to(DX.dtype.element_ty),
                     mask=tm[:, None] & cm[None, :])
        row = b * tl.num_programs(0) + pid_l  # this program's partial sums: [row, KP, C] and [row, C]
        tl.store(DW + row * KP * C + taps[None, :] * C + c[:, None], dw,
                 mask=cm[:, None] & (taps[None, :] < K))
        tl.store(DB + row * C + c, db, mask=cm)


def _silu(activation: str | None) -> bool:
    if activation in ("silu", "swish"):
        return True
    if activation is not None:
        raise ValueError(f"segment_conv1d_triton: activation {activation!r} (silu or None)")
    return False


def _channels_contiguous(t: torch.Tensor) -> torch.Tensor:
    return t if t.stride(-1) == 1 else t.contiguous()


def _spans(batch: int, length: int, channels: int, block_l: int, block_c: int) -> tuple[int, int]:
    """(programs along L, rows each) for the backward: about TARGET_PROGRAMS in all, whole tiles each."""
    tiles = -(-length // block_l)
    along = max(1, min(tiles, -(-TARGET_PROGRAMS // max(1, batch * -(-channels // block_c)))))
    per = -(-tiles // along) * block_l
    return -(-length // per), per


class _SegmentConv(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, seq_idx, silu):
        B, L, C = x.shape
        K = weight.shape[-1]
        x = _channels_contiguous(x)
        w = weight.contiguous()
        bias = bias.contiguous() if bias is not None else None
        sq = seq_idx.contiguous() if seq_idx is not None else None
        out = torch.empty(B, L, C, dtype=x.dtype, device=x.device)
        block_l, block_c, warps = FORWARD_TILE
        _forward[(triton.cdiv(L, block_l), triton.cdiv(C, block_c), B)](
            x, w, bias if bias is not None else w, sq if sq is not None else w, out, L, C,
            x.stride(0), x.stride(1), out.stride(0), out.stride(1), sq.stride(0) if sq is not None else 0,
            K=K, HAS_BIAS=bias is not None, HAS_SEQ=sq is not None, SILU=silu,
            BLOCK_L=block_l, BLOCK_C=block_c, num_warps=warps)
        ctx.save_for_backward(x, w, bias, sq)
        ctx.silu = silu
        ctx.weight_dtype = weight.dtype
        return out

    @staticmethod
    def backward(ctx, dy):
        x, w, bias, sq = ctx.saved_tensors
        B, L, C = x.shape
        K = w.shape[-1]
        KP = triton.next_power_of_2(K)
        dy = _channels_contiguous(dy)
        dx = torch.empty(B, L, C, dtype=x.dtype, device=x.device)
        block_l, block_c, warps = BACKWARD_TILE
        along, span = _spans(B, L, C, block_l, block_c)
        dw = torch.empty(B * along, KP, C, dtype=torch.float32, device=x.device)
        db = torch.empty(B * along, C, dtype=torch.float32, device=x.device)
        _backward[(along, triton.cdiv(C, block_c), B)](
            x, w, bias if bias is not None else w, sq if sq is not None else w, dy, dx, dw, db, L, C, span,
            x.stride(0), x.stride(1), dy.stride(0), dy.stride(1), dx.stride(0), dx.stride(1),
            sq.stride(0) if sq is not None else 0,
            K=K, KP=KP, HAS_BIAS=bias is not None, HAS_SEQ=sq is not None, SILU=ctx.silu,
            BLOCK_L=block_l, BLOCK_C=block_c, num_warps=warps)
        dweight = dw.sum(0)[:K].t().to(ctx.weight_dtype)
        dbias = db.sum(0).to(bias.dtype) if bias is not None else None
        return dx, dweight, dbias, None, None


def segment_conv1d_triton(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                          seq_idx: torch.Tensor | None = None, activation: str | None = None) -> torch.Tensor:
    """gymv.backends.ssd_scan.segment_conv1d (same arguments and result: x [B, L, C], weight [C, K], bias [C],
    seq_idx [B, L]) in one Triton kernel each way (module docstring); x's channels may be a slice of a wider
    tensor (its last dim contiguous), as a split of the input projection is."""
    if triton is None:
        raise RuntimeError("segment_conv1d_triton needs triton (the CPU path is ssd_scan.segment_conv1d)")
    silu = _silu(activation)
    if weight.dim() != 2 or weight.shape[0] != x.shape[-1]:
        raise ValueError(f"segment_conv1d_triton: weight must be [channels, taps] = [{x.shape[-1]}, K], got "
                         f"{tuple(weight.shape)}")
    if seq_idx is not None and tuple(seq_idx.shape) != tuple(x.shape[:2]):
        raise ValueError(f"segment_conv1d_triton: seq_idx must be [batch, length] = {tuple(x.shape[:2])}, got "
                         f"{tuple(seq_idx.shape)}")
    if x.numel() == 0:
        from gymv.backends.ssd_scan import segment_conv1d

        return segment_conv1d(x, weight, bias, seq_idx, activation)
    return _SegmentConv.apply(x, weight, bias, seq_idx, silu)
