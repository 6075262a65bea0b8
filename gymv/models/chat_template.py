"""The chat template shared by the tiny models; each architecture fills in its own image placeholder."""

from __future__ import annotations

from importlib.resources import files

MARKER = "@@IMAGE@@"


TEXT_ONLY = '{{ raise_exception("this model is text-only: it takes no image parts") }}'


def chat_template(image_placeholder: str | None) -> str:
    """The jinja template text with `image_placeholder` where an image part goes; None (a text-only model):
    an image part is a template error that says so."""
    text = (files("gymv.models") / "templates" / "chat.jinja").read_text(encoding="utf-8")
    return text.replace(MARKER, image_placeholder if image_placeholder is not None else TEXT_ONLY)
