"""The metric names gymv logs (docs/algorithms.md §10), so a check naming anything else is caught by lint.

Training code may import `KNOWN_METRICS` to keep what it logs and what checks may name in one place; a
plugin that logs its own metrics calls `register_metric`. A per-environment breakdown appends the agent
name as a last segment (`train/reward_mean/circle_count`); such a name is known when its base is.
"""

from __future__ import annotations

import difflib
import re

from gymv.algorithms.seq_error import METRIC_NAMES as SEQ_ERROR_METRICS

_TRAIN_ROLLOUT = ("reward_mean", "reward_std", "accuracy", "gen_length_mean", "gen_length_max", "turns_mean",
                  "truncated_fraction", "failed_fraction", "num_rollouts")

KNOWN_METRICS: frozenset[str] = frozenset(
    # the trainer and the loss functions
    [f"train/{n}" for n in (
        "loss", "grad_norm", "lr", "num_tokens", "num_sequences", "num_micro_batches", "num_input_tokens",
        "pg_loss", "clip_fraction", "kl_ref", "token_mult_prob_error", "is_weight_mean", "is_weight_max",
        "is_oob_ratio", "entropy", "nll", "teacher_advantage", "teacher_advantage_min", "teacher_advantage_max",
        "teacher_advantage_clipped_fraction", "kl_teacher", "env_pg_loss", "topk_kl", "num_teacher_batches")]
    # a mixture-of-experts router's health (gymv.backends.moe_router)
    + [f"train/{n}" for n in ("moe_aux_loss", "moe_load_max", "moe_bias_absmax")]
    # rollout statistics of the training batch, GRPO advantages, async
    + [f"train/{n}" for n in _TRAIN_ROLLOUT]
    + [f"train/{n}" for n in ("advantage_mean", "advantage_std", "advantage_min", "advantage_max",
                              "advantage_clipped_fraction", "zero_std_group_fraction", "num_overlong_filtered")]
    # sequence-level logprob error (`seq_logprob_error_threshold`, NeMo RL's names)
    + [f"train/{n}" for n in SEQ_ERROR_METRICS]
    + [f"async/{n}" for n in (
        "age_mean", "age_max", "dropped_trajectories", "dropped_trajectories_total", "failed_calls_total",
        "retried_calls_total", "worker_restarts_total", "buffered_groups", "encoder_cache_stale_hits_total",
        "overlap_fraction")]
    # validation rollouts
    + [f"val/{n}" for n in _TRAIN_ROLLOUT]
    # wall-clock phases and throughput
    + [f"timing/{n}" for n in (
        "step_s", "train_step_s", "generation_s", "env_s", "logprobs_s", "reference_s", "teacher_s", "samples_s", "training_s",
        "refit_s", "validation_s", "checkpoint_s", "tokens_per_s", "generation_tokens_per_s", "wait_s", "overlap_s")]
    # a GPU worker's memory over its phase (gymv.cluster.device_memory)
    + [f"memory/{phase}_{n}" for phase in ("training", "generation") for n in ("peak_gb", "reserved_gb", "released_gb")]
    # where generation's time goes (gymv.rollout.loop.BREAKDOWN)
    + [f"timing/generation/{n}" for n in (
        "env_open_s", "render_s", "image_decode_s", "parse_s", "env_step_s", "env_verify_s", "backend_encode_s",
        "backend_prefill_s", "backend_capture_s", "backend_decode_s")]
)
_PATTERNS = (re.compile(r"^async/age_\d+_fraction$"),)  # the staleness histogram: one bin per age

_registered: set[str] = set()
_QUALIFIER = re.compile(r"^[A-Za-z0-9_.\-]+$")


def register_metric(*names: str) -> None:
    """Declare metrics a plugin logs, so checks over them pass lint."""
    for n in names:
        if not isinstance(n, str) or n.count("/") < 1:
            raise ValueError(f"metric name {n!r} must look like <prefix>/<name>")
        _registered.add(n)


def known_metrics() -> frozenset[str]:
    return KNOWN_METRICS | _registered


def is_known_metric(name: str) -> bool:
    """Known as is, or a known metric with a per-environment qualifier appended."""
    known = known_metrics()
    if name in known or any(p.match(name) for p in _PATTERNS):
        return True
    base, _, qualifier = name.rpartition("/")
    return base in known and bool(_QUALIFIER.match(qualifier))


def closest_metric(name: str) -> str | None:
    """The known metric a misspelt name most likely meant (its base, for a qualified name)."""
    hits = difflib.get_close_matches(name, sorted(known_metrics()), n=1, cutoff=0.6)
    if hits:
        return hits[0]
    base, _, qualifier = name.rpartition("/")
    if base:
        hits = difflib.get_close_matches(base, sorted(known_metrics()), n=1, cutoff=0.6)
        if hits:
            return f"{hits[0]}/{qualifier}"
    return None
