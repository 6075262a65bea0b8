"""Random draws built only on `random.Random.random()`.

Python guarantees that `random()` gives the same sequence for the same seed across versions, but not
`randint`, `choice` or `sample`; building every draw on `random()` keeps generated datasets identical
across Python upgrades.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from typing import TypeVar

T = TypeVar("T")


def randint(rng: random.Random, lo: int, hi: int) -> int:
    """Uniform integer in [lo, hi], both ends included."""
    if hi < lo:
        raise ValueError(f"empty range [{lo}, {hi}]")
    return lo + min(int(rng.random() * (hi - lo + 1)), hi - lo)


def choice(rng: random.Random, items: Sequence[T]) -> T:
    return items[randint(rng, 0, len(items) - 1)]


def sample(rng: random.Random, items: Sequence[T], k: int) -> list[T]:
    """k distinct items in random order (a partial Fisher-Yates shuffle)."""
    pool = list(items)
    if not 0 <= k <= len(pool):
        raise ValueError(f"cannot sample {k} of {len(pool)} items")
    for i in range(k):
        j = randint(rng, i, len(pool) - 1)
        pool[i], pool[j] = pool[j], pool[i]
    return pool[:k]
