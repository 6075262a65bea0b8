"""Importance sampling against the behaviour policy (the weights that generated the tokens).

Async GRPO and MOPD train on tokens sampled by older weights or by another engine (vLLM); the ratio between
the trainer's pre-update policy and the behaviour policy, rho = exp(logp_train_old - logp_behaviour),
corrects for that. Two remedies, usable together:
- truncated IS: weight each token by min(rho, truncate_max);
- ICE-POP style gate: drop tokens whose rho leaves [gate_low, gate_high] (their loss and gradient become 0).
Both are stop-gradient: they scale the loss, they are not trained through.
"""

from __future__ import annotations

import torch
from torch import Tensor

from gymv.algorithms.masked import as_bool, masked_fill_zero


def behaviour_ratio(logp_train_old: Tensor, logp_behaviour: Tensor, mask: Tensor) -> Tensor:
    """rho per token, 1 off the mask."""
    m = as_bool(mask)
    diff = masked_fill_zero((logp_train_old - logp_behaviour).detach(), m)
    return torch.exp(diff)


def truncated_is_weights(logp_train_old: Tensor, logp_behaviour: Tensor, mask: Tensor, truncate_max: float = 2.0) -> Tensor:
    """w = min(rho, truncate_max) on the mask, 0 off it."""
    rho = behaviour_ratio(logp_train_old, logp_behaviour, mask)
    return masked_fill_zero(rho.clamp(max=truncate_max), mask)


def icepop_gate(
    logp_train_old: Tensor, logp_behaviour: Tensor, mask: Tensor, gate_low: float = 0.2, gate_high: float = 5.0
) -> Tensor:
    """The mask with tokens whose rho lies outside [gate_low, gate_high] removed (bool)."""
    rho = behaviour_ratio(logp_train_old, logp_behaviour, mask)
    return as_bool(mask) & (rho >= gate_low) & (rho <= gate_high)
