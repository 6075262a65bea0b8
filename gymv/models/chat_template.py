"""The chat template shared by the tiny models; each architecture fills in its own image placeholder."""

from __future__ import annotations

from importlib.resources import files

MARKER = "@@IMAGE@@"


def chat_template(image_placeholder: str) -> str:
    """The jinja template text with `image_placeholder` where an image part goes."""
    text = (files("gymv.models") / "templates" / "chat.jinja").read_text(encoding="utf-8")
    return text.replace(MARKER, image_placeholder)
