"""Hub ids (`Qwen/Qwen2.5-VL-3B-Instruct`, optionally `@revision`) resolved offline through the local cache.

gymv never downloads weights: a cluster's workers must all read the same files, and a download racing on
many nodes is a failure mode of its own. The user downloads once (`hf download <id>`); gymv finds the
snapshot in the standard cache layout (`$HF_HUB_CACHE`, else `$HF_HOME/hub`, else
`$XDG_CACHE_HOME/huggingface/hub`, else `~/.cache/huggingface/hub`), read at call time so that a test or a
launcher can point it elsewhere.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

from gymv.errors import GymvError

_HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+(@[\w./-]+)?")


def hub_cache_dir() -> Path:
    if os.environ.get("HF_HUB_CACHE"):
        return Path(os.environ["HF_HUB_CACHE"]).expanduser()
    if os.environ.get("HF_HOME"):
        return Path(os.environ["HF_HOME"]).expanduser() / "hub"
    base = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache").expanduser()
    return base / "huggingface" / "hub"


def is_hub_id(text: str) -> bool:
    """`org/name[@revision]` where neither the path nor its first folder exists here (`runs/x` with a
    `runs/` folder is a missing run, not a hub id)."""
    if not _HUB_ID.fullmatch(text):
        return False
    return not Path(text).expanduser().exists() and not Path(text.split("/")[0]).is_dir()


def resolve_hub_id(text: str) -> Path:
    """The cached snapshot folder of a hub id; not cached -> one line that says how to download it."""
    from huggingface_hub import snapshot_download

    repo, _, revision = text.partition("@")
    cache = hub_cache_dir()
    try:
        folder = Path(snapshot_download(repo, revision=revision or None, cache_dir=str(cache), local_files_only=True))
    except Exception:  # not cached (or only partly): huggingface_hub raises one of several offline errors
        folder = None
    if folder is None or not (folder / "config.json").exists():
        rev = f" --revision {revision}" if revision else ""
        raise GymvError(f"{text} is neither a folder here nor in the local Hugging Face cache ({cache})",
                        where="model.path",
                        fix=f"download it first: `hf download {repo}{rev}` (or `huggingface-cli download {repo}{rev}`); "
                            "gymv reads $HF_HUB_CACHE or $HF_HOME/hub and never downloads")
    return folder
