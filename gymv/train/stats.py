"""Rollout statistics and training samples, computed on the driver from trajectories (names: docs/algorithms.md §10)."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from gymv.algorithms.seq_error import LOSS_STATS, seq_error_metrics, unmasked_metrics
from gymv.backends.training.samples import training_sample
# torch (advantages) and the workers load on first use: gymv.train's pre-flight imports this module first



def _mean(xs: Sequence[float]) -> float:
    return sum(xs) / len(xs) if xs else float("nan")


def _std(xs: Sequence[float]) -> float:
    if not xs:
        return float("nan")
    m = _mean(xs)
    return math.sqrt(sum((x - m) ** 2 for x in xs) / len(xs))


def _qualifier(agent: str) -> str:
    return agent.replace("/", "_")


def rollout_metrics(trajectories: Sequence[Any], prefix: str) -> dict[str, float]:
    """Reward, accuracy (share with reward >= 1), lengths, turns and failure shares of a batch of rollouts.

    Failed rollouts (infrastructure errors) are counted in `failed_fraction` and left out of the rest.
    """
    ok = [t for t in trajectories if t.error is None]
    rewards = [float(t.reward) for t in ok]
    lengths = [sum(t.loss_mask) for t in ok]
    out = {
        f"{prefix}/reward_mean": _mean(rewards),
        f"{prefix}/reward_std": _std(rewards),
        f"{prefix}/accuracy": _mean([1.0 if r >= 1.0 else 0.0 for r in rewards]),
        f"{prefix}/gen_length_mean": _mean(lengths),
        f"{prefix}/gen_length_max": float(max(lengths)) if lengths else float("nan"),
        f"{prefix}/turns_mean": _mean([t.turns for t in ok]),
        f"{prefix}/truncated_fraction": _mean([1.0 if t.truncated else 0.0 for t in ok]),
        f"{prefix}/failed_fraction": _mean([0.0 if t.error is None else 1.0 for t in trajectories]),
        f"{prefix}/num_rollouts": float(len(trajectories)),
    }
    agents = sorted({t.agent_name for t in ok})
    if len(agents) > 1:
        for agent in agents:
            mine = [float(t.reward) for t in ok if t.agent_name == agent]
            out[f"{prefix}/reward_mean/{_qualifier(agent)}"] = _mean(mine)
            out[f"{prefix}/accuracy/{_qualifier(agent)}"] = _mean([1.0 if r >= 1.0 else 0.0 for r in mine])
    return out


def group_advantages(trajectories: Sequence[Any], group_size: int, advantage_cfg) -> tuple[list[float], dict[str, float]]:
    """GRPO advantages (trajectories come grouped: the G of each prompt contiguous), bounded where
    `advantage_cfg.clip_low`/`clip_high` say, and their statistics (of the bounded values, which train)."""
    import torch

    from gymv.algorithms.advantages import group_ids_for, grpo_advantages

    n = len(trajectories)
    if n % group_size:
        raise RuntimeError(f"{n} trajectories do not form groups of {group_size}")
    valid = torch.tensor([t.error is None and sum(t.loss_mask) > 0 for t in trajectories])
    rewards = torch.tensor([float(t.reward) if t.error is None else float("nan") for t in trajectories], dtype=torch.float64)
    groups = group_ids_for(n // group_size, group_size)
    adv = grpo_advantages(rewards, groups, valid, baseline=advantage_cfg.baseline,
                          normalize_std=advantage_cfg.normalize_std, eps=advantage_cfg.eps, std=advantage_cfg.std)
    bounds = advantage_cfg.bounds()
    clipped = None
    if bounds is not None:
        bounded = adv.clamp(*bounds)
        clipped = int(((bounded != adv) & valid).sum())
        adv = bounded
    vals = [float(a) for a, v in zip(adv, valid) if v]
    r = torch.where(valid, rewards, torch.zeros_like(rewards)).view(-1, group_size)
    vmask = valid.view(-1, group_size)
    zero_std = 0
    for g in range(r.shape[0]):
        rg = r[g][vmask[g]]
        zero_std += int(rg.numel() < 2 or bool((rg == rg[0]).all()))
    stats = {
        "train/advantage_mean": _mean(vals),
        "train/advantage_std": _std(vals),
        "train/advantage_min": min(vals) if vals else float("nan"),
        "train/advantage_max": max(vals) if vals else float("nan"),
        "train/zero_std_group_fraction": zero_std / max(r.shape[0], 1),
    }
    if clipped is not None:
        stats["train/advantage_clipped_fraction"] = clipped / max(len(vals), 1)
    return [float(a) for a in adv], stats


def is_usable(t: Any) -> bool:
    """A trajectory that trains: no infrastructure error and at least one generated token."""
    return t.error is None and any(t.loss_mask)


def overlong(t: Any, max_seq_len: int) -> bool:
    """A token budget cut the episode before it finished (NeMo RL's `truncated`): gymv's loop ended it for
    length (generation.max_new_tokens, env.max_rollout_tokens or model.max_seq_len), or it fills
    model.max_seq_len (NeMo RL's rule for NeMo Gym rollouts: an agent's finish reasons are not seen here)."""
    return t.finish_reason == "length" or len(t.token_ids) >= max_seq_len


def trained(trajectories: Sequence[Any], overlong_filtering: bool, max_seq_len: int) -> tuple[list[bool], dict]:
    """Which trajectories train: the usable ones, less, with `overlong_filtering` (NeMo RL's key and
    semantics), the overlong ones: they leave the loss and the token and sequence counts it is divided by,
    while their rewards have entered their groups' baselines (advantages come first and are not recomputed).
    With filtering on, also `train/num_overlong_filtered`."""
    cut = [overlong_filtering and is_usable(t) and overlong(t, max_seq_len) for t in trajectories]
    keep = [is_usable(t) and not c for t, c in zip(trajectories, cut)]
    return keep, ({"train/num_overlong_filtered": float(sum(cut))} if overlong_filtering else {})


def policy_samples(trajectories: Sequence[Any], advantages: Sequence[float]) -> list[dict]:
    """Training samples of the usable trajectories: tokens, loss mask, behaviour logprobs, advantage, images
    (gymv.backends.training.samples)."""
    return [training_sample(t.token_ids, t.loss_mask, images=t.images, where=f"row {t.task_index} sample {t.sample_index}",
                            logp_behaviour=t.logprobs, advantage=a)
            for t, a in zip(trajectories, advantages) if is_usable(t)]


@dataclass
class TrainBatch:
    """What an algorithm makes of one step's trajectories: its training samples (with their episodes' rewards,
    for the sequence-level figures), its metrics and, when asked, the rollout records."""

    samples: list
    rewards: list[float]
    metrics: dict[str, float]
    records: Callable[[], list[dict]]


def policy_update(cluster, cfg, samples: list, rewards: Sequence[float], loss_fn,
                  seq_error_threshold: float | None) -> dict[str, float]:
    """The optimizer step(s) of one algorithm step on `samples` (their episodes' `rewards` beside them), and
    NeMo RL's sequence-level logprob-error figures (gymv.algorithms.seq_error): from the losses' statistics,
    or with a `seq_logprob_error_threshold` from every sample's error, scored before the step."""
    from gymv.cluster.workers import SEQ_ERRORS_KEY

    metrics = cluster.grpo_step(minibatches(samples, cfg.training.global_batch_size, cfg.samples_per_step), loss_fn,
                                seq_error_threshold=seq_error_threshold)
    stats = {k: metrics.pop(f"train/{k}") for k in LOSS_STATS if f"train/{k}" in metrics}
    if seq_error_threshold is not None:
        metrics.update(seq_error_metrics(metrics.pop(SEQ_ERRORS_KEY), rewards, seq_error_threshold))
    elif len(stats) == len(LOSS_STATS) or not samples:  # behaviour logprobs were there; or no sample was
        metrics.update(unmasked_metrics({**dict.fromkeys(LOSS_STATS, 0.0), **stats}))
    return metrics


def minibatches(samples: list, global_batch_size: int, samples_per_step: int) -> list[list]:
    """One list per optimizer step: samples_per_step / global_batch_size of them, in order."""
    n_steps = max(1, samples_per_step // max(global_batch_size, 1))
    size = math.ceil(len(samples) / n_steps) if samples else 0
    return [samples[i * size:(i + 1) * size] for i in range(n_steps) if samples[i * size:(i + 1) * size]] or [[]]
