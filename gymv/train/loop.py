"""The loop every algorithm runs (SFT, GRPO, async GRPO, MOPD); its step's own work stays in the algorithm's file.

    loop = TrainingLoop(ctx, cluster, cfg.grpo, resume=resume)
    loop.start()                                   # restored checkpoint, on_start, validation at step 0
    for step, timer in loop.steps():               # from the step after the restored one
        ...                                        # the algorithm's step; `with timer.phase("refit"):` times a phase
        metrics.update(loop.validation_if_due(step))
        loop.end_step(metrics, rollouts=records)   # the rollouts, one metrics row, a checkpoint when due
    return loop.finish()                           # the final export when complete; the loop's result

The loop owns what the algorithms share: where the run continues from (checkpoint, data position), when to
validate, the metrics log, the rollout log, checkpoints and `checkpoint.steps_per_run`, and each step's
`PhaseTimer` (gymv.timing), whose record is the only source of a row's `timing/*` keys.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from functools import partial
from pathlib import Path
from typing import Any

from gymv.algorithms.seq_error import AllMaskedWatch
from gymv.cluster.group import TrainerHandle
from gymv.models.init_path import FINAL_DIR
from gymv.runs.checkpoint import CheckpointState, DataPosition, disk_room_warning, unusable_checkpoints
from gymv.timing import PhaseTimer, step_row
from gymv.train.data import RowStream
from gymv.train.logprob_guard import LogprobErrorGuard
from gymv.train.setup import RunContext, record_placement
from gymv.train.validation import validate


def rollout_throughput(timer: PhaseTimer, trajectories: Sequence[Any]) -> None:
    """Generated tokens per generation second, and all tokens of the step's episodes per step second."""
    timer.rate("generation_tokens", sum(sum(t.loss_mask) for t in trajectories), per="generation")
    timer.rate("tokens", sum(len(t.token_ids) for t in trajectories), per="step")


class TrainingLoop:
    """`section` is the algorithm's recipe section (max_steps, val_period, val_at_start, val_prompts).

    `validation(step, timer)` is how this algorithm validates, timing its phases with the step's timer (default:
    greedy rollouts with the generators' current weights); `validates` False leaves validation out altogether
    (an SFT run without eval rows)."""

    def __init__(self, ctx: RunContext, cluster, section, *, resume: bool,
                 validation: Callable[[int, PhaseTimer], dict] | None = None, validates: bool = True):
        self.ctx, self.cluster, self.section = ctx, cluster, section
        self.max_steps = section.max_steps
        self.validates = validates
        self._validation = validation or (lambda at, timer: validate(ctx, cluster, at, section.val_prompts, timer))
        self.checkpoints = Checkpointer(ctx, cluster)
        self.restored, self.step, self.data = self.checkpoints.start(resume, cluster)
        self.metrics_log = ctx.run.metrics_log()
        self.last_metrics: dict = {}
        self.timer = PhaseTimer()  # the current step's
        self.checkpoint_s = 0.0
        self._stopping = False
        key = f"{ctx.cfg.base_algorithm}.seq_logprob_error_threshold"
        self.masked = AllMaskedWatch(getattr(section, "seq_logprob_error_threshold", None), key,
                                     ctx.reporter.on_message)
        self.logprob_guard = LogprobErrorGuard.for_run(ctx.cfg, section, ctx.cfg.base_algorithm, ctx.reporter.on_message)

    def start(self, **info) -> None:
        """Tell the reporter where the run starts (`info`: the algorithm's own keys), then validate at step 0
        when asked."""
        ctx = self.ctx
        ctx.reporter.on_start({"algorithm": ctx.cfg.algorithm, "run_dir": str(ctx.run.path), "start_step": self.step,
                               "max_steps": self.max_steps,
                               "resumed_from": str(self.restored.path) if self.restored else None, **info})
        checks = getattr(self.cluster, "checks", None)
        if checks is not None and checks.kind is None and self.cluster.generators and ctx.cfg.refit.check.mode == "auto":
            ctx.reporter.on_message(f"note: refits are not checked: generation backend {ctx.cfg.generation.backend!r} "
                                    "declares no refit check (refit.check.mode: digest or probe asks it anyway)")
        if self.step == 0 and self.section.val_at_start and self.validates:
            timer = PhaseTimer()  # step 0 is validation alone: no step time
            row = step_row(self._validation(0, timer), timer)
            self.metrics_log.log(0, row)
            ctx.reporter.on_step(0, row)

    def steps(self, *, back_to_back: bool = False) -> Iterator[tuple[int, PhaseTimer]]:
        """(step, its timer) for each step to run; stops at max_steps or after `checkpoint.steps_per_run`.

        With `back_to_back` a step's clock starts where the step before's stopped: an asynchronous step's time
        is what it took from the last one, its wait for rollouts generated meanwhile included."""
        started = None
        while self.step < self.max_steps and not self._stopping:
            self.step += 1
            hook = getattr(self.ctx.reporter, "on_phase", None)  # a reporter written before the hook lacks it
            self.timer = PhaseTimer(started, on_phase=partial(hook, self.step) if hook else None)
            yield self.step, self.timer
            started = self.timer.stopped if back_to_back else None

    def validation_if_due(self, step: int) -> dict:
        """The validation metrics of this step when `val_period` (or the last step) asks for them, else none."""
        if self.validates and should_validate(step, self.section.val_period, self.max_steps):
            return self._validation(step, self.timer)
        return {}

    def end_step(self, metrics: dict, *, rollouts: Callable[[], list[dict]] | None = None,
                 position: DataPosition | None = None) -> None:
        """Stop the step's clock, write the step's rollouts (`rollouts()`, called when `logger.log_rollouts`) and
        metrics row (with the timer's `timing/*` keys), then checkpoint when due. `position`: where the data
        stream stands after this step's rows (default: the stream's own position).

        The checkpoint is timed by the step's timer too, but after the row is written (a crash while checkpointing
        then repeats the step instead of losing its row), so its seconds are the loop result's `checkpoint_s`."""
        step, ctx, timer = self.step, self.ctx, self.timer
        timer.stop()
        metrics = step_row(metrics, timer)
        self.masked.check(step, metrics)  # every sequence masked: a warning, and a stop when it persists
        if rollouts is not None and ctx.cfg.logger.log_rollouts:
            ctx.run.write_rollouts(step, rollouts())
        self.metrics_log.log(step, metrics)
        ctx.reporter.on_step(step, metrics)
        self.last_metrics = metrics
        with timer.phase("checkpoint"):
            self._stopping = self.checkpoints.end_step(step, self.max_steps, position or self.data.position)
        self.checkpoint_s += timer.seconds["checkpoint"]
        if self.logprob_guard is not None:  # after the step is logged and checkpointed: a stop loses nothing
            self.logprob_guard.check(step, metrics)

    def finish(self) -> dict:
        """Export the final model when the run is complete, close the log; the loop's result."""
        return {**self.checkpoints.finish(self.cluster, self.step, self.max_steps, self.metrics_log, self.last_metrics),
                "checkpoint_s": self.checkpoint_s}


