"""Weights & Biases: one W&B run per gymv run directory, resumed under the same id when the run resumes.

The mode follows W&B's own settings (WANDB_MODE=offline writes RUN_DIR/wandb/offline-run-* for a later
`wandb sync`); the project is `logger.wandb_project` (default gymv), the run name the recipe's `name`.
"""

from __future__ import annotations

import uuid
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from gymv.errors import GymvError
from gymv.io import atomic_write_text
from gymv.loggers.base import MetricsLogger, numeric

ID_FILE = "wandb_id"


def run_id(run_dir: Path) -> str:
    """The W&B run id of this run directory: made once, then read back, so a resume continues the same W&B run."""
    path = run_dir / ID_FILE
    if path.is_file():
        text = path.read_text(encoding="utf-8").strip()
        if text:
            return text
    new = uuid.uuid4().hex[:16]
    atomic_write_text(path, new + "\n")
    return new


class WandbLogger(MetricsLogger):
    name = "wandb"

    @classmethod
    def check(cls, cfg: Any) -> None:
        try:
            import wandb  # noqa: F401
        except ImportError:
            raise GymvError("logger.wandb needs the wandb package, which is not installed", where="logger.wandb",
                            fix="pip install wandb (or pip install 'gymv[loggers]'), or set logger.wandb: false") from None

    def __init__(self, run_dir: Path, config: Mapping[str, Any], cfg: Any) -> None:
        super().__init__(run_dir, config, cfg)
        import wandb

        self.run = wandb.init(project=cfg.logger.wandb_project or "gymv", name=cfg.name, id=run_id(self.run_dir),
                              resume="allow", dir=str(self.run_dir), config=dict(config))

    def log(self, step: int, metrics: Mapping[str, Any]) -> None:
        self.run.log(numeric(metrics), step=int(step))

    def close(self) -> None:
        if self.run is not None:
            self.run.finish()
            self.run = None
