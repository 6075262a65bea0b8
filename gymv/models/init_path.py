"""Where a run's policy starts: a Hugging Face folder, `embedded:<arch>`, or another gymv run's export or
checkpoint (read by `gymv train` for model.path and by MOPD teachers for their paths)."""

from __future__ import annotations

from pathlib import Path

from gymv.errors import GymvError
from gymv.models.hub import is_hub_id
from gymv.models.load import EMBEDDED_PREFIX, resolve_model_path
from gymv.runs.checkpoint import LATEST, find_latest

FINAL_DIR = "final"  # a finished run's Hugging Face export, under its run directory


def resolve_init_path(text: str, *, where: str | None = None) -> str:
    """The checkpoint folder a run starts from. Besides HF folders, hub ids (from the local cache) and
    `embedded:<arch>` it accepts
    another gymv run: `runs/<name>` (its `final/` export, else its newest checkpoint),
    `runs/<name>/checkpoints` (newest), `runs/<name>/checkpoints/latest` (the pointer) or `.../step_<N>`.
    """
    if text.startswith(EMBEDDED_PREFIX) or is_hub_id(text):
        try:
            return str(resolve_model_path(text))
        except GymvError as e:
            raise GymvError(e.message, where=where or "model.path", fix=e.fix) from None
    p = Path(text).expanduser()
    if p.is_file() and p.name == LATEST:
        p = p.parent / p.read_text().strip()
    elif p.is_dir() and not (p / "config.json").exists():
        final = p / FINAL_DIR
        if (final / "config.json").exists():
            p = final
        else:
            latest = find_latest(p)
            if latest is not None:
                p = latest
    try:
        return str(resolve_model_path(p).absolute())  # workers may run in another directory (a joined cluster)
    except GymvError as e:
        raise GymvError(f"{e.message}: {text}", where=where or "model.path",
                        fix="point model.path at a Hugging Face folder, a gymv run (runs/<name>, its final/ or "
                            "checkpoints/latest), or embedded:tiny-llava") from None
