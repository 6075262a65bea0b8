"""Deterministic dataset generation on all cores.

Row i of a dataset is made by `env.make_row` from its own RNG, `random.Random(row_seed)`, where the row
seed is `split_base + seed + i`. Nothing else feeds a row, so the rows can be produced by any number of
worker processes and still form a byte-identical file. The seed space is cut into one range per split
(train: [0, 2**31), eval: [2**31, 2**32)), so train and eval rows never share a row seed; a `--seed` that
would run a split's rows out of its own range (into the other split's) is refused.
"""

from __future__ import annotations

import json
import multiprocessing
import os
import random
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gymv.errors import GymvError
from gymv.io import atomic_open

SPLITS = ("train", "eval")
SPLIT_SPAN = 2**31


def split_range(split: str) -> range:
    """All row seeds that belong to `split`."""
    if split not in SPLITS:
        raise GymvError(f"unknown split {split!r}", fix=f"use one of: {', '.join(SPLITS)}")
    base = SPLITS.index(split) * SPLIT_SPAN
    return range(base, base + SPLIT_SPAN)


def row_seeds(split: str, seed: int, n: int) -> range:
    """The row seeds of `n` rows of `split` starting at offset `seed` within the split's own range."""
    own = split_range(split)
    if n < 1:
        raise GymvError(f"--n must be at least 1, got {n}", fix="pass --n 1 or more")
    first, last = own.start + seed, own.start + seed + n - 1
    if first in own and last in own:
        return range(first, last + 1)
    others = [s for s in SPLITS if s != split and (first in split_range(s) or last in split_range(s))]
    if others:
        other = split_range(others[0])
        raise GymvError(
            f"{split} rows at seed {seed}..{seed + n - 1} would take row seeds {first}..{last}, which overlap the "
            f"{others[0]} split's range {other.start}..{other.stop - 1}",
            fix=f"use --seed 0 to {SPLIT_SPAN - n}; seeds count from the start of each split's own range")
    raise GymvError(f"{split} rows at seed {seed}..{seed + n - 1} fall outside the seed space",
                    fix=f"use a seed from 0 to {SPLIT_SPAN - n}")


def default_workers() -> int:
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # pragma: no cover - not Linux
        return max(1, os.cpu_count() or 1)


def make_line(env: Any, knobs: Any, row_seed: int, index: int) -> str:
    row = env.make_row(random.Random(row_seed), knobs, index)
    return json.dumps(row, ensure_ascii=False, separators=(",", ":"))


def _can_fork() -> bool:
    """Workers are forked, and only from a single-threaded process: forking beside running threads can copy
    a lock another thread holds, and spawned workers would re-run the caller's `__main__`. Otherwise rows
    are made in this process (the same file, only slower)."""
    return "fork" in multiprocessing.get_all_start_methods() and threading.active_count() == 1


def _make_chunk(job: tuple) -> list[str]:
    env, knobs, seeds, start = job
    return [make_line(env, knobs, s, start + k) for k, s in enumerate(seeds)]


class RowGenerator:
    """Yield JSON lines for the rows of `seeds`, in order, computed by `workers` processes.

    Use it as a context manager: the worker pool starts on entry, before any progress display starts a
    thread, so that workers can be forked safely; it is torn down on exit.
    """

    def __init__(self, env: Any, knobs: Any, seeds: range, *, workers: int | None = None, chunk: int | None = None):
        self.env, self.knobs, self.seeds = env, knobs, seeds
        self.workers = max(1, min(workers or default_workers(), len(seeds)))
        self.chunk = chunk or max(1, min(32, len(seeds) // (self.workers * 8) or 1))
        self._pool = None
        self._first: list[str] = []

    def __enter__(self) -> "RowGenerator":
        # The first row is made here, before forking: it imports what the environment needs (numpy, PIL)
        # once, instead of once per worker.
        self._first = _make_chunk((self.env, self.knobs, self.seeds[:1], 0))
        if self.workers > 1 and len(self.seeds) >= max(32, 4 * self.chunk) and _can_fork():
            self._pool = multiprocessing.get_context("fork").Pool(self.workers)
        return self

    @property
    def processes(self) -> int:
        """Worker processes actually making rows (1: this process)."""
        return self.workers if self._pool is not None else 1

    def __exit__(self, *exc: object) -> None:
        if self._pool is not None:
            self._pool.terminate()
            self._pool.join()
            self._pool = None

    def __iter__(self) -> Iterator[str]:
        yield from self._first
        jobs = ((self.env, self.knobs, self.seeds[i:i + self.chunk], i) for i in range(1, len(self.seeds), self.chunk))
        if self._pool is None:
            for job in jobs:
                yield from _make_chunk(job)
        else:
            for lines in self._pool.imap(_make_chunk, jobs):
                yield from lines


@dataclass
class DatasetSummary:
    path: str
    env: str
    split: str
    rows: int
    first_seed: int
    last_seed: int
    bytes: int
    seconds: float

    @property
    def rows_per_second(self) -> float:
        return self.rows / self.seconds if self.seconds > 0 else float("inf")


def write_dataset(
    path: str | os.PathLike,
    env: Any,
    knobs: Any,
    *,
    n: int,
    split: str = "train",
    seed: int = 0,
    workers: int | None = None,
    on_row: Callable[[str], None] | None = None,
    on_start: Callable[[], Any] | None = None,
) -> DatasetSummary:
    """Generate `n` rows and write them atomically to `path` (JSONL); `on_row` sees each line as written.

    `on_start` runs once the workers are up (start a progress display there, not before).
    """
    seeds = row_seeds(split, seed, n)
    t0 = time.perf_counter()
    size = 0
    with RowGenerator(env, knobs, seeds, workers=workers) as gen:
        if on_start is not None:
            on_start()
        with atomic_open(path, "w", encoding="utf-8") as f:
            for line in gen:
                f.write(line)
                f.write("\n")
                size += len(line.encode("utf-8")) + 1
                if on_row is not None:
                    on_row(line)
    return DatasetSummary(str(Path(path)), env.name, split, n, seed, seed + n - 1, size, time.perf_counter() - t0)
