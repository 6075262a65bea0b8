"""Supervised fine-tuning on the environment's gold answers, read top to bottom.

Each step draws `batch_size` rows; the training workers lay out each row's prompt and gold assistant turn
exactly as the agent loop would (same chat template, same image tokens; the loss mask covers the gold turn
only) and take one optimizer step on the token-mean NLL. Validation refits the generation worker and runs
greedy rollouts, so `val/accuracy` is the same measurement GRPO makes: the SFT run that warm-starts GRPO
reports the number GRPO starts from.
"""

from __future__ import annotations

import time

from gymv.algorithms.loss_fns import SFTLoss
from gymv.cluster.group import Placement, PolicyCluster
from gymv.train.setup import Checkpointer, RunContext, should_validate, worker_spec
from gymv.train.validation import validate


def train_sft(ctx: RunContext, *, resume: bool) -> dict:
    cfg, sft, run, report = ctx.cfg, ctx.cfg.sft, ctx.run, ctx.reporter
    validates = bool(ctx.eval_rows) and sft.val_prompts > 0 and (sft.val_period > 0 or sft.val_at_start)

    # ---- setup -----------------------------------------------------------------------------------
    report.on_message("starting workers")
    cluster = PolicyCluster(worker_spec(cfg, ctx.model_path, logprob_temperature=1.0), Placement.from_config(cfg),
                            generation=validates)
    try:
        checkpoints = Checkpointer(ctx, cluster)
        restored, step, data = checkpoints.start(resume, cluster)
        loss_fn = SFTLoss(aggregation=sft.aggregation)
        metrics_log = run.metrics_log()
        report.on_start({"algorithm": cfg.algorithm, "run_dir": str(run.path), "start_step": step,
                         "max_steps": sft.max_steps, "resumed_from": str(restored.path) if restored else None})

        def validation(at: int) -> dict:
            refit_s = cluster.refit(at)
            report.on_refit(at, cluster)
            return {**validate(ctx, cluster, at, sft.val_prompts), "timing/refit_s": refit_s}

        if step == 0 and sft.val_at_start and validates:
            row = validation(0)
            metrics_log.log(0, row)
            report.on_step(0, row)

        final_metrics: dict = {}
        while step < sft.max_steps:
            step += 1
            t_step = time.perf_counter()

            batch = data.next_batch(sft.batch_size)
            metrics = cluster.sft_step([(r.index, r.data, r.where) for r in batch], loss_fn)

            if validates and should_validate(step, sft.val_period, sft.max_steps):
                metrics.update(validation(step))
            step_s = time.perf_counter() - t_step
            metrics["timing/step_s"] = step_s
            metrics["timing/tokens_per_s"] = metrics.get("train/num_input_tokens", 0.0) / max(metrics.get("timing/training_s", step_s), 1e-9)
            metrics_log.log(step, metrics)
            report.on_step(step, metrics)
            final_metrics = metrics

            if checkpoints.end_step(step, sft.max_steps, data.position):
                break

        return checkpoints.finish(cluster, step, sft.max_steps, metrics_log, final_metrics)
    finally:
        cluster.shutdown()
