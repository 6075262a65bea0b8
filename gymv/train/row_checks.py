"""Data rows checked on the driver before any worker starts: prompt images and prompt length.

A row the workers cannot use would otherwise surface 30-60 s later (after Ray and the models start), or
worse, be counted as an environment failure and silently left out. Each check names the file and line.

- a prompt holds at most `vision.max_images_per_sample` images;
- every prompt image is an image data URL (no http://, file://, text/html, non-string image_url) that
  decodes within the recipe's pixel limit;
- the prompt's text alone, tokenized with the model's tokenizer, leaves room to generate within
  `model.max_seq_len` (image tokens only add to it). Text far over any tokenizer's ratio is refused from
  its byte length, before tokenizing it, so that a huge prompt cannot stall the check itself.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from gymv.data.images import DEFAULT_MAX_PIXELS, ImageError
from gymv.envs.protocol import Image, RowError, Text
from gymv.envs.rows import check_images, input_messages
from gymv.errors import GymvError
from gymv.models.quiet import quiet_transformers

MAX_BYTES_PER_TOKEN = 256  # no tokenizer averages more bytes per token over a whole prompt


def prompt_text(row: dict, *, where: str | None = None) -> str:
    return "\n".join(p.text for m in input_messages(row, where=where) for p in m.content if isinstance(p, Text))


def check_prompt_images(rows: Sequence[Any], *, max_pixels: int | None = None) -> None:
    for r in rows:
        try:
            check_images(r.data, where=r.where, max_pixels=max_pixels or DEFAULT_MAX_PIXELS)
        except ImageError as e:
            raise RowError(e.message, where=e.where or r.where, fix=e.fix) from None


def check_prompt_image_counts(rows: Sequence[Any], max_images: int) -> None:
    """The agent loop fails a prompt with more images than vision.max_images_per_sample in every step it is
    drawn: refused here instead, once, naming the row."""
    for r in rows:
        try:
            n = sum(isinstance(p, Image) for m in input_messages(r.data, where=r.where) for p in m.content)
        except ImageError as e:
            raise RowError(e.message, where=e.where or r.where, fix=e.fix) from None
        if n > max_images:
            raise RowError(f"the prompt has {n} images, over vision.max_images_per_sample {max_images}: every "
                           "rollout of it would fail", where=r.where,
                           fix="drop the row or some of its images, or raise vision.max_images_per_sample")


def check_prompt_lengths(rows: Sequence[Any], tokenizer, max_seq_len: int) -> None:
    """Each distinct prompt text is tokenized once: generated rows share a few templates (the quickstart's 4496
    rows hold 8 texts), and tokenizing every row took 0.2 s of each launch."""
    lengths: dict[str, int] = {}
    for r in rows:
        text = prompt_text(r.data, where=r.where)
        size = len(text.encode("utf-8"))
        if size > MAX_BYTES_PER_TOKEN * max_seq_len:
            raise RowError(f"the prompt's text is {size} bytes, far over model.max_seq_len {max_seq_len} tokens",
                           where=r.where, fix="shorten the prompt or drop the row")
        n = lengths.get(text)
        if n is None:
            n = lengths[text] = len(tokenizer(text, add_special_tokens=False)["input_ids"])
        if n >= max_seq_len:
            raise RowError(f"the prompt's text alone is {n} tokens, leaving no room to generate within "
                           f"model.max_seq_len {max_seq_len}", where=r.where,
                           fix="raise model.max_seq_len, or shorten or drop the row")


def check_training_rows(rows: Sequence[Any], *, model_path: str, max_seq_len: int,
                        max_pixels: int | None = None, max_images: int | None = None) -> None:
    """Every row's prompt images (count and pixels) and length, with the limits the rollouts apply; the first
    bad row raises a RowError naming it."""
    if not rows:
        return
    if max_images is not None:
        check_prompt_image_counts(rows, max_images)
    check_prompt_images(rows, max_pixels=max_pixels)
    from transformers import AutoTokenizer

    try:
        with quiet_transformers():
            tokenizer = AutoTokenizer.from_pretrained(model_path)
    except (OSError, ValueError) as e:
        raise GymvError(f"cannot load the model's tokenizer: {e}", where=model_path,
                        fix="point model.path at a folder holding a tokenizer") from None
    check_prompt_lengths(rows, tokenizer, max_seq_len)
