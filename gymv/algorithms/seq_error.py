"""Sequence-level logprob error: NeMo RL's figures on every step and its masking (`seq_logprob_error_threshold`),
with NeMo RL's semantics and metric names.

`token_mult_prob_error` says how far generator and trainer disagree on average over a batch; one sequence
they disagree on badly (a kernel bug on one length, a stale expert) is lost in that mean but gives its tokens
importance ratios that mean nothing. The per-sequence error is the same quantity over one sequence's
generated tokens,

    e_s = mean over the generated tokens t of s of exp(|logp_behaviour[t] - logp_old[t]|)    (>= 1; 1 = agree)

and a sequence with e_s > threshold is masked: it contributes nothing to the loss nor to the token and
sequence counts the loss is normalised by. Its reward still entered its group's baseline (advantages come
first), as in NeMo RL.

Without a threshold the figures cost no logprob pass: the losses take e_s from the behaviour logprobs and the
trainer's pre-update logprobs they already hold (`batch_errors`, logged per micro-batch as LOSS_STATS and
turned into NeMo RL's names by `unmasked_metrics`). With one, the training worker scores the old policy
before the step (it must know e_s before training) and the driver computes them from every sample's e_s.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from gymv.errors import GymvError

if TYPE_CHECKING:  # torch stays unimported for the metric names (gymv.checks, `gymv lint`)
    from torch import Tensor

METRIC_NAMES: tuple[str, ...] = (
    "max_seq_mult_prob_error", "mean_seq_mult_prob_error", "min_seq_mult_prob_error",
    "max_seq_mult_prob_error_after_mask", "mean_seq_mult_prob_error_after_mask",
    "min_seq_mult_prob_error_after_mask", "num_masked_seqs_by_logprob_error", "masked_correct_pct")

# what the losses log per micro-batch: the mean as this micro-batch's share of the global batch's sequences,
# the extremes under the trainer's `_max` / `_min` reductions (NeMo RL's names carry them as prefixes)
LOSS_STATS: tuple[str, ...] = ("seq_mult_prob_error_mean", "seq_mult_prob_error_max", "seq_mult_prob_error_min")


def _terms(logp_behaviour: Tensor, logp_old: Tensor, mask: Tensor) -> Tensor:
    """[sum over the generated tokens of exp(|gap|), their number], on the sequence's device."""
    import torch

    from gymv.algorithms.masked import as_bool, masked_fill_zero

    m = as_bool(mask)
    gap = masked_fill_zero((logp_behaviour.detach().double() - logp_old.detach().double()).abs(), m)
    return torch.stack([masked_fill_zero(gap.exp(), m).sum(), m.sum().double()])


def batch_errors(logp_behaviour: Tensor, logp_old: Tensor, mask: Tensor) -> tuple[Tensor, Tensor]:
    """([B] e_s, [B] bool: the sequence has a generated token) of a [B, T] micro-batch, on its device and
    without a host read; e_s is 1 where the sequence has no generated token."""
    import torch

    from gymv.algorithms.masked import as_bool, masked_fill_zero

    m = as_bool(mask)
    gap = masked_fill_zero((logp_behaviour.detach().double() - logp_old.detach().double()).abs(), m)
    n = m.sum(dim=-1)
    errors = masked_fill_zero(gap.exp(), m).sum(dim=-1) / n.clamp(min=1).double()
    has = n > 0
    return torch.where(has, errors, torch.ones_like(errors)), has


def unmasked_metrics(stats: dict[str, float], prefix: str = "train/") -> dict[str, float]:
    """NeMo RL's eight figures of a step no threshold masked, from the losses' LOSS_STATS (reduced over the
    step): the `_after_mask` figures equal the others, nothing is masked, and a statistic with no sequence to
    take it over (the extremes' neutral +-inf) is 0."""
    import math

    def finite(v: float) -> float:
        return float(v) if math.isfinite(v) else 0.0

    values = {stat: finite(stats[f"seq_mult_prob_error_{stat}"]) for stat in ("max", "mean", "min")}
    out = {f"{stat}_seq_mult_prob_error{suffix}": v for stat, v in values.items() for suffix in ("", "_after_mask")}
    out.update(num_masked_seqs_by_logprob_error=0.0, masked_correct_pct=0.0)
    return {f"{prefix}{k}": out[k] for k in METRIC_NAMES}


def _error(num: float, n: float) -> float | None:
    return num / n if n else None


def sequence_mult_prob_error(logp_behaviour: Tensor, logp_old: Tensor, mask: Tensor) -> float | None:
    """e_s of one sequence ([L] tensors); None when it has no generated token (it is then never masked)."""
    return _error(*_terms(logp_behaviour, logp_old, mask).tolist())


def is_masked(error: float | None, threshold: float | None) -> bool:
    """Masked: a threshold is set and the sequence's error exceeds it (equal is kept)."""
    return threshold is not None and error is not None and error > threshold


