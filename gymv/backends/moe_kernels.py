"""The routed experts' memory-bound passes as Triton kernels: relu² scaled by the routing weight, and the sum
of each token's k expert outputs.

Between its two grouped matrix products, an MoE layer of the Nano's widths moves [pairs, width] tensors
(98,304 pairs at 16,384 tokens, top 6: 365 MB at the expert width, 528 MB at the model's) through torch
kernels that each read and write them whole: relu², then two in-place products for the square and the
weight (three passes forward, four backward), and the put-back of the pairs' outputs into token order
through `embedding_bag`, which read them at a fifth of the card's bandwidth on an H100. Here:

scaled_relu2   h = w · relu(a)², one pass forward; backward, one pass over a and the incoming gradient g:
               da = 2 w g relu(a), dw[p] = sum_i g relu(a)² (float32, summed across the row by one program:
               deterministic).
sum_pairs      out[t] = sum_j rows[inverse[t k + j]] (float32, in slot order, as `embedding_bag` sums), one
               read of the rows.

Used on CUDA by gymv.backends.moe_experts where triton imports (`available`); under TRITON_INTERPRET=1 on a
CPU for the tests. triton is imported here only: the module imports without it.
"""

from __future__ import annotations

import torch

try:  # triton is optional: CPU installs run the torch passes of gymv.backends.moe_experts
    import triton
    import triton.language as tl
except Exception:  # noqa: BLE001 - a broken triton install must not break the CPU path
    triton = None

RELU2_TILE = (32, 128, 4)  # (rows, columns, warps): 8 bf16 columns (16 bytes) a thread
SUM_TILE = (16, 256, 4)  # (tokens, columns, warps) of the gather-sum


def available() -> bool:
    return triton is not None


if triton is not None:
    @triton.jit
    def _relu2_forward(A, W, H, P, I, s_a, s_h, BLOCK_P: tl.constexpr, BLOCK_I: tl.constexpr):
        p = tl.program_id(0) * BLOCK_P + tl.arange(0, BLOCK_P)
        i = tl.program_id(1) * BLOCK_I + tl.arange(0, BLOCK_I)
        pm = p < P
        m = pm[:, None] & (i < I)[None, :]
        p64 = p.to(tl.int64)
        a = tl.load(A + p64[:, None] * s_a + i[None, :], mask=m, other=0.0).to(tl.float32)
        w = tl.load(W + p, mask=pm, other=0.0).to(tl.float32)
        r = tl.maximum(a, 0.0)
        tl.store(H + p64[:, None] * s_h + i[None, :], (r * r * w[:, None]).to(H.dtype.element_ty), mask=m)

    @triton.jit
    def _relu2_backward(A, W, G, DA, DW, P, I, s_a, s_g, s_da, BLOCK_P: tl.constexpr, BLOCK_I: tl.constexpr):
        p = tl.program_id(0) * BLOCK_P + tl.arange(0, BLOCK_P)
        pm = p < P
        p64 = p.to(tl.int64)
        w = tl.load(W + p, mask=pm, other=0.0).to(tl.float32)
        dw = tl.zeros([BLOCK_P], tl.float32)
        for start in range(0, I, BLOCK_I):
            i = start + tl.arange(0, BLOCK_I)
            m = pm[:, None] & (i < I)[None, :]
            a = tl.load(A + p64[:, None] * s_a + i[None, :], mask=m, other=0.0).to(tl.float32)
            g = tl.load(G + p64[:, None] * s_g + i[None, :], mask=m, other=0.0).to(tl.float32)
            r = tl.maximum(a, 0.0)
            t = g * r
            dw += tl.sum(t * r, axis=1)
            tl.store(DA + p64[:, None] * s_da + i[None, :], (2.0 * t * w[:, None]).to(DA.dtype.element_ty), mask=m)
        tl.store(DW + p, dw, mask=pm)

    @triton.jit
    def _sum_pairs(ROWS, INV, OUT, T, D, s_r, s_o, K: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr):
        t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
        d = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
        tm = t < T
        m = tm[:, None] & (d < D)[None, :]
        acc = tl.zeros([BLOCK_T, BLOCK_D], tl.float32)
        for j in tl.static_range(K):
            src = tl.load(INV + t.to(tl.int64) * K + j, mask=tm, other=0).to(tl.int64)
            acc += tl.load(ROWS + src[:, None] * s_r + d[None, :], mask=m, other=0.0).to(tl.float32)
        tl.store(OUT + t.to(tl.int64)[:, None] * s_o + d[None, :], acc.to(OUT.dtype.element_ty), mask=m)


def _rows(t: torch.Tensor) -> torch.Tensor:
    """A 2-D tensor whose rows are contiguous (the kernels take a row stride only)."""
    return t if t.stride(-1) == 1 else t.contiguous()


def sum_pairs(rows: torch.Tensor, inverse: torch.Tensor, k: int) -> torch.Tensor:
    """out [T, D]: out[t] = sum_j rows[inverse[t * k + j]] for rows [P, D], inverse [T * k] (no autograd)."""
    rows = _rows(rows)
    inverse = inverse.contiguous()
    T = inverse.numel() // k
    D = rows.shape[-1]
    out = rows.new_empty(T, D)
    if T == 0:
        return out
    bt, bd, warps = SUM_TILE
    _sum_pairs[(triton.cdiv(T, bt), triton.cdiv(D, bd))](rows, inverse, out, T, D, rows.stride(0), out.stride(0),
                                                         K=k, BLOCK_T=bt, BLOCK_D=bd, num_warps=warps)
    return out


def relu2_forward(a: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """h = w · relu(a)² for a [P, I] with contiguous rows, w [P] (no autograd)."""
    P, I = a.shape
    h = torch.empty_like(a)
    bp, bi, warps = RELU2_TILE
    if P:
        _relu2_forward[(triton.cdiv(P, bp), triton.cdiv(I, bi))](a, w, h, P, I, a.stride(0), h.stride(0),
                                                                 BLOCK_P=bp, BLOCK_I=bi, num_warps=warps)
    return h


def relu2_backward(a: torch.Tensor, w: torch.Tensor, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(da, dw in float32) of `relu2_forward` for the incoming gradient `grad` [P, I] (no autograd)."""
    grad = _rows(grad)
    P, I = a.shape
    da = torch.empty_like(a)
    dw = torch.empty(P, device=a.device, dtype=torch.float32)
    bp, bi, warps = RELU2_TILE
    if P:
        _relu2_backward[(triton.cdiv(P, bp),)](a, w, grad, da, dw, P, I, a.stride(0), grad.stride(0), da.stride(0),
                                               BLOCK_P=bp, BLOCK_I=bi, num_warps=warps)
    return da, dw


class _ScaledRelu2(torch.autograd.Function):
    @staticmethod
    def forward(ctx, a: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        a, w = _rows(a), w.contiguous()
        ctx.save_for_backward(a, w)
        return relu2_forward(a, w)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        a, w = ctx.saved_tensors
        da, dw = relu2_backward(a, w, grad)
        return da, dw.to(w.dtype)


def scaled_relu2(a: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """w[p] · relu(a[p])² for a [P, I], w [P] (a's dtype out), one Triton kernel each way (module docstring)."""
    if triton is None:
        raise RuntimeError("scaled_relu2 needs triton (the CPU path is gymv.backends.moe_experts' torch passes)")
    if a.dim() != 2 or w.shape != a.shape[:1]:
        raise ValueError(f"scaled_relu2: a must be [P, I] and w [P], got {tuple(a.shape)} and {tuple(w.shape)}")
    return _ScaledRelu2.apply(a, w)
