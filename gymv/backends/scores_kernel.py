"""Logprobs and entropies of scored tokens over the vocabulary as one Triton kernel each way.

gymv.backends.chunked_scores (the reference, and the path off CUDA) walks the [N, V] logits a chunk at a
time in torch: the float32 copy, the forbidden ids' mask, the temperature, log-sum-exp, the target's
gather, the softmax and its product for the entropy, each a pass over the chunk, about a dozen forward and
as many backward. With a 131k vocabulary and 12,000 scored tokens each pass moves 6 GB. Here:

forward   one program per row reads its logits once (in their own dtype), keeping per lane a running
          maximum, sum of exponentials and (for the entropy) sum of exponentials times the logit; combined
          at the end: lse = m + log(s), logprob = z[target] - lse, entropy = lse - t / s.
backward  one read of the logits and one write of their gradient: p = exp(z - lse), then
          g_lp (onehot(target) - p) - g_ent p (z - E_p[z]), divided by the temperature, where
          E_p[z] = lse - entropy comes from the forward.

z is the logit divided by the temperature, with forbidden ids at -inf (gymv.backends.sampling.policy_logits);
float32 throughout. Used on CUDA where triton imports and the one-time check passed
(gymv.backends.kernel_check); under TRITON_INTERPRET=1 on a CPU for the tests. triton is imported here only.
"""

from __future__ import annotations

import torch

try:  # triton is optional: CPU installs run gymv.backends.chunked_scores' torch path
    import triton
    import triton.language as tl
except Exception:  # noqa: BLE001 - a broken triton install must not break the CPU path
    triton = None

BLOCK_V = 2048  # vocabulary lanes a program holds per pass (8 float32 a thread at 8 warps)
WARPS = 8


def available() -> bool:
    return triton is not None


if triton is not None:
    @triton.jit
    def _policy_block(base, FORBID, v, ok, inv_t, HAS_FORBID: tl.constexpr):
        """z of a block of one row's ids `v`: the logit over the temperature, -inf where forbidden or past V."""
        z = tl.load(base + v, mask=ok, other=float("-inf")).to(tl.float32) * inv_t
        if HAS_FORBID:
            banned = tl.load(FORBID + v, mask=ok, other=0)
            z = tl.where(banned != 0, float("-inf"), z)
        return z

    @triton.jit
    def _forward(LOGITS, TARGET, FORBID, LP, LSE, ENT, V, s_row, inv_t,
                 HAS_FORBID: tl.constexpr, WANT_ENT: tl.constexpr, BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        base = LOGITS + row * s_row
        lanes = tl.arange(0, BLOCK)
        m = tl.full([BLOCK], float("-inf"), tl.float32)
        s = tl.zeros([BLOCK], tl.float32)
        t = tl.zeros([BLOCK], tl.float32)
        for start in range(0, V, BLOCK):
            v = start + lanes
            ok = v < V
            z = _policy_block(base, FORBID, v, ok, inv_t, HAS_FORBID)
            new = tl.maximum(m, z)
            alpha = tl.where(new == m, 1.0, tl.exp(m - new))  # both -inf: nothing summed yet
            e = tl.where(z == float("-inf"), 0.0, tl.exp(z - new))
            s = s * alpha + e
            if WANT_ENT:
                t = t * alpha + e * tl.where(z == float("-inf"), 0.0, z)
            m = new
        top = tl.max(m, 0)
        w = tl.where(m == float("-inf"), 0.0, tl.exp(m - top))
        total = tl.sum(s * w, 0)
        lse = top + tl.log(total)
        target = tl.load(TARGET + row).to(tl.int64)
        zt = tl.load(base + target).to(tl.float32) * inv_t
        tl.store(LP + row, zt - lse)
        tl.store(LSE + row, lse)
        if WANT_ENT:
            tl.store(ENT + row, lse - tl.sum(t * w, 0) / total)

    @triton.jit
    def _backward(LOGITS, TARGET, FORBID, LSE, MEAN, G_LP, G_ENT, GRAD, V, s_row, s_grad, inv_t,
                  HAS_FORBID: tl.constexpr, HAS_G_ENT: tl.constexpr, BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        base = LOGITS + row * s_row
        out = GRAD + row * s_grad
        lanes = tl.arange(0, BLOCK)
        lse = tl.load(LSE + row)
        g = tl.load(G_LP + row)
        target = tl.load(TARGET + row).to(tl.int64)
        if HAS_G_ENT:
            ge = tl.load(G_ENT + row)
            mean = tl.load(MEAN + row)
        for start in range(0, V, BLOCK):
            v = start + lanes
            ok = v < V
            z = _policy_block(base, FORBID, v, ok, inv_t, HAS_FORBID)
            p = tl.where(z == float("-inf"), 0.0, tl.exp(z - lse))
            gz = tl.where(v == target, g, 0.0) - g * p
            if HAS_G_ENT:
                gz -= ge * p * (tl.where(z == float("-inf"), 0.0, z) - mean)
            tl.store(out + v, (gz * inv_t).to(GRAD.dtype.element_ty), mask=ok)


def _inv_temperature(temperature: float) -> float:
    t = float(temperature)
    return 1.0 / t if t > 0 and t != 1.0 else 1.0


def _rows(logits: torch.Tensor) -> torch.Tensor:
    return logits if logits.stride(-1) == 1 else logits.contiguous()


def forward(logits: torch.Tensor, target: torch.Tensor, forbidden: torch.Tensor | None, temperature: float,
            entropy: bool) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """(logprobs, entropies or None, log-sum-exp), float32 [N] each, of `target` [N] under `logits` [N, V]
    (no autograd; a forbidden target's logprob is whatever its -inf gives: the caller zeroes it)."""
    logits = _rows(logits)
    n, vocab = logits.shape
    lp = torch.empty(n, device=logits.device, dtype=torch.float32)
    lse = torch.empty_like(lp)
    ent = torch.empty_like(lp) if entropy else lp
    banned = forbidden.to(torch.int8) if forbidden is not None else lp
    if n:
        _forward[(n,)](logits, target.contiguous(), banned, lp, lse, ent, vocab, logits.stride(0),
                       _inv_temperature(temperature), HAS_FORBID=forbidden is not None, WANT_ENT=entropy,
                       BLOCK=BLOCK_V, num_warps=WARPS)
    return lp, (ent if entropy else None), lse


def backward(logits: torch.Tensor, target: torch.Tensor, forbidden: torch.Tensor | None, temperature: float,
             lse: torch.Tensor, g_lp: torch.Tensor, g_ent: torch.Tensor | None = None,
             mean: torch.Tensor | None = None) -> torch.Tensor:
    """The gradient [N, V] (logits' dtype) for float32 g_lp [N] and, where given, g_ent [N] with `mean` [N]
    (E_p[z] = lse - entropy) (no autograd)."""
    logits = _rows(logits)
    n, vocab = logits.shape
    grad = torch.empty(n, vocab, device=logits.device, dtype=logits.dtype)
    banned = forbidden.to(torch.int8) if forbidden is not None else lse
    has_ent = g_ent is not None
    if n:
        _backward[(n,)](logits, target.contiguous(), banned, lse, mean.float().contiguous() if has_ent else lse,
                        g_lp.float().contiguous(), g_ent.float().contiguous() if has_ent else lse, grad, vocab,
                        logits.stride(0), grad.stride(0), _inv_temperature(temperature),
                        HAS_FORBID=forbidden is not None, HAS_G_ENT=has_ent, BLOCK=BLOCK_V, num_warps=WARPS)
    return grad
