"""A contact sheet of generated rows: each prompt image with its question and gold answer beneath.

Looking at a dozen samples catches most generator mistakes (circles cut off, a question naming an absent
color, an answer that does not match the picture) before hours of training do.
"""

from __future__ import annotations

import os
import textwrap
from typing import Any

from gymv.data.images import decode_data_url, encode_png
from gymv.envs.rows import input_messages, last_user_text
from gymv.io import atomic_write_bytes


def _font(size: int):
    from PIL import ImageFont

    try:
        return ImageFont.load_default(size=size)
    except TypeError:  # pragma: no cover - Pillow < 10.1
        return ImageFont.load_default()


def contact_sheet(env: Any, rows: list[dict], path: str | os.PathLike, *, tile: int = 224, columns: int = 4) -> int:
    """Write a PNG grid of the rows' first images, questions and gold answers; returns the tile count."""
    from PIL import Image, ImageDraw

    font = _font(12)
    line_h, text_lines = 14, 6
    cell_w, cell_h = tile + 16, tile + 16 + line_h * text_lines
    n = len(rows)
    cols = max(1, min(columns, n))
    nrows = max(1, -(-n // cols))
    sheet = Image.new("RGB", (cols * cell_w, nrows * cell_h), (245, 245, 245))
    draw = ImageDraw.Draw(sheet)
    for i, row in enumerate(rows):
        x0, y0 = (i % cols) * cell_w + 8, (i // cols) * cell_h + 8
        images = [img for msg in input_messages(row) for img in msg.images]
        if images:
            img = decode_data_url(images[0].url)
            scale = tile / max(img.size)
            resample = Image.NEAREST if scale >= 1 else Image.BILINEAR
            img = img.resize((max(1, round(img.width * scale)), max(1, round(img.height * scale))), resample)
            sheet.paste(img, (x0, y0))
            draw.rectangle([x0 - 1, y0 - 1, x0 + img.width, y0 + img.height], outline=(160, 160, 160))
            for call in env.gold_turn(row).tool_calls:  # mark a gold click on the picture
                _mark_click(draw, call.arguments, x0, y0, scale)
        try:
            answer = env.gold_answer(row)
        except Exception as e:  # a row without a gold answer still gets its tile
            answer = f"(no gold answer: {e})"
        text = f"#{i}  {last_user_text(row)}"
        lines = textwrap.wrap(text, width=max(10, tile // 7))[: text_lines - 1]
        lines.append(f"gold: {answer}"[: tile // 6])
        for k, line in enumerate(lines):
            fill = (0, 110, 0) if line.startswith("gold:") else (20, 20, 20)
            draw.text((x0, y0 + tile + 4 + k * line_h), line, fill=fill, font=font)
    atomic_write_bytes(path, encode_png(sheet))
    return n


def _mark_click(draw: Any, arguments: str, x0: int, y0: int, scale: float) -> None:
    import json

    try:
        args = json.loads(arguments)
        cx, cy = x0 + (args["x"] + 0.5) * scale, y0 + (args["y"] + 0.5) * scale
    except (ValueError, KeyError, TypeError):
        return
    draw.line([cx - 6, cy, cx + 6, cy], fill=(0, 0, 0), width=2)
    draw.line([cx, cy - 6, cx, cy + 6], fill=(0, 0, 0), width=2)
