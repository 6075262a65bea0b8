"""GRPO's loss, configured from a recipe's `grpo:` section (the loop is gymv.train.grpo)."""

from __future__ import annotations

from gymv.algorithms.loss_fns import ISConfig, PolicyLoss


def importance_config(is_cfg) -> ISConfig:
    """The IS weights of an `importance_sampling` section (GRPO's and MOPD's)."""
    if is_cfg.kind in ("icepop", "seq_mask_tis"):
        return ISConfig(is_cfg.kind, is_cfg.gate_low, is_cfg.gate_high)
    cap = float("inf") if is_cfg.truncate_max is None else is_cfg.truncate_max  # null: the raw ratio
    return ISConfig(is_cfg.kind, is_cfg.truncate_min, cap)


def policy_loss(grpo) -> PolicyLoss:
    return PolicyLoss(eps_low=grpo.loss.clip_low, eps_high=grpo.loss.clip_high, kl_coef=grpo.loss.kl_coef,
                      kl_estimator=grpo.loss.kl_estimator, aggregation=grpo.loss.aggregation,
                      importance=importance_config(grpo.importance_sampling))
