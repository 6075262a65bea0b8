"""Validation: greedy rollouts of the first `val_prompts` eval rows with the current weights.

Greedy decoding makes the score a function of the weights alone (no sampling noise), so two validations
differ only because the policy changed. `val/accuracy` is the share of rollouts with reward >= 1.
"""

from __future__ import annotations

from gymv.cluster.workers import RolloutRequest
from gymv.rollout import to_rollout_record
from gymv.timing import PhaseTimer
from gymv.train.failures import FailureGuard
from gymv.train.setup import RunContext, sampling_params, step_seed
from gymv.train.stats import rollout_metrics


def validate(ctx: RunContext, cluster, step: int, val_prompts: int, timer: PhaseTimer) -> dict[str, float]:
    """The validation metrics; its seconds (rollouts, their check and their log) are `timer`'s validation phase."""
    rows = ctx.eval_rows[:val_prompts]
    if not rows:
        return {}
    with timer.phase("validation"):
        request = RolloutRequest(group_size=1, params=sampling_params(ctx.cfg, greedy=True),
                                 seed=step_seed(ctx.cfg.seed, step, "val"), source=ctx.eval_source)
        trajectories, _ = cluster.rollouts([(r.index, r.data) for r in rows], request)
        FailureGuard.from_config(ctx.cfg, ctx.eval_source, warn=ctx.reporter.on_message).check(step, trajectories, what="validation at step")
        metrics = rollout_metrics(trajectories, "val")
        metrics = {k: v for k, v in metrics.items() if not k.endswith(("_std", "_max", "num_rollouts"))}
        if ctx.cfg.logger.log_rollouts:
            ctx.run.write_rollouts(step, [to_rollout_record(t) for t in trajectories], split="val")
    return metrics
