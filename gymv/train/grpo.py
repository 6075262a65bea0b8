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

Steps 1-2 and 4-6 are `run_sync`, which MOPD runs too with its own batches (gymv/train/mopd.py); step 3 is
`grpo_batch`, which async GRPO uses as well (gymv/train/grpo_async.py).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

from gymv.algorithms.grpo import policy_loss
from gymv.cluster.group import Placement, PolicyCluster
from gymv.cluster.workers import RolloutRequest
from gymv.rollout import to_rollout_record
from gymv.timing import PhaseTimer
from gymv.train.failures import FailureGuard
from gymv.train.loop import TrainingLoop, rollout_throughput
from gymv.train.setup import RunContext, sampling_params, step_seed, worker_spec
from gymv.train.stats import TrainBatch, group_advantages, policy_samples, policy_update, rollout_metrics, trained


def grpo_batch(grpo, max_seq_len: int) -> Callable[[list, PhaseTimer], TrainBatch]:
    """GRPO's samples of a step's trajectories (the G of each prompt contiguous): group advantages over all of
    them, samples of those that train (`grpo.overlong_filtering` leaves the overlong ones out)."""

    def make(trajectories: list, timer: PhaseTimer) -> TrainBatch:
        advantages, adv_stats = group_advantages(trajectories, grpo.generations_per_prompt, grpo.advantage)
        keep, filtered = trained(trajectories, grpo.overlong_filtering, max_seq_len)
        chosen = [i for i, k in enumerate(keep) if k]
        return TrainBatch(policy_samples([trajectories[i] for i in chosen], [advantages[i] for i in chosen]),
                          [trajectories[i].reward for i in chosen],
                          {**rollout_metrics(trajectories, "train"), **adv_stats, **filtered},
                          lambda: [to_rollout_record(t, advantage=a) for t, a in zip(trajectories, advantages)])

    return make


def train_grpo(ctx: RunContext, *, resume: bool) -> dict:
    cfg, grpo = ctx.cfg, ctx.cfg.grpo
    ctx.reporter.on_message("starting workers")
    cluster = PolicyCluster(worker_spec(cfg, ctx.model_path, kl_reference=grpo.loss.kl_coef > 0), Placement.from_config(cfg))
    try:
        return run_sync(ctx, cluster, grpo, policy_loss(grpo), grpo_batch(grpo, cfg.model.max_seq_len), resume=resume)
    finally:
        cluster.shutdown()


def run_sync(ctx: RunContext, cluster, section, loss_fn, make_batch: Callable[[list, PhaseTimer], TrainBatch], *,
             resume: bool, start_info: dict | None = None) -> dict:
    """The synchronous loop of an algorithm section (`grpo` or `mopd`: its sizes and validation keys), whose
    `make_batch` turns a step's trajectories into training samples and metrics (timing its phases with the
    step's timer)."""
    cfg, report = ctx.cfg, ctx.reporter
    loop = TrainingLoop(ctx, cluster, section, resume=resume)
    request = RolloutRequest(group_size=section.generations_per_prompt, params=sampling_params(cfg),
                             source=ctx.train_source)
    guard = FailureGuard.from_config(cfg, ctx.train_source, warn=report.on_message)
    loop.start(**(start_info or {}))

    for step, timer in loop.steps():
        # 1-2. rollouts of this step's prompts
        rows = loop.data.next_batch(section.prompts_per_step)
        with timer.phase("generation"):
            trajectories, worker_timing = cluster.rollouts([(r.index, r.data) for r in rows],
                                                           replace(request, seed=step_seed(cfg.seed, step)))
        # the environment's seconds and generation's split, the slowest worker's; what remains is its memory
        generation_memory = timer.take(worker_timing)
        rollout_throughput(timer, trajectories)
        guard.check(step, trajectories)  # before training: a step that trips it is not trained nor counted

        # 3. the algorithm's training samples (GRPO: advantages; MOPD: teacher scores)
        batch = make_batch(trajectories, timer)

        # 4. optimizer step(s)
        timer.announce("training")
        train_metrics = timer.take(policy_update(cluster, cfg, batch.samples, batch.rewards, loss_fn,
                                                 section.seq_logprob_error_threshold))

        # 5. refit (the generation workers reset their encoder cache after it, when configured)
        with timer.phase("refit"):
            cluster.refit(step)
        report.on_refit(step, cluster)

        # 6. validation, logs, checkpoint
        metrics = {**batch.metrics, **train_metrics, **generation_memory, **loop.validation_if_due(step)}
        loop.end_step(metrics, rollouts=batch.records)

    return loop.finish()
