"""Teacher batches: the student's rows (tokens and the images of the same row) as a teacher scores them.

Three rules, each a bug elsewhere:
- **Row-aligned inputs.** A row is one unit: its token ids and its own images, in sequence order. Nothing
  ever pairs one row's tokens with another row's images, also not when rows with and without images share a
  batch.
- **Data-parallel padding.** A teacher with `data_parallel_size` D takes batches whose size is a multiple of
  D. Padding repeats whole rows (tokens and images together: pad row k copies row k mod n), and the scores of
  the padding rows are dropped after scoring, so the caller sees exactly one score row per real row.
- **Text-only teachers get text only.** A teacher without a vision tower is called with token ids, attention
  mask and positions, never with image keywords (not even empty ones); a row with images routed to such a
  teacher is an error naming the row (gymv.backends.teacher, which also scores the rows).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any


@dataclass
class TeacherRow:
    """One student sequence to score: its token ids and its images (PIL, in sequence order)."""

    input_ids: list[int]
    images: list[Any] = field(default_factory=list)
    where: str | None = None


def pad_rows(rows: Sequence[TeacherRow], multiple: int) -> tuple[list[TeacherRow], int]:
    """(rows padded to a multiple of `multiple` by repeating whole rows, number of real rows)."""
    if multiple < 1:
        raise ValueError(f"data_parallel_size must be at least 1, got {multiple}")
    rows = list(rows)
    n = len(rows)
    if n == 0:
        return [], 0
    missing = (-n) % multiple
    padded = rows + [rows[k % n] for k in range(missing)]
    return padded, n


def shard_rows(rows: Sequence[TeacherRow], parts: int) -> list[list[TeacherRow]]:
    """Contiguous equal shards (the rows must already be padded to a multiple of `parts`)."""
    if len(rows) % parts:
        raise RuntimeError(f"{len(rows)} rows do not split evenly over {parts} teacher replicas (pad_rows first)")
    size = len(rows) // parts
    return [list(rows[i * size:(i + 1) * size]) for i in range(parts)]


def trim(scores: Sequence, n_real: int) -> list:
    """Scores of the real rows only (padding rows come last)."""
    return list(scores[:n_real])
