"""Loss functions in the shape the trainer calls: loss_fn(batch, logp, entropy, counts) -> (loss, metrics).

`batch` is a collated micro-batch (dict of tensors, [B] or [B,T]); `logp`/`entropy` are [B,T] from the
model under training; `counts` are the global-batch counts. The loss is this micro-batch's share of the
global loss, and every metric is a share too (sum over micro-batches and ranks gives the global value),
except keys ending in `_max` / `_min`, which reduce by max / min.

Batch keys read here (per-token tensors are aligned with input_ids, see gymv.backends.logprobs; the
sample contract is gymv.backends.training.samples):
  loss_mask [B,T]        1 on generated tokens
  advantages [B]|[B,T]   GRPO advantages
  logp_old [B,T]         trainer logprobs before this step (default: logp detached, i.e. one step per batch)
  logp_behaviour [B,T]   logprobs the generation backend sampled with (enables IS and token_mult_prob_error)
  logp_ref [B,T]         reference policy logprobs (KL penalty)
  logp_teacher [B,T]     MOPD teacher logprobs of the student's tokens
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from gymv.algorithms.advantages import mopd_advantages
from gymv.algorithms.importance import behaviour_ratio, icepop_weights, seq_mask_tis_weights, truncated_is_weights
from gymv.algorithms.losses import (
    Aggregation,
    GlobalCounts,
    KLEstimator,
    aggregate,
    clipped_policy_loss,
    kl_penalty,
    nll_loss,
    reinforce_loss,
)
from gymv.algorithms.masked import as_bool, masked_extreme, masked_fill_zero, masked_max
from gymv.algorithms.registry import KL_ESTIMATORS, LOSS_AGGREGATIONS
from gymv.algorithms.seq_error import LOSS_STATS, batch_errors

Metrics = dict[str, Tensor]


def _require(batch: dict, key: str, who: str) -> Tensor:
    if key not in batch:
        raise RuntimeError(f"{who}: the micro-batch lacks {key!r} (the training samples were built without it)")
    return batch[key]


def _portable(loss, **registries) -> None:
    """Name each registered choice of `loss` so that the training workers find it: a function registered in
    the driver's process alone travels as its import path."""
    for name, registry in registries.items():
        object.__setattr__(loss, name, registry.portable(getattr(loss, name)))


def _token_share(x: Tensor, mask: Tensor, counts: GlobalCounts) -> Tensor:
    return masked_fill_zero(x.detach().float(), mask).sum() / max(counts.tokens, 1.0)


@dataclass(frozen=True)
class ISConfig:
    """Importance sampling against behaviour logprobs, NeMo RL's `truncated_importance_sampling_type`:
    `kind` none (off: on-policy, same engine), truncated (`tis`: rho clamped to [low, high]), icepop (rho
    kept on the tokens inside [low, high], 0 on the others) or seq_mask_tis (`seq-mask-tis`: raw rho kept on
    the sequences whose geometric-mean rho lies inside [low, high], 0 on the others);
    gymv.algorithms.importance."""

    kind: str = "none"
    low: float = 0.0
    high: float = 2.0

    @property
    def enabled(self) -> bool:
        return self.kind != "none"


def _sequence_error_stats(behaviour: Tensor, logp_old: Tensor, mask: Tensor, counts: GlobalCounts) -> Metrics:
    """The sequence-level logprob error e_s (gymv.algorithms.seq_error) of this micro-batch's sequences: their
    mean as a share of the global batch's sequences, their max and min (LOSS_STATS)."""
    errors, has = batch_errors(behaviour, logp_old, mask)
    mean_key, max_key, min_key = LOSS_STATS
    return {mean_key: masked_fill_zero(errors, has).sum() / max(counts.sequences, 1.0),
            max_key: masked_extreme(errors, has, largest=True), min_key: masked_extreme(errors, has, largest=False)}


