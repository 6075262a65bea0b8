"""Stop a run whose rollouts keep failing, instead of "training" on nothing and reporting success.

A failed trajectory (an environment server down or stalled, a crashing tool) is left out of training. A
few are noise; many mean the step trains on little or nothing while steps, data position and LR schedule
advance. The guard runs after a step's rollouts and before its optimizer step, so the step that trips it
is neither trained nor checkpointed: the run stops with its newest complete checkpoint intact, and a
resume redoes that step. Two thresholds (env.max_failed_fraction per step, and
env.max_failed_fraction_window over the last env.failed_window_steps steps) catch a dead server at once
and a flaky one over time.
"""

from __future__ import annotations

from collections import Counter, deque
from collections.abc import Callable, Sequence
from typing import Any

from gymv.errors import GymvError


def _cause(failed: Sequence[Any]) -> tuple[str, int, Any]:
    """The most common failure message, how many trajectories share it, and the first such trajectory."""
    counts = Counter(t.error for t in failed)
    message, n = counts.most_common(1)[0]
    return message, n, next(t for t in failed if t.error == message)


class FailureGuard:
    """`warn` hears of every failure below the thresholds: a prompt left out of training is never silent."""

    def __init__(self, max_step_fraction: float = 0.5, window_steps: int = 10, max_window_fraction: float = 0.25,
                 source: str | None = None, warn: Callable[[str], None] | None = None):
        self.max_step_fraction, self.max_window_fraction = max_step_fraction, max_window_fraction
        self.source, self.warn = source, warn
        self._window: deque[tuple[int, int]] = deque(maxlen=max(1, window_steps))

    @classmethod
    def from_config(cls, cfg, source: str | None = None, warn: Callable[[str], None] | None = None) -> FailureGuard:
        env = cfg.env
        return cls(env.max_failed_fraction, env.failed_window_steps, env.max_failed_fraction_window, source, warn)

    def _where(self, t: Any) -> str:
        row = f"{self.source} line {t.task_index + 1}" if self.source else f"row {t.task_index}"
        return f"{row} sample {t.sample_index}"

    def check(self, step: int, trajectories: Sequence[Any], *, what: str = "step") -> None:
        """Raise when this batch, or the window ending with it, failed more than allowed."""
        failed = [t for t in trajectories if t.error is not None]
        total = len(trajectories)
        if what == "step":
            self._window.append((len(failed), total))
        if not total:
            raise GymvError(f"{what} {step} produced no rollouts at all", where="rollouts",
                            fix="check data.train and the generation workers' log")
        if failed and len(failed) / total > self.max_step_fraction:
            self._stop(f"{len(failed)} of {total} rollouts of {what} {step} failed", failed,
                       "env.max_failed_fraction", self.max_step_fraction)
        if what == "step" and len(self._window) == self._window.maxlen:
            n_failed, n_total = (sum(x) for x in zip(*self._window))
            if n_failed and n_failed / max(n_total, 1) > self.max_window_fraction:
                summary = f"{n_failed} of {n_total} rollouts of the last {len(self._window)} steps (to step {step}) failed"
                self._stop(summary, failed, "env.max_failed_fraction_window", self.max_window_fraction)
        if failed and self.warn is not None:
            message, n, first = _cause(failed)
            self.warn(f"warning: {len(failed)} of {total} rollouts of {what} {step} failed and are left out of "
                      f"training (failed_fraction); {n} of them: {message} (first at {self._where(first)})")

    def _stop(self, summary: str, failed: Sequence[Any], key: str, limit: float) -> None:
        if failed:
            message, n, first = _cause(failed)
            cause = f"; {n} of them: {message} (first at {self._where(first)})"
        else:
            cause = ""
        raise GymvError(f"{summary}, over {key} {limit:g}{cause}; this step was not trained", where="rollouts",
                        fix=f"fix the cause named above (a server down, a prompt over model.max_seq_len, ...), then "
                            f"resume with --resume; or raise {key} to accept more failures", exit_code=1)
