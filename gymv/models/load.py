"""Where a model path points: a folder, a hub id from the local cache, or `embedded:<tiny-arch>`.

Loading the policy itself (weights, tokenizer, image processor and the backends' adapter) is
`gymv.backends.policy.load_policy`; this module only resolves paths, so models/ stays below backends/.

`embedded:tiny-llava` means "the tiny default, built here": it is built once per (arch, seed, builder
version) under a cache folder and reused, so every worker of a run sees the same weights without a hub.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from gymv.errors import GymvError
from gymv.models.hub import is_hub_id, resolve_hub_id
from gymv.models.tiny import ARCHES, BUILDER_VERSION, MARKER_FILE, init_tiny

EMBEDDED_PREFIX = "embedded:"


def default_cache_dir() -> Path:
    """`$GYMV_CACHE_DIR`, else `~/.cache/gymv` (`$XDG_CACHE_HOME/gymv` when that is set)."""
    if os.environ.get("GYMV_CACHE_DIR"):
        return Path(os.environ["GYMV_CACHE_DIR"])
    base = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return base / "gymv"


def resolve_model_path(path: str | os.PathLike, *, cache_dir: str | os.PathLike | None = None, seed: int = 0) -> Path:
    """Turn a model path into a checkpoint folder, building `embedded:<arch>` defaults on first use."""
    text = str(path)
    if text.startswith(EMBEDDED_PREFIX):
        arch = text[len(EMBEDDED_PREFIX):]
        if arch not in ARCHES:
            raise GymvError(f"unknown embedded model {text!r}", fix=f"use one of: {', '.join('embedded:' + a for a in ARCHES)}")
        root = Path(cache_dir) if cache_dir is not None else default_cache_dir()
        target = root / "models" / f"{arch}-seed{seed}-v{BUILDER_VERSION}"
        if not (target / MARKER_FILE).exists():
            init_tiny(arch, target, reuse=True, seed=seed)
        return target

    if is_hub_id(text):
        return resolve_hub_id(text)
    p = Path(text).expanduser()
    if not p.is_dir():
        raise GymvError("model folder not found", where=text,
                        fix="pass a Hugging Face checkpoint folder, a hub id in the local cache (org/name), "
                            "or embedded:<tiny arch> (e.g. embedded:tiny-qwen2_5vl)")
    if not (p / "config.json").exists():
        raise GymvError("not a Hugging Face checkpoint (no config.json)", where=text,
                        fix="point at the folder written by save_pretrained or `gymv model init`")
    return p


def checkpoint_dtype(path: str | os.PathLike) -> str | None:
    """The dtype a checkpoint's config says its weights are stored in (`dtype`, the older `torch_dtype`, or its
    text model's); None where the config says none or cannot be read."""
    try:
        config = json.loads((Path(path) / "config.json").read_text())
    except (OSError, ValueError):
        return None
    found = config.get("dtype") or config.get("torch_dtype") or (config.get("text_config") or {}).get("dtype")
    return found if isinstance(found, str) else None
