"""Asynchronous GRPO, read top to bottom: generation runs ahead of training within a staleness bound.

The generation workers keep producing the next batches (gymv/train/pipeline.py) while the training workers
take an optimizer step on the current one; a step's weights go to the generators without waiting, and they
load them between rollouts (or, with `in_flight_weight_updates`, between two generate calls). One step:
1. take `prompts_per_step` finished groups from the replay buffer (oldest first; a group whose weights are
   more than `max_trajectory_age_steps` optimizer steps old is dropped and counted);
2. leave-one-out advantages per group, as in synchronous GRPO;
3. the optimizer step, with importance sampling against the behaviour logprobs (required: the samples may
   come from older weights than the trainer's);
4. queue the new weights to the generators and submit the batches they allow;
5. validate, log one metrics row (staleness histogram, drops, overlap of generation with training), write
   the rollouts, checkpoint.
With max_trajectory_age_steps 0 every batch waits for the weights of the step before: the synchronous run.
"""

from __future__ import annotations

import time
from collections import Counter

from gymv.algorithms.grpo import policy_loss
from gymv.cluster.group import Placement, PolicyCluster
from gymv.rollout import to_rollout_record
from gymv.train.failures import FailureGuard
from gymv.train.pipeline import RolloutPipeline
from gymv.train.replay import ReplayBuffer
from gymv.train.setup import (
    Checkpointer,
    RunContext,
    rollout_kwargs,
    sampling_params,
    should_validate,
    worker_spec,
)
from gymv.train.stats import group_advantages, is_usable, policy_samples, policy_update, rollout_metrics
from gymv.train.validation import validate


def train_grpo_async(ctx: RunContext, *, resume: bool) -> dict:
    cfg, grpo, run, report = ctx.cfg, ctx.cfg.grpo, ctx.run, ctx.reporter
    G, P, max_age = grpo.generations_per_prompt, grpo.prompts_per_step, grpo.async_.max_trajectory_age_steps

    # ---- setup -----------------------------------------------------------------------------------
    report.on_message("starting workers")
    cluster = PolicyCluster(worker_spec(cfg, ctx.model_path, kl_reference=grpo.loss.kl_coef > 0),
                            Placement.from_config(cfg), in_flight_refit=grpo.async_.in_flight_weight_updates)
    try:
        checkpoints = Checkpointer(ctx, cluster)
        restored, step, data = checkpoints.start(resume, cluster)
        loss_fn = policy_loss(grpo)
        pipeline = RolloutPipeline(cluster, data, ReplayBuffer.for_run(P, max_age), prompts_per_step=P, group_size=G,
                                   max_steps=grpo.max_steps, seed=cfg.seed, start_step=step,
                                   rollout_kwargs={"params": sampling_params(cfg), "source": ctx.train_source,
                                                   **rollout_kwargs(cfg)})
        metrics_log = run.metrics_log()
        guard = FailureGuard.from_config(cfg, ctx.train_source)
        report.on_start({"algorithm": cfg.algorithm, "run_dir": str(run.path), "start_step": step,
                         "max_steps": grpo.max_steps, "resumed_from": str(restored.path) if restored else None,
                         "async": True, "max_trajectory_age_steps": max_age})

        if step == 0 and grpo.val_at_start:
            row = validate(ctx, cluster, 0, grpo.val_prompts)
            metrics_log.log(0, row)
            report.on_step(0, row)
        pipeline.fill()  # generation starts here and from now on runs beside training

        final_metrics: dict = {}
        t_prev = time.time()
        while step < grpo.max_steps:
            step += 1

            # 1. this step's groups
            groups, dropped, wait_s = pipeline.take(step)
            trajectories = [t for g in groups for t in g.trajectories]
            guard.check(step, trajectories)
            ages = Counter(g.age(step) for g in groups for _ in g.trajectories)

            # 2-3. advantages, optimizer step(s)
            advantages, adv_stats = group_advantages(trajectories, G, grpo.advantage)
            samples = policy_samples(trajectories, advantages)
            t_train = time.time()
            train_metrics = policy_update(cluster, cfg, samples, [t.reward for t in trajectories if is_usable(t)],
                                          loss_fn, grpo.seq_logprob_error_threshold)
            t_trained = time.time()

            # 4. new weights to the generators (validation queues right behind them), then the batches they allow
            t0 = time.perf_counter()
            pipeline.refit(step)
            refit_s = time.perf_counter() - t0
            report.on_refit(step, cluster)
            metrics = {**rollout_metrics(trajectories, "train"), **adv_stats, **train_metrics}
            if should_validate(step, grpo.val_period, grpo.max_steps):
                metrics.update(validate(ctx, cluster, step, grpo.val_prompts))
            pipeline.fill()

            # 5. logs, checkpoint
            now = time.time()
            step_s = now - t_prev
            overlap = pipeline.overlap_s(t_train, t_trained)
            generated = sum(sum(t.loss_mask) for t in trajectories)
            total_tokens = sum(len(t.token_ids) for t in trajectories)
            gen_s, env_s = pipeline.timings()
            metrics.update({
                "timing/step_s": step_s, "timing/wait_s": wait_s, "timing/refit_s": refit_s,
                "timing/generation_s": gen_s, "timing/env_s": env_s,
                "timing/overlap_s": overlap, "async/overlap_fraction": overlap / max(step_s, 1e-9),
                "timing/generation_tokens_per_s": generated / max(gen_s, 1e-9),
                "timing/tokens_per_s": total_tokens / max(step_s, 1e-9),
                "async/age_mean": sum(a * n for a, n in ages.items()) / max(sum(ages.values()), 1),
                "async/age_max": float(max(ages, default=0)),
                **{f"async/age_{a}_fraction": ages.get(a, 0) / max(sum(ages.values()), 1) for a in range(max_age + 1)},
                "async/dropped_trajectories": float(dropped),
                "async/dropped_trajectories_total": float(pipeline.stats.dropped_trajectories),
                "async/failed_calls_total": float(pipeline.stats.failed_calls),
                "async/retried_calls_total": float(pipeline.stats.retried_calls),
                "async/worker_restarts_total": float(pipeline.stats.worker_restarts),
                "async/buffered_groups": float(len(pipeline.buffer)),
                "async/encoder_cache_stale_hits_total": float(pipeline.stats.stale_encoder_hits),
            })
            if cfg.logger.log_rollouts:
                run.write_rollouts(step, [to_rollout_record(t, advantage=a) for t, a in zip(trajectories, advantages)])
            metrics_log.log(step, metrics)
            report.on_step(step, metrics)
            final_metrics = metrics
            t_prev = now

            if checkpoints.end_step(step, grpo.max_steps, pipeline.positions.get(step, data.position)):
                break

        pipeline.close()
        return checkpoints.finish(cluster, step, grpo.max_steps, metrics_log, final_metrics)
    finally:
        cluster.shutdown()
