"""Build a report folder from a run directory: plots/, images/, data.js and index.html (written last).

The folder is self-contained: copy it anywhere, open index.html from disk, no network needed. Building
again over the same folder refreshes it (a run in progress shows what it has logged so far).
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from pathlib import Path

from gymv.io import atomic_write_text
from gymv.report.page import render_data, render_index
from gymv.report.plots import Plot, write_plots
from gymv.report.run import RunData, read_run
from gymv.report.viewer import rollout_views

LATEST = ("train/reward_mean", "train/accuracy", "val/reward_mean", "val/accuracy", "train/loss", "train/kl_ref",
          "train/entropy", "train/token_mult_prob_error", "train/grad_norm", "timing/step_s")


@dataclass(frozen=True)
class ReportResult:
    out_dir: Path
    index: Path
    plots: tuple[Plot, ...]
    rollouts: int
    images: int
    last_step: int | None
    finished: bool
    checks: tuple  # CheckResult of the run's recipe checks
    problems: tuple[str, ...]

    def to_dict(self) -> dict:
        return {"out_dir": str(self.out_dir), "index": str(self.index), "plots": [p.file for p in self.plots],
                "rollouts": self.rollouts, "images": self.images, "last_step": self.last_step,
                "finished": self.finished, "checks": [c.to_dict() for c in self.checks], "problems": list(self.problems)}


def default_out_dir(run_dir: str | os.PathLike) -> Path:
    return Path(run_dir) / "report"


def _latest(run: RunData) -> list[tuple[str, object]]:
    last: dict[str, tuple[int, object]] = {}
    for r in run.rows:
        for k in LATEST:
            v = r.get(k)
            if isinstance(v, (int, float)) and not isinstance(v, bool):
                last[k] = (r.get("step"), v)
    return [(f"{k} (step {last[k][0]})", last[k][1]) for k in LATEST if k in last]


def _checks(run: RunData) -> list:
    from gymv.checks import MetricSeries, evaluate_checks

    texts = [c for c in run.config.get("checks") or [] if isinstance(c, str)]
    return evaluate_checks(texts, MetricSeries(run.rows)) if texts else []


def build_report(run_dir: str | os.PathLike, out_dir: str | os.PathLike | None = None) -> ReportResult:
    """Write the report of `run_dir` into `out_dir` (default: RUN_DIR/report); returns what it holds."""
    run = read_run(run_dir)
    out = Path(out_dir) if out_dir is not None else default_out_dir(run_dir)
    out.mkdir(parents=True, exist_ok=True)
    plots = write_plots(run.rows, out)
    views, images = rollout_views(run.rollouts, out)
    checks = _checks(run)
    step = run.last_step
    status = "finished" if run.finished else "in progress"
    progress = f"step {step if step is not None else '—'}" + (f" of {run.max_steps}" if run.max_steps else "")
    meta = [str(run.config.get("algorithm") or "unknown algorithm"), str((run.config.get("model") or {}).get("path") or ""),
            f"{progress} ({status})", f"{len(views)} rollouts", f"generated {time.strftime('%Y-%m-%d %H:%M:%S')}"]
    meta = [m for m in meta if m]
    atomic_write_text(out / "data.js", render_data({"run": run.name, "rollouts": views}))
    index = out / "index.html"
    atomic_write_text(index, render_index(title=run.name, meta=meta, plots=plots, checks=checks, latest=_latest(run),
                                          problems=run.problems, n_rollouts=len(views)))
    return ReportResult(out, index, tuple(plots), len(views), len(images.written), step, run.finished, tuple(checks),
                        tuple(run.problems))
