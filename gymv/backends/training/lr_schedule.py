"""The learning rate of optimizer step k (1-based): a linear warm-up, then constant or a decay to a floor.

A constant rate keeps moving a policy that is already good: on-policy distillation and GRPO runs that
reached their best held-out accuracy mid-run then drifted off it. A decay to `min_ratio` x lr by the last
step lets a run end where it converged.
"""

from __future__ import annotations

import math
from typing import Literal

Schedule = Literal["constant", "linear", "cosine"]
SCHEDULES = ("constant", "linear", "cosine")


def lr_factor(step: int, *, warmup_steps: int = 0, total_steps: int = 0, schedule: Schedule = "constant",
              min_ratio: float = 0.0, warmup_init_ratio: float = 0.0) -> float:
    """Multiplier of the base learning rate at optimizer step `step` (1-based). The warm-up rises linearly
    from `warmup_init_ratio` (Megatron's lr_warmup_init / lr) to 1 over `warmup_steps`."""
    if warmup_steps > 0:
        warm = warmup_init_ratio + (1.0 - warmup_init_ratio) * min(1.0, step / warmup_steps)
    else:
        warm = 1.0
    if schedule == "constant" or total_steps <= warmup_steps + 1:
        return warm
    p = min(1.0, max(0.0, (step - 1 - warmup_steps) / (total_steps - 1 - warmup_steps)))  # 0 first, 1 last
    if schedule == "linear":
        decay = 1.0 - p
    elif schedule == "cosine":
        decay = 0.5 * (1.0 + math.cos(math.pi * p))
    else:
        raise ValueError(f"unknown learning-rate schedule {schedule!r}; use one of {', '.join(SCHEDULES)}")
    return warm * (min_ratio + (1.0 - min_ratio) * decay)
