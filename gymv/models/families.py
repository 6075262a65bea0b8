"""Which tiny stand-in plays a real checkpoint's model family (`gymv smoke --tiny`, docs/models.md).

A smoke run on a laptop replaces a recipe's hub model by the embedded tiny model of the same family, so the
family's processor style, chat tokens and loading path are what the smoke run exercises. Matched on the
model path's name, first pattern wins; unknown names keep the historical default (tiny LLaVA for VLM
recipes, tiny Qwen3 for text ones).
"""

from __future__ import annotations

import re

from gymv.models.tiny import TEXT_ONLY_ARCHES

# (pattern on the lower-cased path, tiny arch)
STAND_INS: tuple[tuple[str, str], ...] = (
    (r"qwen3[-_]?vl", "tiny-qwen3vl"),
    (r"qwen2\.?5[-_]?vl", "tiny-qwen2_5vl"),
    (r"qwen2[-_]?vl", "tiny-qwen2vl"),
    (r"llava[-_]?onevision", "tiny-llava-onevision"),
    (r"llava[-_]?(next|v1\.6)", "tiny-llava-next"),
    (r"smolvlm|idefics3", "tiny-smolvlm"),
    (r"gemma[-_]?3[-_]?(4|12|27)b", "tiny-gemma3"),
    (r"nemotron.*omni", "tiny-nemotron-omni"),
    (r"llava", "tiny-llava"),
    (r"llama", "tiny-llama"),
    (r"qwen", "tiny-qwen3"),
)
DEFAULT_VLM = "tiny-llava"
DEFAULT_TEXT = "tiny-qwen3"


def tiny_stand_in(path: str, *, vlm: bool) -> str:
    """The embedded tiny model (`embedded:<arch>`) standing in for `path` in a recipe of that kind.

    A text recipe never gets a vision-language stand-in, nor a VLM recipe a text-only one."""
    name = str(path).lower()
    for pattern, arch in STAND_INS:
        if re.search(pattern, name) and (arch in TEXT_ONLY_ARCHES) != vlm:
            return f"embedded:{arch}"
    return f"embedded:{DEFAULT_VLM if vlm else DEFAULT_TEXT}"
