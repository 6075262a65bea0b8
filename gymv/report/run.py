"""What a report reads from a run directory, finished or still being written.

metrics.jsonl may end in a half-written line (skipped); any other bad line is skipped and noted with its line
number, the good rows all shown; rollout files are written atomically, so each one present is complete; a
file that cannot be read, or is missing, is noted, and the report goes on without it.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path


from gymv.errors import GymvError
from gymv.yaml_bounds import safe_load
from gymv.runs.metrics import read_metrics
from gymv.runs.rollout_log import SPLITS, read_rollouts, rollout_files

CONFIG_FILE = "config.yaml"  # gymv.runs.run_dir's names; importing it would load torch (checkpoints) for nothing
METRICS_FILE = "metrics.jsonl"


@dataclass
class RunData:
    path: Path
    config: dict = field(default_factory=dict)
    rows: list[dict] = field(default_factory=list)  # metrics.jsonl rows, in file order
    rollouts: list[tuple[str, int, dict]] = field(default_factory=list)  # (split, step, record)
    problems: list[str] = field(default_factory=list)  # files that could not be read

    @property
    def name(self) -> str:
        return str(self.config.get("name") or self.path.name)

    @property
    def last_step(self) -> int | None:
        steps = [r["step"] for r in self.rows if isinstance(r.get("step"), int)]
        return max(steps) if steps else None

    @property
    def max_steps(self) -> int | None:
        algo = str(self.config.get("algorithm", ""))
        section = self.config.get(algo.removeprefix("vlm_"), {})
        v = section.get("max_steps") if isinstance(section, dict) else None
        return v if isinstance(v, int) else None

    @property
    def finished(self) -> bool:
        return (self.path / "final").is_dir() or (self.max_steps is not None and self.last_step == self.max_steps)


def is_run_dir(path: Path) -> bool:
    return (path / CONFIG_FILE).is_file() or (path / METRICS_FILE).is_file() or (path / "rollouts").is_dir()


def read_run(path: str | os.PathLike) -> RunData:
    """Everything a report shows; a directory that holds no run is a GymvError."""
    path = Path(path)
    if not path.is_dir():
        raise GymvError("run directory not found", where=str(path), fix="pass a runs/<name> folder written by gymv train")
    if not is_run_dir(path):
        raise GymvError("not a gymv run directory (no config.yaml, metrics.jsonl or rollouts/)", where=str(path),
                        fix="pass a runs/<name> folder written by gymv train")
    run = RunData(path)
    cfg_path = path / CONFIG_FILE
    if cfg_path.is_file():
        try:
            run.config = safe_load(cfg_path.read_text(encoding="utf-8"), str(cfg_path)) or {}
        except GymvError as e:
            run.problems.append(e.one_line())
        except (OSError, UnicodeDecodeError) as e:
            run.problems.append(f"{cfg_path}: {e}")
        if not isinstance(run.config, dict):
            run.config = {}
    metrics = path / METRICS_FILE
    if metrics.is_file():
        skipped: list[tuple[int, str]] = []
        try:
            run.rows = read_metrics(metrics, skipped)
        except GymvError as e:
            run.problems.append(e.one_line())
        run.problems.extend(f"{metrics}:{n}: line skipped, the other lines are shown ({why})" for n, why in skipped)
    else:
        run.problems.append(f"{metrics}: not found, so no metric is plotted (no step has finished yet, or the "
                            "file was removed)")
    for split in SPLITS:
        for step, f in rollout_files(path, split):
            try:
                run.rollouts.extend((split, step, r) for r in read_rollouts(f))
            except GymvError as e:
                run.problems.append(e.one_line())
    return run


def run_signature(path: str | os.PathLike) -> tuple:
    """Changes whenever the run writes something a report shows (to rebuild a served report lazily)."""
    path = Path(path)
    parts = []
    for p in (path / CONFIG_FILE, path / METRICS_FILE, path / "final"):
        try:
            st = p.stat()
            parts.append((p.name, st.st_mtime_ns, st.st_size))
        except OSError:
            parts.append((p.name, None, None))
    d = path / "rollouts"
    try:
        parts.append(tuple(sorted((f.name, f.stat().st_mtime_ns) for f in d.iterdir() if f.suffix == ".jsonl")))
    except OSError:  # no rollouts yet, or a file removed while listing (a resume rewinding)
        parts.append(None)
    return tuple(parts)
