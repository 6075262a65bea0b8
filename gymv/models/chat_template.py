"""The chat template shared by the tiny models; each architecture fills in its own image placeholder."""

from __future__ import annotations

from importlib.resources import files

MARKER = "@@IMAGE@@"
ASSISTANT_OPEN = "@@ASSISTANT_OPEN@@"

TEXT_ONLY = '{{ raise_exception("this model is text-only: it takes no image parts") }}'

# Reasoning on (the default) leaves the turn to the model, which opens it with `<think>`; off writes an empty
# `<think></think>` block after the assistant header, so the model answers at once. Set it per run with
# `generation.chat_template_kwargs: {enable_thinking: false}`.
REASONING_SWITCH = '{{ "<think></think>" if enable_thinking is defined and not enable_thinking else "" }}'


def chat_template(image_placeholder: str | None, *, reasoning_switch: bool = False) -> str:
    """The jinja template text with `image_placeholder` where an image part goes; None (a text-only model):
    an image part is a template error that says so. `reasoning_switch`: assistant turns read the
    `enable_thinking` variable (REASONING_SWITCH)."""
    text = (files("gymv.models") / "templates" / "chat.jinja").read_text(encoding="utf-8")
    text = text.replace(ASSISTANT_OPEN, REASONING_SWITCH if reasoning_switch else "")
    return text.replace(MARKER, image_placeholder if image_placeholder is not None else TEXT_ONLY)
