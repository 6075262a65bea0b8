"""Asynchronous GRPO (and MOPD), read top to bottom: generation runs ahead of training within a staleness bound.

The generation workers keep producing the next batches (gymv/train/pipeline.py) while the training workers
take an optimizer step on the current one; a step's weights go to the generators without waiting, and they
load them between rollouts (or, with `in_flight_weight_updates`, between two generate calls). One step:
1. take `prompts_per_step` finished groups from the replay buffer (oldest first; a group whose weights are
   more than `max_trajectory_age_steps` optimizer steps old is dropped and counted);
2. leave-one-out advantages per group, as in synchronous GRPO (MOPD, gymv/train/mopd.py: the teachers score
   exactly the rows taken, each with its own images, when the step trains on them);
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
from collections.abc import Callable

from gymv.algorithms.grpo import policy_loss
from gymv.cluster.group import Placement, PolicyCluster
from gymv.cluster.workers import RolloutRequest
from gymv.timing import PhaseTimer
from gymv.train.failures import FailureGuard
from gymv.train.grpo import grpo_batch
from gymv.train.loop import TrainingLoop, rollout_throughput
from gymv.train.pipeline import RolloutPipeline
from gymv.train.replay import ReplayBuffer
from gymv.train.setup import RunContext, sampling_params, worker_spec
from gymv.train.stats import TrainBatch, policy_update


def train_grpo_async(ctx: RunContext, *, resume: bool) -> dict:
    cfg, grpo = ctx.cfg, ctx.cfg.grpo
    ctx.reporter.on_message("starting workers")
    cluster = PolicyCluster(worker_spec(cfg, ctx.model_path, kl_reference=grpo.loss.kl_coef > 0),
                            Placement.from_config(cfg), in_flight_refit=grpo.async_.in_flight_weight_updates,
                            lagging_receivers=True)
    try:
        return run_async(ctx, cluster, grpo, policy_loss(grpo), grpo_batch(grpo, cfg.model.max_seq_len), resume=resume)
    finally:
        cluster.shutdown()


def run_async(ctx: RunContext, cluster, section, loss_fn, make_batch: Callable[[list, PhaseTimer], TrainBatch], *,
              resume: bool, start_info: dict | None = None) -> dict:
    """The asynchronous loop of an algorithm section (`grpo` or `mopd`: its sizes, async and validation keys),
    whose `make_batch` turns a step's trajectories into training samples and metrics (timing its phases with
    the step's timer)."""
    cfg, report = ctx.cfg, ctx.reporter
    G, P, max_age = section.generations_per_prompt, section.prompts_per_step, section.async_.max_trajectory_age_steps

    # ---- setup -----------------------------------------------------------------------------------
    loop = TrainingLoop(ctx, cluster, section, resume=resume)
    pipeline = RolloutPipeline(cluster, loop.data, ReplayBuffer.for_run(P, max_age), prompts_per_step=P,
                               request=RolloutRequest(group_size=G, params=sampling_params(cfg), source=ctx.train_source),
                               max_steps=section.max_steps, seed=cfg.seed, start_step=loop.step)
    guard = FailureGuard.from_config(cfg, ctx.train_source, warn=report.on_message)
    loop.start(**{"async": True, "max_trajectory_age_steps": max_age, **(start_info or {})})
    pipeline.fill()  # generation starts here and from now on runs beside training

    # a step's wall time runs from the end of the step before (waits included)
    for step, timer in loop.steps(back_to_back=True):
        # 1. this step's groups
        with timer.phase("wait"):
            groups, dropped = pipeline.take(step)
        trajectories = [t for g in groups for t in g.trajectories]
        guard.check(step, trajectories)
        ages = Counter(g.age(step) for g in groups for _ in g.trajectories)

        # 2-3. samples (advantages; MOPD: teacher scores of exactly these rows), optimizer step(s)
        batch = make_batch(trajectories, timer)
        t_train = time.time()
        timer.announce("training")
        train_metrics = timer.take(policy_update(cluster, cfg, batch.samples, batch.rewards, loss_fn,
                                                 section.seq_logprob_error_threshold))
        timer.add("overlap", pipeline.overlap_s(t_train, time.time()))

        # 4. new weights to the generators (validation queues right behind them), then the batches they allow
        with timer.phase("refit"):
            pipeline.refit(step)
        report.on_refit(step, cluster)
        metrics = {**batch.metrics, **train_metrics, **loop.validation_if_due(step)}
        pipeline.fill()

        # 5. logs, checkpoint
        timer.take(pipeline.timings())  # generation of the batches that finished since the step before
        rollout_throughput(timer, trajectories)
        timer.stop()
        metrics.update(_async_metrics(pipeline, ages, dropped, max_age, timer))
        loop.end_step(metrics, rollouts=batch.records, position=pipeline.positions.get(step, loop.data.position))

    pipeline.close()
    return loop.finish()


def _async_metrics(pipeline: RolloutPipeline, ages: Counter, dropped: int, max_age: int, timer: PhaseTimer) -> dict:
    """Staleness, drops, faults and the share of the (stopped) step that generation overlapped training, of one
    asynchronous step (docs/async.md)."""
    n = max(sum(ages.values()), 1)
    seconds = timer.seconds
    return {
        "async/overlap_fraction": seconds["overlap"] / max(seconds["step"], 1e-9),
        "async/age_mean": sum(a * k for a, k in ages.items()) / n,
        "async/age_max": float(max(ages, default=0)),
        **{f"async/age_{a}_fraction": ages.get(a, 0) / n for a in range(max_age + 1)},
        "async/dropped_trajectories": float(dropped),
        "async/dropped_trajectories_total": float(pipeline.stats.dropped_trajectories),
        "async/failed_calls_total": float(pipeline.stats.failed_calls),
        "async/retried_calls_total": float(pipeline.stats.retried_calls),
        "async/worker_restarts_total": float(pipeline.stats.worker_restarts),
        "async/buffered_groups": float(len(pipeline.buffer)),
        "async/encoder_cache_stale_hits_total": float(pipeline.stats.stale_encoder_hits),
    }
