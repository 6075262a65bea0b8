"""TensorBoard event files in RUN_DIR/tensorboard (`tensorboard --logdir runs/` shows every run)."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from gymv.errors import GymvError
from gymv.loggers.base import MetricsLogger, numeric

SUBDIR = "tensorboard"


class TensorBoardLogger(MetricsLogger):
    name = "tensorboard"

    @classmethod
    def check(cls, cfg: Any) -> None:
        try:
            import tensorboard  # noqa: F401  (torch.utils.tensorboard needs it)
        except ImportError:
            raise GymvError("logger.tensorboard needs the tensorboard package, which is not installed",
                            where="logger.tensorboard",
                            fix="pip install tensorboard (or pip install 'gymv[loggers]'), or set logger.tensorboard: false") from None

    def __init__(self, run_dir: Path, config: Mapping[str, Any], cfg: Any) -> None:
        super().__init__(run_dir, config, cfg)
        from torch.utils.tensorboard import SummaryWriter

        self._writer_cls = SummaryWriter
        self.writer = None
        self.log_dir = self.run_dir / SUBDIR

    def log(self, step: int, metrics: Mapping[str, Any]) -> None:
        if self.writer is None:
            # the first step this process logs: events of later steps left by an interrupted process are dropped,
            # as metrics.jsonl drops them on resume, so a resumed run shows each step once
            self.writer = self._writer_cls(log_dir=str(self.log_dir), purge_step=int(step))
        for key, value in numeric(metrics).items():
            self.writer.add_scalar(key, value, global_step=int(step))
        self.writer.flush()

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
            self.writer = None
