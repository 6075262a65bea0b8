"""Tiny checkpoints built once per test process (a few seconds), shared by the model and generation tests."""

from __future__ import annotations

import atexit
import shutil
import tempfile
from functools import lru_cache
from pathlib import Path

_ROOT = Path(tempfile.mkdtemp(prefix="gymv-tiny-"))
atexit.register(shutil.rmtree, _ROOT, ignore_errors=True)


@lru_cache(maxsize=None)
def tiny_path(arch: str) -> Path:
    from gymv.models.tiny import init_tiny

    return init_tiny(arch, _ROOT / arch)


@lru_cache(maxsize=None)
def shared_policy(arch: str):
    """A loaded policy for read-only tests; tests that change weights call fresh_policy."""
    return fresh_policy(arch)


def fresh_policy(arch: str):
    from gymv.backends.policy import load_policy

    return load_policy(tiny_path(arch))


def chat_ids(policy, text: str, images) -> list[int]:
    """Prompt ids for a user turn with the images first, rendered by the checkpoint's own chat template."""
    content = [{"type": "image"} for _ in images] + [{"type": "text", "text": text}]
    rendered = policy.tokenizer.apply_chat_template([{"role": "user", "content": content}], tokenize=False,
                                                    add_generation_prompt=True, chat_template=policy.chat_template)
    return policy.adapter.encode_text(rendered, images)


def solid(color, size=(64, 48)):
    from PIL import Image

    return Image.new("RGB", size, color)


def noise(seed: int, size=(80, 60)):
    import numpy as np
    from PIL import Image

    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 255, (size[1], size[0], 3), dtype=np.uint8))