def _importance(batch: dict, logp_old: Tensor, mask: Tensor, cfg: ISConfig, counts: GlobalCounts, who: str):
    """(weights, the tokens they keep, metrics); weights is None when IS is off. A token outside `kept` has
    weight 0: it leaves the loss but not the mask, so every denominator stays what it was without IS."""
    metrics: Metrics = {}
    if "logp_behaviour" not in batch:
        if cfg.enabled:
            _require(batch, "logp_behaviour", who)
        return None, mask, metrics
    behaviour = batch["logp_behaviour"]
    err = torch.exp(masked_fill_zero((behaviour - logp_old).detach().abs(), mask))
    metrics["token_mult_prob_error"] = _token_share(err, mask, counts)
    metrics.update(_sequence_error_stats(behaviour, logp_old, mask, counts))
    if not cfg.enabled:
        return None, mask, metrics
    # is_oob_ratio (NeMo RL's name): the share of generated tokens (seq_mask_tis: of sequences) whose rho
    # (geometric-mean rho) lies outside [low, high]
    if cfg.kind == "truncated":
        weights, kept = truncated_is_weights(logp_old, behaviour, mask, cfg.high, cfg.low), mask
        rho = behaviour_ratio(logp_old, behaviour, mask)
        metrics["is_oob_ratio"] = _token_share(((rho < cfg.low) | (rho > cfg.high)).float(), mask, counts)
    elif cfg.kind == "icepop":
        weights, kept = icepop_weights(logp_old, behaviour, mask, cfg.low, cfg.high)
        metrics["is_oob_ratio"] = _token_share((mask & ~kept).float(), mask, counts)
    elif cfg.kind == "seq_mask_tis":
        weights, kept_seq = seq_mask_tis_weights(logp_old, behaviour, mask, cfg.low, cfg.high)
        kept = mask & kept_seq.unsqueeze(-1)
        dropped = (mask.any(dim=-1) & ~kept_seq).sum()
        metrics["is_oob_ratio"] = dropped.float() / max(counts.sequences, 1.0)
    else:
        raise ValueError(f"{who}: unknown importance sampling kind {cfg.kind!r}")
    metrics["is_weight_mean"] = _token_share(weights, mask, counts)
    metrics["is_weight_max"] = masked_max(weights, kept)
    return weights, kept, metrics


def _weighted(per_token: Tensor, weights: Tensor | None, kept: Tensor) -> Tensor:
    """The per-token loss times the IS weights, exactly 0 (value and gradient) on the tokens IS drops."""
    if weights is None:
        return per_token
    return masked_fill_zero(per_token * weights.detach(), kept)


def topk_cross_entropy(teacher_topk_logp: Tensor, student_topk_logp: Tensor) -> tuple[Tensor, Tensor]:
    """Per token [B,T]: (-sum_k p_t log p_s, the KL over the k: sum_k p_t (log p_t - log p_s)), p_t being the
    teacher's top-k probabilities renormalised to sum to 1."""
    log_pt = torch.log_softmax(teacher_topk_logp.float(), dim=-1)
    pt = log_pt.exp()
    ls = student_topk_logp.float()
    ce = -(pt * ls).sum(-1)
    return ce, (pt * (log_pt - ls)).sum(-1).detach()


@dataclass(frozen=True)
class PolicyLoss:
    """GRPO: clipped-ratio policy loss, optional KL to a reference, optional IS against the behaviour policy.

    per token: w * -min(ratio*A, clip(ratio)*A) + kl_coef * KL_est, aggregated over the mask (w = 0 on the
    tokens IS drops, which keep their place in the denominators; the KL term is NeMo RL's, unweighted).
    """

    eps_low: float = 0.2
    eps_high: float = 0.2
    kl_coef: float = 0.0
    kl_estimator: KLEstimator = "k3"
    aggregation: Aggregation = "token_mean"
    importance: ISConfig = ISConfig()

    def __post_init__(self) -> None:
        _portable(self, kl_estimator=KL_ESTIMATORS, aggregation=LOSS_AGGREGATIONS)

    def __call__(self, batch: dict, logp: Tensor, entropy: Tensor | None, counts: GlobalCounts) -> tuple[Tensor, Metrics]:
        who = "policy loss"
        mask = as_bool(_require(batch, "loss_mask", who))
        adv = _require(batch, "advantages", who)
        logp_old = batch.get("logp_old", logp.detach())
        weights, kept, metrics = _importance(batch, logp_old, mask, self.importance, counts, who)
        pg, clipped = clipped_policy_loss(logp, logp_old, adv, mask, self.eps_low, self.eps_high)
        per_token = _weighted(pg, weights, kept)
        if self.kl_coef:  # on every generated token and not weighted by IS, as NeMo RL adds it
            kl = kl_penalty(logp, _require(batch, "logp_ref", who), mask, self.kl_estimator)
            per_token = per_token + self.kl_coef * kl
            metrics["kl_ref"] = _token_share(kl, mask, counts)
        loss = aggregate(per_token, mask, self.aggregation, counts)
        metrics["pg_loss"] = aggregate(masked_fill_zero(pg.detach(), kept), mask, self.aggregation, counts)
        metrics["clip_fraction"] = _token_share((clipped & kept).float(), mask, counts)
        if entropy is not None:
            metrics["entropy"] = _token_share(entropy, mask, counts)
        return loss, metrics


