"""The logger interface and its registry (name -> class, open to the entry-point group `gymv.loggers`).

A third-party distribution declares, in its pyproject.toml::

    [project.entry-points."gymv.loggers"]
    mlflow = "my_package.log:MlflowLogger"

and a recipe turns it on with `logger.plugins: [mlflow]`. Built-ins are switched by their own keys
(`logger.tensorboard`, `logger.wandb`).
"""

from __future__ import annotations

import importlib
import os
from collections.abc import Mapping
from importlib.metadata import entry_points
from pathlib import Path
from typing import Any

from gymv.errors import GymvError

GROUP = "gymv.loggers"

BUILTINS: dict[str, str] = {
    "tensorboard": "gymv.loggers.tensorboard:TensorBoardLogger",
    "wandb": "gymv.loggers.wandb:WandbLogger",
}
_registered: dict[str, type] = {}


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
    _registered[name] = cls


def available() -> dict[str, str]:
    """Every logger name and where it comes from ('builtin', 'registered' or the entry point's value)."""
    out = {name: "builtin" for name in BUILTINS}
    for name in _registered:
        out.setdefault(name, "registered")
    for ep in entry_points(group=GROUP):
        out.setdefault(ep.name, ep.value)
    return dict(sorted(out.items()))


def _load(name: str, where: str) -> type:
    if name in BUILTINS:
        module, _, attr = BUILTINS[name].partition(":")
        return getattr(importlib.import_module(module), attr)
    if name in _registered:
        return _registered[name]
    for ep in entry_points(group=GROUP):
        if ep.name == name:
            try:
                return ep.load()
            except Exception as e:  # a broken plugin is one line, never a traceback
                raise GymvError(f"logger plugin {name!r} ({ep.value}) failed to load: {type(e).__name__}: {e}",
                                where=where, fix="reinstall or fix the plugin distribution") from None
    raise GymvError(f"unknown logger {name!r}", where=where, fix=f"use one of: {', '.join(available())}")


def enabled_names(cfg: Any) -> list[str]:
    """The loggers a validated recipe turns on, in a stable order."""
    names = [n for n in BUILTINS if getattr(cfg.logger, n, False)]
    return names + [n for n in cfg.logger.plugins if n not in names]


def logger_classes(cfg: Any) -> list[type]:
    """The classes of the loggers a recipe turns on, each checked: a missing optional library is a one-line error
    that says how to install it. `gymv train` calls this before it writes anything."""
    classes = []
    for name in enabled_names(cfg):
        cls = _load(name, f"logger.{name}" if name in BUILTINS else "logger.plugins")
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
