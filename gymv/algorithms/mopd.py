"""MOPD's math: the distillation loss (with an optional reward term), reward advantages, the teacher's
training samples and per-teacher metrics. The loop is gymv.train.mopd.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from gymv.algorithms.advantages import grpo_advantages
from gymv.algorithms.grpo import importance_config
from gymv.algorithms.loss_fns import DistillationLoss, PolicyLoss
from gymv.backends.training.samples import training_sample


@dataclass(frozen=True)
class MopdLoss:
    """The distillation loss plus, with `env_reward_coef` c > 0, c times REINFORCE on the episode's reward
    advantage (batch key `advantages`). Both parts share the IS weights and gate, and the REINFORCE loss is
    linear in the advantage, so this is exactly the loss of A_t = teacher gap + c * reward advantage."""

    distill: DistillationLoss
    env_reward_coef: float = 0.0

    def __call__(self, batch, logp, entropy, counts, candidates=None):
        loss, metrics = self.distill(batch, logp, entropy, counts, candidates)
        if self.env_reward_coef > 0:
            # unclipped ratio * A: the REINFORCE form of the distillation loss, on the reward advantage
            env = PolicyLoss(eps_low=1.0, eps_high=1e9, aggregation=self.distill.aggregation,
                             importance=self.distill.importance)
            env_loss, env_metrics = env(batch, logp, None, counts)
            loss = loss + self.env_reward_coef * env_loss
            metrics["env_pg_loss"] = env_metrics["pg_loss"]
        return loss, metrics


def mopd_loss(mopd) -> MopdLoss:
    return MopdLoss(DistillationLoss(aggregation=mopd.loss.aggregation,
                                     importance=importance_config(mopd.importance_sampling), top_k=mopd.top_k > 0,
                                     advantage_bounds=mopd.advantage.bounds()), mopd.env_reward_coef)


def env_advantages(trajectories: Sequence, group_size: int) -> list[float]:
    """The reward advantage of each episode: leave-one-out within its group when G >= 2, else the reward
    minus the mean reward of the step's usable episodes (never divided by a std). Failed episodes get 0."""
    import torch

    n = len(trajectories)
    valid = torch.tensor([t.error is None for t in trajectories], dtype=torch.bool)
    rewards = torch.tensor([float(t.reward) if t.error is None else 0.0 for t in trajectories], dtype=torch.float64)
    if group_size >= 2:
        adv = grpo_advantages(rewards, torch.arange(n) // group_size, valid, normalize_std=False)
    else:
        adv = grpo_advantages(rewards, torch.zeros(n, dtype=torch.long), valid, baseline="mean", normalize_std=False)
    return [float(a) for a in adv]


def sample_where(t) -> str:
    return f"row {t.task_index} sample {t.sample_index} (agent {t.agent_name})"


def _own_logp(scored):
    """The teacher's logprobs of the sequence's own tokens from a scorer's entry (a tensor, or a dict with
    the top-k candidates too)."""
    return scored["logp"] if isinstance(scored, dict) else scored


def distillation_samples(usable: Sequence, teacher_logprobs: Sequence, advantages: Sequence[float]) -> list[dict]:
    """Training samples of the usable episodes with their teacher's scores (gymv.backends.training.samples)."""
    return [training_sample(t.token_ids, t.loss_mask, images=t.images, where=sample_where(t),
                            logp_behaviour=t.logprobs, advantage=a, logp_teacher=_own_logp(lp),
                            teacher_topk=(lp["topk_ids"], lp["topk_logp"]) if isinstance(lp, dict) else None)
            for t, lp, a in zip(usable, teacher_logprobs, advantages)]


def teacher_metrics(usable: Sequence, teacher_logprobs: Sequence, aliases: Sequence[str]) -> dict[str, float]:
    """Per teacher: the reverse KL, KL(student || teacher), estimated on the student's own tokens
    (token mean of log pi_student - log pi_teacher with the sampling logprobs), and its share of episodes."""
    sums: dict[str, list[float]] = {}
    for t, lp, alias in zip(usable, teacher_logprobs, aliases):
        acc = sums.setdefault(alias, [0.0, 0.0, 0.0])
        gap = sum(s - x for s, x, m in zip(t.logprobs, _own_logp(lp).tolist(), t.loss_mask) if m)
        acc[0] += gap
        acc[1] += sum(t.loss_mask)
        acc[2] += 1
    out: dict[str, float] = {}
    for alias, (gap, tokens, n) in sorted(sums.items()):
        out[f"train/kl_teacher/{alias}"] = gap / tokens if tokens else math.nan
        out[f"train/num_sequences/{alias}"] = float(n)
    return out
