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
  teacher is an error naming the row.

Scores follow the logprob convention of the trainer (docs/algorithms.md §1): `[T]` per row, aligned with the
row's tokens, column 0 and vision-token targets 0, the sampling temperature applied, the student's vision
special tokens removed from the distribution (the student can never sample them, so both distributions
share one support).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from gymv.errors import GymvError


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


class TextOnlyAdapter:
    """The adapter a text-only teacher scores with: the same logprob path as a VLM, with no images allowed.

    `vision_token_ids` are the student's, so the teacher's distribution is renormalised over the tokens the
    student can sample.
    """

    style = "text"
    image_token_id = None

    def __init__(self, vision_token_ids: Sequence[int] = (), alias: str = "teacher"):
        self.vision_token_ids = tuple(vision_token_ids)
        self.alias = alias

    def check_batch(self, rows, images: Sequence[Sequence], where=None, attention_mask=None) -> None:
        for b, imgs in enumerate(images):
            if imgs:
                row = (where[b] if where else None) or f"batch row {b}"
                raise GymvError(f"teacher {self.alias!r} is text-only but {row} has {len(imgs)} image(s)",
                                where=row, fix="route rows with images to a vision-language teacher in "
                                               "mopd.agent_to_teacher")

    def position_ids(self, model, input_ids, attention_mask, image_grid_thw=None):
        return (attention_mask.long().cumsum(-1) - 1).clamp(min=0)


def teacher_logprobs(model, adapter, rows: Sequence[TeacherRow], *, pad_id: int, temperature: float = 1.0,
                     forbidden_ids: Sequence[int] | None = None, max_tokens: int = 8192, top_k: int = 0) -> list:
    """Per-row teacher logprobs `[len(row)]` (float32, CPU), in row order; no gradients.

    With `top_k` > 0 each row's entry is a dict: `logp` [len], and the teacher's k most likely tokens at
    every position with their logprobs, `topk_ids` [len, k] and `topk_logp` [len, k] (top-k distillation).
    Rows are packed into micro-batches by padded token count (`max_tokens`); each micro-batch is one
    right-padded batch of whole rows, so images always travel with their row.
    """
    from gymv.backends.logprobs import right_pad, sequence_logprobs, sequence_topk
    from gymv.backends.training.micro_batches import plan_micro_batches

    out: list[torch.Tensor | None] = [None] * len(rows)
    plan = plan_micro_batches([len(r.input_ids) for r in rows], max_tokens)
    with torch.no_grad():
        for idx in plan:
            part = [rows[i] for i in idx]
            batch = right_pad([r.input_ids for r in part], [r.images for r in part], pad_id,
                              [r.where or f"teacher row {i}" for i, r in zip(idx, part)])
            if top_k > 0:
                lp, ids, top = sequence_topk(model, adapter, batch, top_k, temperature, forbidden_ids)
                for k, i in enumerate(idx):
                    n = len(rows[i].input_ids)
                    out[i] = {"logp": lp[k, :n].float().cpu(), "topk_ids": ids[k, :n].cpu(),
                              "topk_logp": top[k, :n].float().cpu()}
                continue
            lp = sequence_logprobs(model, adapter, batch, temperature, forbidden_ids)
            for k, i in enumerate(idx):
                out[i] = lp[k, :len(rows[i].input_ids)].float().cpu()
    return out  # type: ignore[return-value]
