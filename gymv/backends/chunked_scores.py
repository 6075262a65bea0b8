"""Logprobs and entropies of scored tokens from their logits, a chunk of rows at a time.

The straightforward form upcasts the [N, V] logits to float32, masks and scales them, and keeps that copy
(and the softmax of the entropy) alive for backward: with a 150k vocabulary and ten thousand scored tokens
that is several GB per tensor, and every elementwise step reads and writes all of it. Here forward and
backward each walk over row chunks of at most CHUNK_ELEMENTS logits: the float32 work happens on one
chunk at a time, backward recomputes the chunk's softmax from the saved logits (in their own dtype) and
log-sum-exp, and writes the gradient straight into a tensor of the logits' dtype. The values are those of
the float32 formulas in gymv.backends.logprobs, computed the same way.
"""

from __future__ import annotations

import torch

from gymv.backends.sampling import policy_logits

CHUNK_ELEMENTS = 1 << 26  # 64 Mi float32 logits (256 MB) per chunk


def _rows_per_chunk(vocab: int) -> int:
    return max(1, CHUNK_ELEMENTS // max(vocab, 1))


def _finite(z: torch.Tensor) -> torch.Tensor:
    return z.masked_fill(torch.isinf(z), 0.0)


class _ChunkedScores(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, target, forbidden, temperature: float, want_entropy: bool):
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
        if forbidden is not None:  # a forbidden target (an image placeholder) scores 0, as in sampling
            lp = torch.where(forbidden[target], torch.zeros_like(lp), lp)
        ctx.save_for_backward(logits, target, lse, forbidden)
        ctx.set_materialize_grads(False)  # an unused entropy (a logged metric) then costs no backward work
        ctx.temperature, ctx.want_entropy = temperature, want_entropy
        ctx.mark_non_differentiable(lse)
        return (lp, ent, lse) if want_entropy else (lp, lse)

    @staticmethod
    def backward(ctx, g_lp, *rest):
        logits, target, lse, forbidden = ctx.saved_tensors
        g_ent = rest[0] if ctx.want_entropy else None
        t = float(ctx.temperature)
        scale = 1.0 / t if t > 0 and t != 1.0 else 1.0
        if g_lp is None and g_ent is None:
            return None, None, None, None, None
        g_lp = g_lp.float() if g_lp is not None else torch.zeros_like(lse)
        if forbidden is not None:
            g_lp = torch.where(forbidden[target], torch.zeros_like(g_lp), g_lp)
        grad = torch.empty_like(logits)
        step = _rows_per_chunk(logits.shape[1])
        for a in range(0, logits.shape[0], step):
            z = policy_logits(logits[a:a + step], ctx.temperature, forbidden)
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
        return grad, None, None, None, None


def chunked_scores(logits: torch.Tensor, target: torch.Tensor, forbidden: torch.Tensor | None, temperature: float,
                   entropy: bool) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """(logprobs [N], entropies [N] or None, log-sum-exp [N], no gradient) of `target` [N] under the sampling
    distribution of `logits` [N, V] (gymv.backends.sampling.policy_logits), all float32; differentiable in
    `logits`. A forbidden target scores 0."""
    out = _ChunkedScores.apply(logits, target, forbidden, float(temperature), bool(entropy))
    return (out[0], out[1], out[2]) if entropy else (out[0], None, out[1])
