"""The logger interface and its registry (`LOGGERS`, a `gymv.registry.Registry`: name -> class, open to the
entry-point group `gymv.loggers`).

A third-party distribution declares, in its pyproject.toml::

    [project.entry-points."gymv.loggers"]
    mlflow = "my_package.log:MlflowLogger"

and a recipe turns it on with `logger.plugins: [mlflow]`. Built-ins are switched by their own keys
(`logger.tensorboard`, `logger.wandb`).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from gymv.registry import Registry

GROUP = "gymv.loggers"

BUILTINS: dict[str, str] = {
    "tensorboard": "gymv.loggers.tensorboard:TensorBoardLogger",
    "wandb": "gymv.loggers.wandb:WandbLogger",
}
# a built-in is turned on by its own key (logger.<name>); a plugin's name is read from logger.plugins
LOGGERS = Registry("logger", GROUP, BUILTINS, where="logger.plugins")


class MetricsLogger:
    """One destination for step metrics. Made once per training process; `close` is always called."""

    name = "logger"

    def __init__(self, run_dir: Path, config: Mapping[str, Any], cfg: Any) -> None:
        """`config` is the resolved recipe as plain data (what config.yaml records); `cfg` the validated one."""
        self.run_dir = Path(run_dir)

    @classmethod
    def check(cls, cfg: Any) -> None:
        """Raise a GymvError when the logger cannot work (its library is missing), before anything is written."""

    def log(self, step: int, metrics: Mapping[str, float]) -> None:
        raise NotImplementedError

    def close(self) -> None: ...


def register_logger(name: str, cls: type) -> None:
    """Register a logger class in this process (tests, notebooks); `logger.plugins: [name]` turns it on."""
    LOGGERS.register(name, cls)


def available() -> dict[str, str]:
    """Every logger name and where it comes from ('builtin', 'registered' or the entry point's value)."""
    return LOGGERS.available()


def enabled_names(cfg: Any) -> list[str]:
    """The loggers a validated recipe turns on, in a stable order."""
    names = [n for n in LOGGERS.builtins if getattr(cfg.logger, n, False)]
    return names + [n for n in cfg.logger.plugins if n not in names]


def logger_classes(cfg: Any) -> list[type]:
    """The classes of the loggers a recipe turns on, each checked: a missing optional library is a one-line error
    that says how to install it. `gymv train` calls this before it writes anything."""
    classes = []
    for name in enabled_names(cfg):
        cls = LOGGERS.load(name)
        cls.check(cfg)
        classes.append(cls)
    return classes


def build_loggers(cfg: Any, config: Mapping[str, Any], run_dir: str | os.PathLike) -> list[MetricsLogger]:
    """Every logger the recipe turns on, ready to log."""
    out: list[MetricsLogger] = []
    try:
        for cls in logger_classes(cfg):
            out.append(cls(Path(run_dir), config, cfg))
    except BaseException:
        for logger in out:
            logger.close()
        raise
    return out


def numeric(metrics: Mapping[str, Any]) -> dict[str, float]:
    """The scalar metrics of a row (strings, lists and nulls are left to metrics.jsonl)."""
    return {k: float(v) for k, v in metrics.items()
            if isinstance(v, (int, float)) and not isinstance(v, bool) and k not in ("step", "wall_time")}