@dataclass(frozen=True)
class SFTLoss:
    """Supervised fine-tuning: NLL of the loss-masked tokens."""

    aggregation: Aggregation = "token_mean"

    def __post_init__(self) -> None:
        _portable(self, aggregation=LOSS_AGGREGATIONS)

    def __call__(self, batch: dict, logp: Tensor, entropy: Tensor | None, counts: GlobalCounts) -> tuple[Tensor, Metrics]:
        mask = as_bool(_require(batch, "loss_mask", "sft loss"))
        loss = aggregate(nll_loss(logp, mask), mask, self.aggregation, counts)
        metrics: Metrics = {"nll": _token_share(-logp, mask, counts)}
        if entropy is not None:
            metrics["entropy"] = _token_share(entropy, mask, counts)
        return loss, metrics


@dataclass(frozen=True)
class DistillationLoss:
    """MOPD: REINFORCE on the per-token advantage stop_grad(logp_teacher - logp_student), same IS weights as GRPO.

    `top_k`: instead, at every generated position the cross-entropy from the teacher's k most likely tokens
    (their probabilities renormalised over the k) to the student: -sum_v p_teacher(v) log pi_student(v).
    One sampled token says only how good that token is; the teacher's candidates also say which token it
    would have written. Reads `teacher_topk_logp` [B,T,k] from the batch and takes `candidates` [B,T,k] (the
    student's logprobs of those tokens, which the trainer's logprob function returns beside `logp`).
    """

    aggregation: Aggregation = "token_mean"
    importance: ISConfig = ISConfig()
    top_k: bool = False
    advantage_bounds: tuple[float | None, float | None] | None = None  # (low, high) of the teacher advantage

    def __post_init__(self) -> None:
        _portable(self, aggregation=LOSS_AGGREGATIONS)

    def __call__(self, batch: dict, logp: Tensor, entropy: Tensor | None, counts: GlobalCounts,
                 candidates: Tensor | None = None) -> tuple[Tensor, Metrics]:
        who = "distillation loss"
        mask = as_bool(_require(batch, "loss_mask", who))
        teacher = _require(batch, "logp_teacher", who)
        logp_old = batch.get("logp_old", logp.detach())
        weights, kept, metrics = _importance(batch, logp_old, mask, self.importance, counts, who)
        adv = mopd_advantages(teacher, logp_old, kept)
        if self.advantage_bounds is not None:
            bounded = adv.clamp(*self.advantage_bounds)
            metrics["teacher_advantage_clipped_fraction"] = _token_share((bounded != adv).float(), kept, counts)
            adv = torch.where(kept, bounded, torch.zeros_like(bounded))
        if self.top_k:
            if candidates is None:
                raise RuntimeError("top-k distillation needs the student's logprobs of the teacher's candidates")
            per_token, topk_kl = topk_cross_entropy(_require(batch, "teacher_topk_logp", who), candidates)
            metrics["topk_kl"] = _token_share(topk_kl, kept, counts)
        else:
            per_token = reinforce_loss(logp, adv, kept, logp_old)
        per_token = _weighted(per_token, weights, kept)
        loss = aggregate(per_token, mask, self.aggregation, counts)
        metrics["teacher_advantage"] = _token_share(adv, kept, counts)
        metrics["teacher_advantage_max"] = masked_extreme(adv, kept, largest=True)
        metrics["teacher_advantage_min"] = masked_extreme(adv, kept, largest=False)
        metrics["kl_teacher"] = _token_share(-masked_fill_zero(teacher - logp_old, mask), mask, counts)
        if entropy is not None:
            metrics["entropy"] = _token_share(entropy, mask, counts)
        return loss, metrics