def _stats(errors: Sequence[float], suffix: str = "") -> dict[str, float]:
    values = (max(errors), sum(errors) / len(errors), min(errors)) if errors else (0.0, 0.0, 0.0)
    return {f"{stat}_seq_mult_prob_error{suffix}": v for stat, v in zip(("max", "mean", "min"), values)}


def seq_error_metrics(errors: Sequence[float | None], rewards: Sequence[float], threshold: float | None,
                      prefix: str = "train/") -> dict[str, float]:
    """NeMo RL's eight figures of a batch: max/mean/min of e_s over the sequences with generated tokens,
    the same over those kept, how many were masked and the share of those whose reward is exactly 1
    (`masked_correct_pct`, a fraction despite its name). With nothing to average the statistics are 0."""
    if len(errors) != len(rewards):
        raise ValueError(f"{len(errors)} sequence errors for {len(rewards)} rewards")
    masked = [is_masked(e, threshold) for e in errors]
    scored = [e for e in errors if e is not None]
    kept = [e for e, m in zip(errors, masked) if e is not None and not m]
    n_masked = sum(masked)
    correct = sum(1 for r, m in zip(rewards, masked) if m and float(r) == 1.0)
    out = {**_stats(scored), **_stats(kept, "_after_mask"),
           "num_masked_seqs_by_logprob_error": float(n_masked),
           "masked_correct_pct": correct / n_masked if n_masked else 0.0}
    return {f"{prefix}{k}": v for k, v in out.items()}


def drop_masked_samples(minibatches: Sequence[Sequence[dict]], threshold: float) -> tuple[list[list[dict]], list]:
    """(the minibatches without their masked samples, e_s of every sample in minibatch order).

    Samples carry `logp_behaviour`, `logp_old` and `loss_mask` as tensors (the training worker's). Dropping a
    sample is masking it: the loss and the counts of its minibatch are sums over the samples that remain."""
    import torch

    flat = [s for mb in minibatches for s in mb]
    for s in flat:
        if "logp_behaviour" not in s:
            raise GymvError(f"{s.get('where') or 'a sample'} has no generator logprobs to compare",
                            where="seq_logprob_error_threshold",
                            fix="use a generation backend that returns logprobs, or set the threshold to null")
    terms = [_terms(s["logp_behaviour"], s["logp_old"], s["loss_mask"]) for s in flat]
    errors = [_error(num, n) for num, n in (torch.stack(terms).tolist() if terms else [])]  # one host read
    masked = {id(s) for s, e in zip(flat, errors) if is_masked(e, threshold)}
    return [[s for s in mb if id(s) not in masked] for mb in minibatches], errors


ALL_MASKED_STOP_STEPS = 3  # consecutive steps with every sequence masked after which a run stops


class AllMaskedWatch:
    """A step whose sequences the threshold masked, every one, trained on nothing (a zero loss, no update) while
    its step, data position and learning-rate schedule advanced. Each such step is a warning naming the step,
    the threshold and the smallest error (what a threshold would have to be to keep one sequence); on
    ALL_MASKED_STOP_STEPS steps in a row the run stops before logging or checkpointing the last of them, since
    a threshold that keeps nothing is a misconfiguration (or a generator and trainer that disagree), not noise.
    Read from a step's metrics: `train/num_masked_seqs_by_logprob_error` above 0 and no `train/num_sequences`
    left to train on."""

    def __init__(self, threshold: float | None, key: str, warn, stop_after: int = ALL_MASKED_STOP_STEPS):
        self.threshold, self.key, self.warn, self.stop_after = threshold, key, warn, stop_after
        self.in_a_row = 0

    def check(self, step: int, metrics: dict) -> None:
        masked = metrics.get("train/num_masked_seqs_by_logprob_error") or 0
        if self.threshold is None or not masked or metrics.get("train/num_sequences", 1) > 0:
            self.in_a_row = 0
            return
        self.in_a_row += 1
        smallest = metrics.get("train/min_seq_mult_prob_error")
        errors = f"; the smallest sequence error was {smallest:.9g}" if smallest else ""
        if self.in_a_row >= self.stop_after:
            raise GymvError(f"{self.key} {self.threshold:g} masked every sequence of the last {self.in_a_row} steps "
                            f"(to step {step}{errors}): the run was training on nothing; this step was not "
                            "checkpointed", where=self.key, exit_code=1,
                            fix=f"raise {self.key} above the errors (each is at least 1; 1 masks nearly all), or set "
                                "it to null; a large train/token_mult_prob_error means generator and trainer disagree")
        self.warn(f"warning: step {step}: {self.key} {self.threshold:g} masked all {int(masked)} sequences{errors}, so "
                  f"the step trained on nothing (the run stops after {self.stop_after} such steps in a row)")
