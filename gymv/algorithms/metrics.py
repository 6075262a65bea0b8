"""Health metrics computed from logprobs: generation/training agreement, entropy, clipping, IS weights."""

from __future__ import annotations

import torch
from torch import Tensor

from gymv.algorithms.masked import as_bool, masked_fill_zero, masked_max, masked_mean


def token_mult_prob_error(logp_gen: Tensor, logp_train: Tensor, mask: Tensor) -> tuple[Tensor, Tensor]:
    """exp(|logp_gen - logp_train|) averaged over generated tokens: (per_sample [B], batch scalar).

    1.0 means the generation backend and the trainer agree exactly. The batch value is the mean over all
    generated tokens of the batch (not the mean of per-sample values); samples without generated tokens
    get 1.0.
    """
    m = as_bool(mask)
    err = torch.exp(masked_fill_zero((logp_gen - logp_train).detach().abs(), m))
    per_sample = masked_mean(err, m, dim=-1)
    per_sample = torch.where(m.any(dim=-1), per_sample, torch.ones_like(per_sample))
    batch = masked_mean(err, m) if bool(m.any()) else torch.ones((), dtype=err.dtype, device=err.device)
    return per_sample, batch


def entropy_mean(entropy: Tensor, mask: Tensor) -> Tensor:
    """Token-mean entropy of the sampling distribution over generated tokens."""
    return masked_mean(entropy.detach(), mask)


def fraction(flags: Tensor, mask: Tensor) -> Tensor:
    """Share of masked positions where `flags` is set (clip fraction, gated fraction)."""
    return masked_mean(as_bool(flags).to(torch.float32), mask)


def weight_stats(weights: Tensor, mask: Tensor) -> dict[str, Tensor]:
    """Mean and max of importance weights over the mask."""
    w = weights.detach()
    return {"mean": masked_mean(w, mask), "max": masked_max(w, mask)}
