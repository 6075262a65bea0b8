"""The one judgement of "this run learned", shared by the learning tests (CPU, vLLM, NeMo Gym agents).

One validation of a tiny run swings 10-30 points between neighbouring checkpoints, so learning is judged on
smoothed measures: the train reward of the last `window` steps against the first `window`, and the mean of
the validations after the start against the start. A guard keeps a run whose last validation fell below
where it started from passing on an earlier lucky peak.
"""

from __future__ import annotations

from collections.abc import Sequence
from statistics import mean


def learning_failures(rewards: Sequence[float], validations: Sequence[float], *, window: int,
                      margin: float = 0.1, later_from: int = 1, val_margin: float | None = None) -> list[str]:
    """What in a run's train rewards (one per step) and validations (the first at step 0) says it did not
    learn; empty when it did. `later_from`: the first validation counted in the mean after the start;
    `val_margin`: the validations' margin where it differs from the train rewards' (`margin`)."""
    val_margin = margin if val_margin is None else val_margin
    out = []
    if len(rewards) < 2 * window:
        out.append(f"{len(rewards)} train rewards, fewer than two windows of {window}")
    else:
        first, last = mean(rewards[:window]), mean(rewards[-window:])
        if not last > first + margin:
            out.append(f"train reward {first:.3f} -> {last:.3f} (first and last {window} steps): not {margin} higher")
    if len(validations) <= later_from:
        out.append(f"{len(validations)} validations: need the start and validations from the {later_from + 1}th on")
    else:
        start, later = validations[0], mean(validations[later_from:])
        if not later > start + val_margin:
            out.append(f"validation {start:.3f} -> mean {later:.3f} from the {later_from + 1}th on: "
                       f"not {val_margin} higher")
        if validations[-1] < start:
            out.append(f"the last validation {validations[-1]:.3f} is below the start {start:.3f}")
    return out


def assert_learns(rewards: Sequence[float], validations: Sequence[float], *, window: int, margin: float = 0.1,
                  later_from: int = 1, val_margin: float | None = None) -> None:
    failures = learning_failures(rewards, validations, window=window, margin=margin, later_from=later_from,
                                 val_margin=val_margin)
    assert not failures, "; ".join(failures)
