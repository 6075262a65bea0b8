"""Per-token losses and their aggregation over the global batch.

Aggregation divides by counts of the *global* batch (all micro-batches of all data-parallel ranks), passed
in as `GlobalCounts`. Each micro-batch's contribution is then a plain sum term, so accumulating gradients
over micro-batches and summing them over ranks reproduces one pass over the whole batch exactly.
"""

from __future__ import annotations

import torch
from torch import Tensor

from gymv.algorithms.masked import as_bool, masked_fill_zero
from gymv.algorithms.registry import KL_ESTIMATORS, LOSS_AGGREGATIONS
from gymv.backends.training.base import GlobalCounts  # noqa: F401  (the losses take it; trainers count it)

Aggregation = str  # a name in gymv.algorithms.registry.LOSS_AGGREGATIONS
KLEstimator = str  # a name in gymv.algorithms.registry.KL_ESTIMATORS


def aggregate(per_token: Tensor, mask: Tensor, mode: Aggregation = "token_mean", counts: GlobalCounts | None = None) -> Tensor:
    """Reduce a [B,T] per-token quantity to a scalar with the aggregation registered as `mode`.
    `counts` defaults to this batch's own counts (then it is a plain mean)."""
    m = as_bool(mask)
    return LOSS_AGGREGATIONS.load(mode)(masked_fill_zero(per_token, m), m, counts or GlobalCounts.of(m))


def token_mean(x: Tensor, m: Tensor, counts: GlobalCounts) -> Tensor:
    """Sum over all valid tokens / global valid tokens."""
    return x.sum() / max(counts.tokens, 1.0)


def seq_mean_token_mean(x: Tensor, m: Tensor, counts: GlobalCounts) -> Tensor:
    """Sum over sequences of (that sequence's token mean) / global sequences."""
    return (x.sum(dim=-1) / m.sum(dim=-1).clamp(min=1).to(x.dtype)).sum() / max(counts.sequences, 1.0)


def seq_mean_token_sum(x: Tensor, m: Tensor, counts: GlobalCounts) -> Tensor:
    """Sum over sequences of (that sequence's token sum) / global sequences."""
    return x.sum(dim=-1).sum() / max(counts.sequences, 1.0)


def _per_token(advantages: Tensor, like: Tensor) -> Tensor:
    """Accept per-sample [B] or per-token [B,T] advantages."""
    a = advantages.detach().to(like.dtype)
    return a.unsqueeze(-1).expand_as(like) if a.dim() == like.dim() - 1 else a


def clipped_policy_loss(
    logp: Tensor,
    logp_old: Tensor,
    advantages: Tensor,
    mask: Tensor,
    eps_low: float = 0.2,
    eps_high: float = 0.2,
) -> tuple[Tensor, Tensor]:
    """Per-token -min(ratio*A, clip(ratio, 1-eps_low, 1+eps_high)*A), ratio = exp(logp - logp_old).

    Returns (per_token_loss [B,T], clipped [B,T] bool: tokens where the clipped term was the smaller one,
    i.e. where the gradient is cut). Off the mask both are 0/False.
    """
    m = as_bool(mask)
    a = masked_fill_zero(_per_token(advantages, logp), m)
    log_ratio = masked_fill_zero(logp - logp_old.detach(), m)
    ratio = torch.exp(log_ratio)
    unclipped = ratio * a
    clipped = torch.clamp(ratio, 1.0 - eps_low, 1.0 + eps_high) * a
    loss = -torch.minimum(unclipped, clipped)
    was_clipped = m & (clipped < unclipped)
    return masked_fill_zero(loss, m), was_clipped


def kl_penalty(logp: Tensor, logp_ref: Tensor, mask: Tensor, estimator: KLEstimator = "k3") -> Tensor:
    """Per-token estimate of KL(pi || pi_ref) from the sampled token's logprobs, by the estimator registered
    as `estimator`; both inputs are zeroed off the mask first (no -inf leaks)."""
    m = as_bool(mask)
    kl = KL_ESTIMATORS.load(estimator)(masked_fill_zero(logp, m), masked_fill_zero(logp_ref.detach(), m))
    return masked_fill_zero(kl, m)


# With d = logp_ref - logp: k1 = -d, k2 = d^2 / 2, k3 = exp(d) - d - 1 (unbiased, always >= 0).
def kl_k1(logp: Tensor, logp_ref: Tensor) -> Tensor:
    return -(logp_ref - logp)


def kl_k2(logp: Tensor, logp_ref: Tensor) -> Tensor:
    d = logp_ref - logp
    return 0.5 * d * d


def kl_k3(logp: Tensor, logp_ref: Tensor) -> Tensor:
    d = logp_ref - logp
    return torch.exp(d) - d - 1.0


def reinforce_loss(logp: Tensor, advantages: Tensor, mask: Tensor, logp_old: Tensor | None = None) -> Tensor:
    """Per-token -A * ratio with ratio = exp(logp - stop_grad(logp_old)) (logp_old defaults to logp).

    Its gradient is -A * grad(logp) at the sampling policy, plain REINFORCE, and stays a correct importance
    ratio when a later micro-step has moved the policy.
    """
    m = as_bool(mask)
    old = logp.detach() if logp_old is None else logp_old.detach()
    ratio = torch.exp(masked_fill_zero(logp - old, m))
    return masked_fill_zero(-_per_token(advantages, logp) * ratio, m)


def nll_loss(logp: Tensor, mask: Tensor) -> Tensor:
    """Per-token negative log-likelihood (SFT), 0 off the mask."""
    return masked_fill_zero(-logp, mask)
