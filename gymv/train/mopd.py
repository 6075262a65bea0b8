"""Multi-teacher on-policy distillation (MOPD), read top to bottom: set up, then each step generates, routes,
scores with the teachers, trains and refits.

One step:
1. draw `prompts_per_step` rows; the student's generation workers run G episodes of each (current weights);
2. route each usable episode to exactly one teacher by its agent name (gymv.algorithms.mopd_routing);
3. every teacher scores the student's tokens of its episodes, each row with its own images (a text-only
   teacher gets text only), padded to a multiple of its data-parallel size by repeating whole rows;
4. one optimizer step per `global_batch_size` samples on the distillation loss: per token
   A_t = stop_grad(log pi_teacher - log pi_student) (+ env_reward_coef x the episode's reward advantage),
   REINFORCE at the sampling policy, the IS weights / gate of `mopd.importance_sampling`;
5. refit the generation workers (and reset their encoder cache, if configured);
6. validate, log one metrics row (with the reverse KL to each teacher), write the rollouts, checkpoint.
With `mopd.async.enabled` (`gymv train --async`) generation runs ahead of training as in async GRPO
(gymv/train/grpo_async.py): each step takes finished episodes at most `max_trajectory_age_steps` old, the
teachers score exactly those (step 3, when the step trains on them), and the IS correction is required.

The setup, data stream, rollouts, refit, validation and checkpoints are GRPO's (gymv.train, gymv.cluster.group);
only routing, teacher scoring and the loss (gymv.algorithms.mopd) are MOPD's own.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from gymv.algorithms.mopd import distillation_samples, env_advantages, mopd_loss, sample_where, teacher_metrics
from gymv.algorithms.mopd_routing import TeacherRouter
from gymv.algorithms.teacher_batch import TeacherRow
from gymv.cluster.group import Placement, PolicyCluster
from gymv.cluster.teachers import TeacherPool, teacher_specs
from gymv.envs import get_env
from gymv.rollout import to_rollout_record
from gymv.timing import PhaseTimer
from gymv.train.grpo import run_sync
from gymv.train.grpo_async import run_async
from gymv.train.setup import RunContext, worker_spec
from gymv.train.stats import TrainBatch, rollout_metrics, trained

COLOCATED_POLICY_SHARE = 0.35  # of a GPU, for each of generation and training when a teacher shares it


@dataclass
class TeacherScores:
    logprobs: list  # per usable episode, its teacher's scores
    aliases: list[str]  # per usable episode, the teacher that scored it
    batches: int  # teacher logprob batches scored (one per teacher replica given rows)


def teacher_scores(pool, router: TeacherRouter, usable: Sequence) -> TeacherScores:
    """Route each usable episode to its teacher, score per alias, reassemble in episode order."""
    if not usable:
        return TeacherScores([], [], 0)
    routes = router.route([t.agent_name for t in usable], [sample_where(t) for t in usable])
    rows = {alias: [TeacherRow(usable[i].token_ids, list(usable[i].images), sample_where(usable[i])) for i in idx]
            for alias, idx in routes.items()}
    scored, batches = pool.score(rows)
    logprobs: list = [None] * len(usable)
    aliases: list[str] = [""] * len(usable)
    for alias, idx in routes.items():
        for i, lp in zip(idx, scored[alias]):
            logprobs[i], aliases[i] = lp, alias
    return TeacherScores(logprobs, aliases, batches)


def distill_batch(pool, router: TeacherRouter, trajectories: Sequence, group_size: int, timer: PhaseTimer, *,
                  overlong_filtering: bool = False, max_seq_len: int = 0) -> TrainBatch:
    """Route the episodes that train (usable; with `overlong_filtering` not overlong), have their teachers
    score them (each row with its own images; `timer`'s teacher phase) and make the distillation samples; with
    the reward advantages of all episodes (the env_reward_coef term)."""
    advantages = env_advantages(trajectories, group_size)
    trains, filtered = trained(trajectories, overlong_filtering, max_seq_len)
    keep = [i for i, k in enumerate(trains) if k]
    usable = [trajectories[i] for i in keep]
    with timer.phase("teacher"):
        scores = teacher_scores(pool, router, usable)

    def records() -> list[dict]:
        out = [to_rollout_record(t) for t in trajectories]
        for i, alias in zip(keep, scores.aliases):
            out[i].setdefault("_gymv", {})["teacher"] = alias
        return out

    metrics = {**rollout_metrics(trajectories, "train"), **teacher_metrics(usable, scores.logprobs, scores.aliases),
               "train/num_teacher_batches": float(scores.batches), **filtered}
    return TrainBatch(distillation_samples(usable, scores.logprobs, [advantages[i] for i in keep]),
                      [t.reward for t in usable], metrics, records)


def train_mopd(ctx: RunContext, *, resume: bool) -> dict:
    cfg, mopd, report = ctx.cfg, ctx.cfg.mopd, ctx.reporter

    # ---- setup: route the whole training set before anything starts ------------------------------------
    router = TeacherRouter.from_config(mopd)
    per_teacher = router.check_rows(ctx.train_rows, default_agent=get_env(cfg.env.name).agent_name)
    report.on_message("training rows per teacher: " + ", ".join(f"{a} {n}" for a, n in per_teacher.items()))
    specs = teacher_specs(cfg, ctx.model_path)  # resolves every teacher path and backend before workers start
    shares_gpu = cfg.cluster.gpus_per_node > 0 and cfg.cluster.colocated and any(
        t.placement == "colocated" for t in mopd.teachers.values())
    report.on_message("starting workers")
    cluster_kwargs = {"gpu_share": COLOCATED_POLICY_SHARE} if shares_gpu else {}
    cluster = PolicyCluster(worker_spec(cfg, ctx.model_path), Placement.from_config(cfg),
                            in_flight_refit=mopd.async_.enabled and mopd.async_.in_flight_weight_updates,
                            lagging_receivers=mopd.async_.enabled, **cluster_kwargs)
    pool = None
    try:
        report.on_message(f"starting teachers: {', '.join(mopd.teachers)}")
        pool = TeacherPool(cfg, specs, policy_pg=cluster.placement_group)

        def make_batch(trajectories, timer: PhaseTimer) -> TrainBatch:
            return distill_batch(pool, router, trajectories, mopd.generations_per_prompt, timer,
                                 overlong_filtering=mopd.overlong_filtering, max_seq_len=cfg.model.max_seq_len)

        run = run_async if mopd.async_.enabled else run_sync
        return run(ctx, cluster, mopd, mopd_loss(mopd), make_batch, resume=resume, start_info={"teachers": pool.info})
    finally:
        if pool is not None:
            pool.shutdown()
        cluster.shutdown()
