"""Importance sampling against the behaviour policy (the weights that generated the tokens), as NeMo RL's
`truncated_importance_sampling_type` defines it.

Async GRPO and MOPD train on tokens sampled by older weights or by another engine (vLLM); the ratio between
the trainer's pre-update policy and the behaviour policy, rho = exp(logp_train_old - logp_behaviour),
corrects for that. Each kind returns the per-token weight the loss is multiplied by:
- truncated (NeMo RL's `tis`): rho clamped to [truncate_min, truncate_max];
- icepop: rho where it lies inside [low, high], 0 elsewhere (the token leaves the loss);
- seq_mask_tis (NeMo RL's `seq-mask-tis`): raw rho on the sequences whose geometric-mean rho lies inside
  [low, high], 0 on the whole of every other sequence.
Weights are stop-gradient: they scale the loss, they are not trained through. Dropped tokens and sequences
keep their place in the loss's denominators (the mask is unchanged), as in NeMo RL.
"""

from __future__ import annotations

import torch
from torch import Tensor

from gymv.algorithms.masked import as_bool, masked_fill_zero, masked_mean


def behaviour_ratio(logp_train_old: Tensor, logp_behaviour: Tensor, mask: Tensor) -> Tensor:
    """rho per token, 1 off the mask; a non-finite rho (a behaviour logprob of -inf) is 0, as in NeMo RL."""
    m = as_bool(mask)
    diff = masked_fill_zero((logp_train_old - logp_behaviour).detach(), m)
    return torch.nan_to_num(torch.exp(diff), nan=0.0, posinf=0.0, neginf=0.0)


def truncated_is_weights(logp_train_old: Tensor, logp_behaviour: Tensor, mask: Tensor, truncate_max: float = 2.0,
                         truncate_min: float = 0.0) -> Tensor:
    """w = clamp(rho, truncate_min, truncate_max) on the mask, 0 off it."""
    rho = behaviour_ratio(logp_train_old, logp_behaviour, mask)
    return masked_fill_zero(rho.clamp(min=truncate_min, max=truncate_max), mask)


def icepop_gate(
    logp_train_old: Tensor, logp_behaviour: Tensor, mask: Tensor, gate_low: float = 0.2, gate_high: float = 5.0
) -> Tensor:
    """The mask with tokens whose rho lies outside [gate_low, gate_high] removed (bool)."""
    rho = behaviour_ratio(logp_train_old, logp_behaviour, mask)
    return as_bool(mask) & (rho >= gate_low) & (rho <= gate_high)


def icepop_weights(logp_train_old: Tensor, logp_behaviour: Tensor, mask: Tensor, gate_low: float = 0.2,
                   gate_high: float = 5.0) -> tuple[Tensor, Tensor]:
    """(w, kept): w = rho on the tokens whose rho lies inside [gate_low, gate_high] (bounds included), 0 on
    the others and off the mask; kept is those tokens (bool)."""
    kept = icepop_gate(logp_train_old, logp_behaviour, mask, gate_low, gate_high)
    return masked_fill_zero(behaviour_ratio(logp_train_old, logp_behaviour, mask), kept), kept


def sequence_geometric_ratio(logp_train_old: Tensor, logp_behaviour: Tensor, mask: Tensor) -> Tensor:
    """[B]: exp(mean of log rho over each sequence's masked tokens); 1 for a sequence without one. A
    non-finite log rho counts as 0, as in NeMo RL."""
    log_rho = torch.nan_to_num((logp_train_old - logp_behaviour).detach(), nan=0.0, posinf=0.0, neginf=0.0)
    return torch.exp(masked_mean(log_rho, mask, dim=-1))


def seq_mask_tis_weights(logp_train_old: Tensor, logp_behaviour: Tensor, mask: Tensor, low: float,
                         high: float) -> tuple[Tensor, Tensor]:
    """(w, kept_sequences [B] bool): w = raw rho (neither clamped nor gated per token) on the tokens of the
    sequences whose geometric-mean rho lies inside [low, high] (bounds included), 0 on every other sequence
    and off the mask."""
    geo = sequence_geometric_ratio(logp_train_old, logp_behaviour, mask)
    kept_seq = (geo >= low) & (geo <= high)
    kept = as_bool(mask) & kept_seq.unsqueeze(-1)
    return masked_fill_zero(behaviour_ratio(logp_train_old, logp_behaviour, mask), kept), kept_seq
