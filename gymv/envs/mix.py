"""Mixed datasets: rows of several environments in one file, interleaved in a fixed, even order.

Part i of a mix holds exactly the rows `gymv prepare ENV_i --preset P_i --n N_i --split S --seed SEED` would
write (same row seeds, same bytes), so a mix inherits every guarantee of single-environment generation:
byte-identical output for the same arguments, and train and eval drawn from disjoint seed ranges. The
interleave is a pure function of the part sizes: each next row comes from the part that is most behind its
share, so a 200 + 200 mix alternates and a 300 + 100 mix places one row of the small part every four.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from gymv.data.generate import RowGenerator, row_seeds
from gymv.envs import get_env
from gymv.envs.knobs import resolve_knobs
from gymv.errors import GymvError
from gymv.io import atomic_open

SPEC_FORMAT = "ENV:N or ENV:PRESET:N"


@dataclass(frozen=True)
class MixPart:
    env: str
    preset: str
    n: int

    def __str__(self) -> str:
        return f"{self.env}:{self.preset}:{self.n}"


def parse_mix_spec(items: Sequence[str]) -> list[MixPart]:
    """Parts from `ENV:N` / `ENV:PRESET:N` items (each item may hold several, comma-separated)."""
    parts: list[MixPart] = []
    for item in items:
        for text in (s.strip() for s in item.split(",")):
            if not text:
                continue
            fields = text.split(":")
            if len(fields) not in (2, 3) or not all(fields):
                raise GymvError(f"mix part {text!r} is not {SPEC_FORMAT}", fix="e.g. circle-count:tiny:200 arithmetic:tiny:200")
            env, preset, count = (fields[0], "default", fields[1]) if len(fields) == 2 else fields
            try:
                n = int(count)
            except ValueError:
                raise GymvError(f"mix part {text!r}: row count {count!r} is not an integer", fix=f"write {SPEC_FORMAT}") from None
            if n < 1:
                raise GymvError(f"mix part {text!r}: the row count must be at least 1", fix=f"write {SPEC_FORMAT}")
            parts.append(MixPart(env, preset, n))
    if len(parts) < 2:
        raise GymvError(f"a mix needs at least two parts, got {len(parts)}", fix="e.g. gymv prepare mix circle-count:tiny:200 arithmetic:tiny:200 --out mixed.jsonl")
    seen: set[tuple[str, str]] = set()
    for p in parts:
        key = (p.env.replace("_", "-"), p.preset)
        if key in seen:
            raise GymvError(f"mix part {p} repeats {p.env}:{p.preset}; the two parts would hold the same rows",
                            fix="give each environment and preset once, with the total row count")
        seen.add(key)
    return parts


def interleave_order(counts: Sequence[int]) -> list[int]:
    """Part index of each output row: the part whose next row is most overdue (ties: the earlier part)."""
    taken = [0] * len(counts)
    order = []
    for _ in range(sum(counts)):
        best = min((i for i, n in enumerate(counts) if taken[i] < n), key=lambda i: ((taken[i] + 1) / counts[i], i))
        taken[best] += 1
        order.append(best)
    return order


@dataclass
class MixSummary:
    path: str
    split: str
    parts: list[tuple[str, str, int]]  # (env, preset, rows)
    rows: int
    bytes: int
    seconds: float


def write_mixed_dataset(path: str | os.PathLike, parts: Sequence[MixPart], *, split: str = "train", seed: int = 0,
                        workers: int | None = None, on_row: Callable[[], None] | None = None) -> MixSummary:
    """Generate every part (each as `gymv prepare` would) and write them interleaved, atomically;
    `on_row` is called once per generated row (progress)."""
    t0 = time.perf_counter()
    lines: list[list[str]] = []
    names: list[tuple[str, str, int]] = []
    for part in parts:
        env = get_env(part.env)
        knobs = resolve_knobs(env, part.preset)
        seeds = row_seeds(split, seed, part.n)
        made: list[str] = []
        with RowGenerator(env, knobs, seeds, workers=workers) as gen:
            for line in gen:
                made.append(line)
                if on_row is not None:
                    on_row()
        lines.append(made)
        names.append((env.name, part.preset, part.n))
    size = 0
    cursor = [0] * len(lines)
    with atomic_open(path, "w", encoding="utf-8") as f:
        for i in interleave_order([len(x) for x in lines]):
            line = lines[i][cursor[i]]
            cursor[i] += 1
            f.write(line)
            f.write("\n")
            size += len(line.encode("utf-8")) + 1
    return MixSummary(str(Path(path)), split, names, sum(len(x) for x in lines), size, time.perf_counter() - t0)
