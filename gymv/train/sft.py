"""Supervised fine-tuning on the environment's gold answers, read top to bottom.

Each step draws `batch_size` rows; the training workers lay out each row's prompt and gold assistant turn
exactly as the agent loop would (same chat template, same image tokens; the loss mask covers the gold turn
only) and take one optimizer step on the token-mean NLL. Validation refits the generation worker and runs
greedy rollouts, so `val/accuracy` is the same measurement GRPO makes: the SFT run that warm-starts GRPO
reports the number GRPO starts from.
"""

from __future__ import annotations

from gymv.algorithms.loss_fns import SFTLoss
from gymv.cluster.group import Placement, PolicyCluster
from gymv.timing import PhaseTimer
from gymv.train.loop import TrainingLoop
from gymv.train.setup import RunContext, worker_spec
from gymv.train.validation import validate


def train_sft(ctx: RunContext, *, resume: bool) -> dict:
    cfg, sft, report = ctx.cfg, ctx.cfg.sft, ctx.reporter
    validates = bool(ctx.eval_rows) and sft.val_prompts > 0 and (sft.val_period > 0 or sft.val_at_start)

    # ---- setup -----------------------------------------------------------------------------------
    report.on_message("starting workers")
    cluster = PolicyCluster(worker_spec(cfg, ctx.model_path, logprob_temperature=1.0), Placement.from_config(cfg),
                            generation=validates)
    try:
        def validation(at: int, timer: PhaseTimer) -> dict:
            """The generators hold the starting weights until a validation refits them."""
            with timer.phase("refit"):
                cluster.refit(at)
            report.on_refit(at, cluster)
            return validate(ctx, cluster, at, sft.val_prompts, timer)

        loop = TrainingLoop(ctx, cluster, sft, resume=resume, validation=validation, validates=validates)
        loss_fn = SFTLoss(aggregation=sft.aggregation)
        loop.start()

        for step, timer in loop.steps():
            batch = loop.data.next_batch(sft.batch_size)
            # the next step's rows, laid out by the workers while this step trains (the stream does not move)
            upcoming = loop.data.peek_batch(sft.batch_size) if step < loop.max_steps else []
            timer.announce("training")
            metrics = timer.take(cluster.sft_step(_tasks(batch), loss_fn, _tasks(upcoming) or None))
            timer.rate("tokens", metrics.get("train/num_input_tokens", 0.0), per="training")

            metrics.update(loop.validation_if_due(step))
            loop.end_step(metrics)

        return loop.finish()
    finally:
        cluster.shutdown()


def _tasks(rows) -> list[tuple[int, dict, str]]:
    """Rows as the training workers take them: (task index, row data, where it came from)."""
    return [(r.index, r.data, r.where) for r in rows]
