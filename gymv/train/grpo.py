"""Synchronous GRPO, read top to bottom: set up, then each step generates, scores, trains and refits.

One step:
1. draw `prompts_per_step` rows (epoch order is a pure function of the seed, so resuming redraws them);
2. the generation workers run G episodes of each row with the current weights (per-step sampling seed);
3. leave-one-out advantages per group; failed rollouts are counted and left out of training;
4. the training workers take one optimizer step per `global_batch_size` samples: clipped policy loss,
   optional KL to the frozen initial policy, `token_mult_prob_error` of the generator's logprobs against
   the trainer's on the same tokens and weights;
5. refit: the new weights go to every generation worker (then the encoder cache is reset, if configured);
6. validate, log one metrics row, write the rollouts, checkpoint.
"""

from __future__ import annotations

import time

from gymv.algorithms.grpo import policy_loss
from gymv.cluster.group import Placement, PolicyCluster
from gymv.rollout import to_rollout_record
from gymv.train.failures import FailureGuard
from gymv.train.setup import (
    Checkpointer,
    RunContext,
    rollout_kwargs,
    sampling_params,
    should_validate,
    step_seed,
    worker_spec,
)
from gymv.train.stats import group_advantages, is_usable, policy_samples, policy_update, rollout_metrics
from gymv.train.validation import validate


def train_grpo(ctx: RunContext, *, resume: bool) -> dict:
    cfg, grpo, run, report = ctx.cfg, ctx.cfg.grpo, ctx.run, ctx.reporter
    G = grpo.generations_per_prompt

    # ---- setup -----------------------------------------------------------------------------------
    report.on_message("starting workers")
    cluster = PolicyCluster(worker_spec(cfg, ctx.model_path, kl_reference=grpo.loss.kl_coef > 0), Placement.from_config(cfg))
    try:
        checkpoints = Checkpointer(ctx, cluster)
        restored, step, data = checkpoints.start(resume, cluster)
        loss_fn = policy_loss(grpo)
        params = sampling_params(cfg)
        limits = rollout_kwargs(cfg)
        metrics_log = run.metrics_log()
        guard = FailureGuard.from_config(cfg, ctx.train_source, warn=report.on_message)
        report.on_start({"algorithm": cfg.algorithm, "run_dir": str(run.path), "start_step": step,
                         "max_steps": grpo.max_steps, "resumed_from": str(restored.path) if restored else None})

        if step == 0 and grpo.val_at_start:
            row = validate(ctx, cluster, 0, grpo.val_prompts)
            metrics_log.log(0, row)
            report.on_step(0, row)

        final_metrics: dict = {}
        while step < grpo.max_steps:
            step += 1
            t_step = time.perf_counter()

            # 1-2. rollouts of this step's prompts
            batch = data.next_batch(grpo.prompts_per_step)
            trajectories, timing = cluster.rollouts([(r.index, r.data) for r in batch], group_size=G, params=params,
                                                    seed=step_seed(cfg.seed, step), source=ctx.train_source, **limits)
            guard.check(step, trajectories)  # before training: a step that trips it is not trained nor counted

            # 3. advantages and training samples
            advantages, adv_stats = group_advantages(trajectories, G, grpo.advantage)
            samples = policy_samples(trajectories, advantages)

            # 4. optimizer step(s)
            train_metrics = policy_update(cluster, cfg, samples, [t.reward for t in trajectories if is_usable(t)],
                                          loss_fn, grpo.seq_logprob_error_threshold)

            # 5. refit
            refit_s = cluster.refit(step)
            report.on_refit(step, cluster)

            # 6. validation, logs, checkpoint
            metrics = {**rollout_metrics(trajectories, "train"), **adv_stats, **train_metrics}
            if should_validate(step, grpo.val_period, grpo.max_steps):
                metrics.update(validate(ctx, cluster, step, grpo.val_prompts))
            step_s = time.perf_counter() - t_step
            generated = sum(sum(t.loss_mask) for t in trajectories)
            total_tokens = sum(len(t.token_ids) for t in trajectories)
            metrics.update({
                "timing/step_s": step_s, "timing/generation_s": timing["generation_s"], "timing/env_s": timing["env_s"],
                "timing/refit_s": refit_s,
                "timing/generation_tokens_per_s": generated / max(timing["generation_s"], 1e-9),
                "timing/tokens_per_s": total_tokens / max(step_s, 1e-9),
                **{f"timing/generation/{k.split('/', 1)[1]}": v for k, v in timing.items() if k.startswith("breakdown/")},
            })
            if cfg.logger.log_rollouts:
                run.write_rollouts(step, [to_rollout_record(t, advantage=a) for t, a in zip(trajectories, advantages)])
            metrics_log.log(step, metrics)
            report.on_step(step, metrics)
            final_metrics = metrics

            if checkpoints.end_step(step, grpo.max_steps, data.position):
                break

        return checkpoints.finish(cluster, step, grpo.max_steps, metrics_log, final_metrics)
    finally:
        cluster.shutdown()
