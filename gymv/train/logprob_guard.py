"""Watch the agreement between the generator's logprobs and the trainer's over a run.

`train/token_mult_prob_error` is 1.0 when the generation engine samples from exactly the distribution the
trainer scores; NeMo RL gates its Omni nightly on its median staying below 1.05. A run whose median drifts
above that trains on samples whose importance ratios (or clipping) measure the engines' disagreement rather
than the policy's change. The guard looks at the median over the last `window_steps` steps after each step
and, above `max_median`, says so once (again only after the median came back), naming the causes this
recipe makes likely; with `stop` the run ends there, after the step was logged and checkpointed.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from statistics import median

from gymv.errors import GymvError

METRIC = "train/token_mult_prob_error"


def likely_causes(cfg, section) -> list[str]:
    """What in this recipe can make generation and training disagree, most likely first."""
    causes = []
    if section.async_.enabled:
        causes.append(f"asynchronous generation: samples up to {section.async_.max_trajectory_age_steps} steps "
                      "older than the trainer's weights (the metric measures that lag too)")
    causes.append("a refit the engine did not fully load (refit.check.every: 1 checks every refit)")
    g, t = cfg.generation, cfg.training
    if cfg.model.dtype in ("bfloat16", "float16") or (cfg.model.dtype == "auto" and cfg.cluster.gpus_per_node > 0):
        causes.append("a 16-bit generation engine against the trainer's float32 master weights")
    if g.backend != "hf":
        causes.append(f"{g.backend}'s kernels against the trainer's (a different attention, norm or MoE routing)")
    if t.backend != "torch":
        causes.append(f"the {t.backend} trainer's sharded or parallel numerics")
    if not g.reset_encoder_cache_after_weight_update:
        causes.append("image features cached from older weights "
                      "(generation.reset_encoder_cache_after_weight_update: true)")
    return causes


class LogprobErrorGuard:
    def __init__(self, max_median: float | None, window_steps: int, stop: bool, causes: list[str],
                 key: str, say: Callable[[str], None]):
        self.max_median, self.stop, self.causes, self.key, self.say = max_median, stop, causes, key, say
        self._window: deque[tuple[int, float]] = deque(maxlen=window_steps)
        self._warned = False

    @classmethod
    def for_run(cls, cfg, section, key: str, say: Callable[[str], None]) -> LogprobErrorGuard | None:
        """The guard of an algorithm section that has one (`key`: its name, e.g. grpo), else None."""
        guard = getattr(section, "logprob_error_guard", None)
        if guard is None or guard.max_median is None:
            return None
        return cls(guard.max_median, guard.window_steps, guard.stop, likely_causes(cfg, section),
                   f"{key}.logprob_error_guard", say)

    def check(self, step: int, metrics: dict) -> None:
        value = metrics.get(METRIC)
        if value is None:
            return
        self._window.append((step, float(value)))
        if len(self._window) < self._window.maxlen:
            return
        mid = median(v for _, v in self._window)
        if mid <= self.max_median:
            self._warned = False
            return
        first = self._window[0][0]
        shown = f"{mid:.4f}" if round(mid, 4) > self.max_median else f"{mid:.10f}".rstrip("0")
        said = (f"the median {METRIC} of steps {first}-{step} is {shown}, above {self.max_median:g} "
                f"({self.key}.max_median): the generator's logprobs disagree with the trainer's; likely causes: "
                + "; ".join(self.causes))
        if self.stop:
            raise GymvError(said, where=f"{self.key}.max_median", exit_code=1,
                            fix=f"remove the cause, then resume with --resume; or set {self.key}.stop: false to "
                                "train on with a warning")
        if not self._warned:
            self._warned = True
            self.say(f"warning: {said}")
