"""Logprobs and entropies of scored tokens from their logits, a chunk of rows at a time.

The straightforward form upcasts the [N, V] logits to float32, masks and scales them, and keeps that copy
(and the softmax of the entropy) alive for backward: with a 150k vocabulary and ten thousand scored tokens
that is several GB per tensor, and every elementwise step reads and writes all of it. Here forward and
backward each walk over row chunks of at most CHUNK_ELEMENTS logits: the float32 work happens on one
chunk at a time, backward recomputes the chunk's softmax from the saved logits (in their own dtype) and
log-sum-exp, and writes the gradient straight into a tensor of the logits' dtype. The values are those of
the float32 formulas in gymv.backends.logprobs, computed the same way. On CUDA one Triton kernel each way
does the same in one read of the logits (gymv.backends.scores_kernel); these chunks are its reference.
"""

from __future__ import annotations

import torch

from gymv.backends.kernel_check import verified
from gymv.backends.sampling import policy_logits

SWITCH = "GYMV_SCORES_KERNEL"
CHUNK_ELEMENTS = 1 << 26  # 64 Mi float32 logits (256 MB) per chunk


def _rows_per_chunk(vocab: int) -> int:
    return max(1, CHUNK_ELEMENTS // max(vocab, 1))


def _finite(z: torch.Tensor) -> torch.Tensor:
    return z.masked_fill(torch.isinf(z), 0.0)


def _torch_forward(logits, target, forbidden, temperature: float, want_entropy: bool):
    """(logprobs, entropies or None, log-sum-exp) of every row, a chunk of rows at a time."""
    n, vocab = logits.shape
    lp = logits.new_empty(n, dtype=torch.float32)
    lse = logits.new_empty(n, dtype=torch.float32)
    ent = logits.new_empty(n, dtype=torch.float32) if want_entropy else None
    step = _rows_per_chunk(vocab)
    for a in range(0, n, step):
        z = policy_logits(logits[a:a + step], temperature, forbidden)
        c = torch.logsumexp(z, dim=-1)
        lse[a:a + step] = c
        lp[a:a + step] = z.gather(-1, target[a:a + step, None]).squeeze(-1) - c
        if want_entropy:
            ent[a:a + step] = c - (torch.softmax(z, dim=-1) * _finite(z)).sum(-1)
    return lp, ent, lse


def _torch_backward(logits, target, forbidden, temperature: float, lse, g_lp, g_ent):
    """The logits' gradient for float32 g_lp [N] (and g_ent [N] or None), a chunk of rows at a time."""
    t = float(temperature)
    scale = 1.0 / t if t > 0 and t != 1.0 else 1.0
    grad = torch.empty_like(logits)
    step = _rows_per_chunk(logits.shape[1])
    for a in range(0, logits.shape[0], step):
        z = policy_logits(logits[a:a + step], temperature, forbidden)
        p = torch.exp(z - lse[a:a + step, None])  # 0 where z is -inf
        g = g_lp[a:a + step]
        # d logp / dz = onehot(target) - p;  d entropy / dz = -p (z - E_p[z])
        gz = p * -g[:, None]
        gz.scatter_add_(-1, target[a:a + step, None], g[:, None])
        if g_ent is not None:
            fz = _finite(z)
            mean = (p * fz).sum(-1, keepdim=True)
            gz -= g_ent[a:a + step, None].float() * p * (fz - mean)
        if scale != 1.0:
            gz *= scale
        grad[a:a + step] = gz
    return grad


def kernel_on(logits: torch.Tensor) -> bool:
    """Whether gymv.backends.scores_kernel scores `logits`: on CUDA where triton imports and its one-time check
    passed (gymv.backends.kernel_check), unless GYMV_SCORES_KERNEL=0."""
    return logits.is_cuda and verified("Vocabulary scores", SWITCH, logits.device, _check)


def _check(device: torch.device) -> bool:
    """The kernel against the torch chunks on a small batch (forbidden ids, a temperature), forward and
    backward, entropy included."""
    from gymv.backends import scores_kernel

    if not scores_kernel.available():
        return False
    g = torch.Generator(device="cpu").manual_seed(0)
    logits = (3 * torch.randn(37, 5000, generator=g)).to(device, torch.bfloat16)
    target = torch.randint(0, 5000, (37,), generator=g).to(device)
    forbidden = torch.zeros(5000, dtype=torch.bool)
    forbidden[100:140] = True
    forbidden = forbidden.to(device)
    g_lp, g_ent = (torch.randn(37, generator=g).to(device) for _ in range(2))
    want = list(_torch_forward(logits, target, forbidden, 0.7, True))
    got = list(scores_kernel.forward(logits, target, forbidden, 0.7, True))
    want.append(_torch_backward(logits, target, forbidden, 0.7, want[2], g_lp, g_ent))
    got.append(scores_kernel.backward(logits, target, forbidden, 0.7, got[2], g_lp, g_ent, got[2] - got[1]))
    keep = ~forbidden[target]  # a forbidden target's logprob is zeroed after either path
    got[0], want[0] = got[0][keep], want[0][keep]
    tolerance = (1e-3, 1e-3, 1e-3, 1e-2)  # float32 results; the gradient in the logits' bfloat16
    return all(bool(torch.allclose(x.float(), y.float(), rtol=tol, atol=tol))
               for x, y, tol in zip(got, want, tolerance))


class _ChunkedScores(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, target, forbidden, temperature: float, want_entropy: bool):
        ctx.kernel = kernel_on(logits)
        if ctx.kernel:
            from gymv.backends import scores_kernel

            lp, ent, lse = scores_kernel.forward(logits, target, forbidden, temperature, want_entropy)
        else:
            lp, ent, lse = _torch_forward(logits, target, forbidden, temperature, want_entropy)
        if forbidden is not None:  # a forbidden target (an image placeholder) scores 0, as in sampling
            lp = torch.where(forbidden[target], torch.zeros_like(lp), lp)
        mean = lse - ent if ctx.kernel and want_entropy else None  # E_p[z], for the kernel's backward
        ctx.save_for_backward(logits, target, lse, forbidden, mean)
        ctx.set_materialize_grads(False)  # an unused entropy (a logged metric) then costs no backward work
        ctx.temperature, ctx.want_entropy = temperature, want_entropy
        ctx.mark_non_differentiable(lse)
        return (lp, ent, lse) if want_entropy else (lp, lse)

    @staticmethod
    def backward(ctx, g_lp, *rest):
        logits, target, lse, forbidden, mean = ctx.saved_tensors
        g_ent = rest[0] if ctx.want_entropy else None
        if g_lp is None and g_ent is None:
            return None, None, None, None, None
        g_lp = g_lp.float() if g_lp is not None else torch.zeros_like(lse)
        if forbidden is not None:
            g_lp = torch.where(forbidden[target], torch.zeros_like(g_lp), g_lp)
        if ctx.kernel:
            from gymv.backends import scores_kernel

            grad = scores_kernel.backward(logits, target, forbidden, ctx.temperature, lse, g_lp, g_ent, mean)
        else:
            grad = _torch_backward(logits, target, forbidden, ctx.temperature, lse, g_lp, g_ent)
        return grad, None, None, None, None


def chunked_scores(logits: torch.Tensor, target: torch.Tensor, forbidden: torch.Tensor | None, temperature: float,
                   entropy: bool) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """(logprobs [N], entropies [N] or None, log-sum-exp [N], no gradient) of `target` [N] under the sampling
    distribution of `logits` [N, V] (gymv.backends.sampling.policy_logits), all float32; differentiable in
    `logits`. A forbidden target scores 0."""
    out = _ChunkedScores.apply(logits, target, forbidden, float(temperature), bool(entropy))
    return (out[0], out[1], out[2]) if entropy else (out[0], None, out[1])