class Checkpointer:
    """Saves and restores the whole training state through the training workers (rank 0 writes)."""

    def __init__(self, ctx: RunContext, cluster):
        self.ctx = ctx
        self.handle = TrainerHandle(cluster)
        self.manager = ctx.run.checkpoints(ctx.cfg.checkpoint.keep)
        self.steps_run = 0  # steps taken by this process

    def resume(self, resume: bool) -> CheckpointState | None:
        """Restore the newest complete checkpoint (and rewind the logs to it), or start fresh."""
        if not resume:
            self.ctx.run.rewind(-1)
            return None
        run, say = self.ctx.run, self.ctx.reporter.on_message
        logged = sum(1 for r in run.read_metrics() if r.get("step", 0) > 0)
        skipped = unusable_checkpoints(run.checkpoints_dir)
        state = run.resume(self.handle, keep=self.ctx.cfg.checkpoint.keep)
        for path, why in skipped:
            if state is not None and int(path.name.split("_")[1]) > state.step:
                say(f"skipped {path.name}: {why}")
        if state is None and logged:
            say(f"no checkpoint in {run.checkpoints_dir}: starting again at step 1 ({logged} logged steps dropped)")
        return state

    retry_wait_s = 10.0  # before the one retry of a checkpoint the disk refused: time to free some space

    def save(self, step: int, position: DataPosition) -> Path:
        path = self.manager.save_retrying(step, self.handle, position, extra={"algorithm": self.ctx.cfg.algorithm},
                                          wait_s=self.retry_wait_s, say=self.ctx.reporter.on_message)
        self.ctx.reporter.on_checkpoint(step, path)
        return path

    def start(self, resume: bool, cluster) -> tuple[CheckpointState | None, int, RowStream]:
        """(the restored checkpoint or None, the step to continue from, the training rows' stream at its
        position); a restored policy's weights also go to the generation workers."""
        record_placement(self.ctx, cluster)
        if not self.ctx.cfg.checkpoint.enabled:
            self.ctx.reporter.on_message("checkpoints are off (checkpoint.enabled: false): a crash or a restart "
                                         "begins again at step 1")
        else:
            self.check_disk_room()
        restored = self.resume(resume)
        step = restored.step if restored else 0
        cfg = self.ctx.cfg
        data = RowStream(self.ctx.train_rows, seed=cfg.seed, shuffle=cfg.data.shuffle,
                         position=restored.data_position if restored else None)
        if restored and cluster.generators:
            cluster.refit(step)
        return restored, step, data

    def check_disk_room(self) -> None:
        """Warn now where the checkpoint disk cannot hold this run's checkpoints (their size from the trainers)."""
        size = self.handle.checkpoint_bytes()
        warning = size and disk_room_warning(self.manager.directory, size, self.ctx.cfg.checkpoint.keep)
        if warning:
            self.ctx.reporter.on_message(f"warning: {warning}")

    def end_step(self, step: int, max_steps: int, position: DataPosition) -> bool:
        """Count a finished step and checkpoint when due; True when this process should stop here
        (`checkpoint.steps_per_run`)."""
        self.steps_run += 1
        limit = self.ctx.cfg.checkpoint.steps_per_run
        stopping = limit is not None and self.steps_run >= limit
        if self.ctx.cfg.checkpoint.enabled and should_checkpoint(step, self.ctx.cfg.checkpoint.period, max_steps,
                                                                  stopping):
            self.save(step, position)
        return stopping

    def finish(self, cluster, step: int, max_steps: int, metrics_log, last_metrics: dict) -> dict:
        """Export the final model when the run is complete, close the log; the loop's result."""
        final_dir = cluster.export(self.ctx.run.path / FINAL_DIR) if step >= max_steps else None
        metrics_log.close()
        return {"step": step, "steps_run": self.steps_run, "max_steps": max_steps, "final_dir": final_dir,
                "last_metrics": last_metrics}


def should_validate(step: int, period: int, max_steps: int) -> bool:
    return period > 0 and (step % period == 0 or step == max_steps)


def should_checkpoint(step: int, period: int, max_steps: int, stopping: bool) -> bool:
    return stopping or step == max_steps or step % period == 0
