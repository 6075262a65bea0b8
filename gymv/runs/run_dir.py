"""The run directory runs/<name>/: config.yaml, metrics.jsonl, rollouts/, checkpoints/.

Resuming restores the newest complete checkpoint and rewinds the logs to it: metric rows and rollout
files of later steps are dropped, because those steps run again. Nothing is lost and nothing repeated.
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import yaml

from gymv.errors import GymvError
from gymv.yaml_bounds import safe_load
from gymv.runs import config_history
from gymv.io import atomic_write_text
from gymv.runs.checkpoint import CheckpointManager, CheckpointState, Checkpointable, unusable_checkpoints
from gymv.runs.metrics import MetricsLog, read_metrics, truncate_metrics_after
from gymv.runs.rollout_log import SPLITS, rollout_files, write_rollouts

CONFIG_FILE = "config.yaml"
METRICS_FILE = "metrics.jsonl"
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._=+-]*$")


def run_path(root: str | os.PathLike, name: str) -> Path:
    """root/name, refusing names that would escape root or be awkward on a command line."""
    if not _NAME.match(name or "") or ".." in name:
        raise GymvError(f"invalid run name {name!r}", where="run name", fix="use letters, digits and . _ = + - (no slashes)")
    return Path(root) / name


class RunDir:
    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)
        self.loggers: list = []  # gymv.loggers the metrics log feeds (set by `gymv train`)
        self.changes: list = []  # what this launch changed in the config: (key, old, new)

    config_path = property(lambda self: self.path / CONFIG_FILE)
    metrics_path = property(lambda self: self.path / METRICS_FILE)
    rollouts_dir = property(lambda self: self.path / "rollouts")
    checkpoints_dir = property(lambda self: self.path / "checkpoints")

    @classmethod
    def create(cls, path: str | os.PathLike, config: Mapping[str, Any], *, resume: bool = False) -> RunDir:
        """Make the directory and write the resolved config.

        A directory that already holds a run is an error unless `resume`. Resuming never rewrites config.yaml:
        what differs from the run's current config (e.g. a larger max_steps) is appended to
        config_changes.jsonl and listed in `run.changes`.
        """
        run = cls(path)
        try:
            if not resume and run.path.exists() and any(run.path.iterdir()):
                raise GymvError("run directory already exists and is not empty", where=str(run.path),
                                fix="resume it (--resume) or choose another run name")
            run.path.mkdir(parents=True, exist_ok=True)
        except OSError as e:  # checkpoint.dir=/dev/null, a name too long, a read-only disk
            raise GymvError(f"cannot create the run directory: {e.strerror or e}", where=str(run.path),
                            fix="set checkpoint.dir to a writable folder (and keep the run name short)") from None
        if resume and run.metrics_path.exists():
            read_metrics(run.metrics_path)  # a broken line is refused now, before anything starts (resume rewinds it)
        if run.config_path.exists():
            run.changes = config_history.diff(run.read_config(), config)
            if run.changes:
                config_history.append_changes(run.path, run.changes)
        else:
            run.write_config(config)
        return run

    def write_config(self, config: Mapping[str, Any]) -> None:
        try:
            text = yaml.safe_dump(dict(config), sort_keys=False, allow_unicode=True)
        except yaml.YAMLError as e:
            raise GymvError(f"resolved config is not plain data: {e}", where=str(self.config_path), fix="pass dicts, lists, strings and numbers") from None
        atomic_write_text(self.config_path, text)

    def read_original_config(self) -> dict:
        """config.yaml: the config the run started with."""
        try:
            data = safe_load(self.config_path.read_text(encoding="utf-8"), str(self.config_path))
        except FileNotFoundError:
            raise GymvError("no config.yaml", where=str(self.path), fix="is this a gymv run directory?") from None
        return data or {}

    def read_config(self) -> dict:
        """The run's current config: config.yaml with the changes later launches recorded."""
        return config_history.apply_changes(self.read_original_config(), config_history.read_changes(self.path))

    def metrics_log(self) -> MetricsLog:
        return MetricsLog(self.metrics_path, sinks=self.loggers)

    def read_metrics(self) -> list[dict]:
        return read_metrics(self.metrics_path) if self.metrics_path.exists() else []

    def checkpoints(self, keep: int | None = None) -> CheckpointManager:
        return CheckpointManager(self.checkpoints_dir, keep=keep)

    def write_rollouts(self, step: int, records: Iterable[Mapping[str, Any]], split: str = "train") -> Path:
        return write_rollouts(self.path, step, records, split)

    def rewind(self, step: int) -> None:
        """Forget everything logged after `step` (metric rows, rollout files)."""
        truncate_metrics_after(self.metrics_path, step)
        for split in SPLITS:
            for s, f in rollout_files(self.path, split):
                if s > step:
                    f.unlink()

    def resume(self, trainer: Checkpointable, keep: int | None = None) -> CheckpointState | None:
        """Restore the newest complete checkpoint into `trainer` (and the RNGs) and rewind the logs to it.

        With no checkpoint folder at all every log row is dropped (a fresh start) and None is returned;
        checkpoint folders none of which is complete are an error that lists them (never a silent restart).
        """
        manager = self.checkpoints(keep)
        if manager.latest() is None:
            bad = unusable_checkpoints(self.checkpoints_dir)
            if bad:  # never restart over checkpoints that exist but do not read: that would replace them
                found = "; ".join(f"{p.name}: {why}" for p, why in bad[-3:])
                raise GymvError(f"no usable checkpoint to resume from ({found})", where=str(self.checkpoints_dir),
                                fix="restore the checkpoints from a copy, or move checkpoints/ away to start the "
                                    "run again at step 1")
        state = manager.restore(trainer)
        self.rewind(state.step if state else -1)
        return state
