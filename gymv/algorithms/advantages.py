"""Advantage estimators: GRPO's group baseline (leave-one-out or group mean, or one registered in
gymv.algorithms.registry.BASELINES) and MOPD's per-token teacher gap.

GRPO compares each generation with the other generations of the same prompt, so the baseline needs no value
model. Samples that failed (environment error, truncated beyond repair) are excluded through `valid`: they
get advantage 0 and never enter another sample's baseline or std.
"""

from __future__ import annotations

from typing import Literal

import torch
from torch import Tensor

from gymv.algorithms.registry import BASELINES
from gymv.errors import GymvError

Baseline = str  # a name in BASELINES
StdKind = Literal["unbiased", "population"]
SPREAD_TOLERANCE = 1e-6  # a reward std below this (relative to the baseline, at least 1) is rounding, not spread


def group_ids_for(num_prompts: int, group_size: int, device: torch.device | str | None = None) -> Tensor:
    """Group ids for the usual layout: the G generations of each prompt are contiguous."""
    return torch.arange(num_prompts, device=device).repeat_interleave(group_size)


def group_baseline_and_std(
    rewards: Tensor,
    group_ids: Tensor,
    valid: Tensor | None = None,
    *,
    baseline: Baseline = "leave_one_out",
    std: StdKind = "unbiased",
) -> tuple[Tensor, Tensor, Tensor]:
    """Per-sample (baseline, std, has_baseline) by the baseline registered as `baseline`.

    `has_baseline` is False where the reference set is empty (G=1, or the only valid sample of its group)
    and for invalid samples; there baseline = reward and std = 0, so the advantage is 0.
    """
    if rewards.dim() != 1 or group_ids.shape != rewards.shape:
        raise ValueError(f"rewards and group_ids must be 1-D and the same length, got {tuple(rewards.shape)} and "
                         f"{tuple(group_ids.shape)}")
    if std not in ("unbiased", "population"):
        raise ValueError(f"unknown std {std!r}: use 'unbiased' or 'population'")
    r = rewards.detach().to(torch.float64)
    v = torch.ones_like(r, dtype=torch.bool) if valid is None else valid.to(torch.bool)
    if not bool(torch.isfinite(r[v]).all()):
        raise GymvError("a valid sample has a non-finite reward", where="grpo advantages", fix="mark it invalid or repair the reward")
    base, sd, has = BASELINES.load(baseline)(r, group_ids, v, std=std)
    dtype = rewards.dtype if rewards.is_floating_point() else torch.float32
    return base.to(dtype), sd.to(dtype), has


def leave_one_out(rewards: Tensor, group_ids: Tensor, valid: Tensor, *, std: StdKind) -> tuple[Tensor, Tensor, Tensor]:
    """The reference set of a sample is the *other* valid samples of its group."""
    return _group_reference(rewards, group_ids, valid, std=std, leave_one_out=True)


def group_mean(rewards: Tensor, group_ids: Tensor, valid: Tensor, *, std: StdKind) -> tuple[Tensor, Tensor, Tensor]:
    """The reference set of a sample is every valid sample of its group, itself included."""
    return _group_reference(rewards, group_ids, valid, std=std, leave_one_out=False)


def _group_reference(r: Tensor, group_ids: Tensor, v: Tensor, *, std: StdKind,
                     leave_one_out: bool) -> tuple[Tensor, Tensor, Tensor]:
    """Mean and std of each sample's reference set of k rewards (float64). The std divides the squared
    deviations by k - 1 (`unbiased`, Bessel's correction, NeMo RL's choice; 0 where k = 1) or by k
    (`population`)."""
    _, gid = torch.unique(group_ids, return_inverse=True)
    num_groups = int(gid.max()) + 1 if gid.numel() else 0
    rv = torch.where(v, r, torch.zeros_like(r))
    vf = v.to(torch.float64)
    g_n = torch.zeros(num_groups, dtype=torch.float64, device=r.device).index_add_(0, gid, vf)
    g_s = torch.zeros_like(g_n).index_add_(0, gid, rv)
    g_ss = torch.zeros_like(g_n).index_add_(0, gid, rv * rv)
    n, s, ss = g_n[gid], g_s[gid], g_ss[gid]
    if leave_one_out:
        n, s, ss = n - vf, s - rv, ss - rv * rv
    has = v & (n > 0)
    n_safe = n.clamp(min=1)
    base = s / n_safe
    var = (ss / n_safe - base * base).clamp(min=0)
    if std == "unbiased":
        var = torch.where(n > 1, var * n / (n - 1).clamp(min=1), torch.zeros_like(var))
    base = torch.where(has, base, r)
    # E[x^2] - E[x]^2 leaves ~1e-9 where the rewards are equal but not exact in binary (thirds): that is
    # no spread, and dividing by it would turn a 1/3 gap into an advantage of 3e5
    sd = var.sqrt()
    return base, torch.where(has & (sd > SPREAD_TOLERANCE * base.abs().clamp(min=1.0)), sd, torch.zeros_like(sd)), has


def grpo_advantages(
    rewards: Tensor,
    group_ids: Tensor,
    valid: Tensor | None = None,
    *,
    baseline: Baseline = "leave_one_out",
    normalize_std: bool = True,
    eps: float = 1e-6,
    std: StdKind = "unbiased",
) -> Tensor:
    """A_i = r_i - b_i, divided by (std_i + eps) only where std_i > 0 and `normalize_std` is on.

    Groups whose rewards are all equal give 0 (no signal, no division by ~0). Invalid samples give 0.
    """
    base, sd, has = group_baseline_and_std(rewards, group_ids, valid, baseline=baseline, std=std)
    r = rewards.detach().to(base.dtype)
    adv = torch.where(has, r - base, torch.zeros_like(r))
    if normalize_std:
        adv = torch.where(sd > 0, adv / (sd + eps), adv)
    return adv


def mopd_advantages(logp_teacher: Tensor, logp_student: Tensor, mask: Tensor) -> Tensor:
    """Per-token stop_grad(log pi_teacher - log pi_student); 0 off the mask (no -inf leaks)."""
    gap = (logp_teacher - logp_student).detach()
    m = mask if mask.dtype == torch.bool else mask != 0
    return torch.where(m, gap, torch.zeros_like(gap))
