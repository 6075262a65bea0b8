"""Build a report folder from a run directory: plots/, images/, data.js and index.html (written last).

The folder is self-contained: copy it anywhere, open index.html from disk, no network needed. Building
again over the same folder refreshes it (a run in progress shows what it has logged so far).
"""

from __future__ import annotations

import os
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from gymv.checks import MetricSeries, evaluate_checks
from gymv.errors import GymvError
from gymv.io import atomic_write_text
from gymv.report.page import render_data, render_index
from gymv.report.plots import DEFAULT_SMOOTHING, Plot, non_finite_values, write_plots
from gymv.report.run import RunData, read_run
from gymv.report.viewer import groups, rollout_views

LATEST = ("train/reward_mean", "train/accuracy", "val/reward_mean", "val/accuracy", "train/loss", "train/kl_ref",
          "train/kl_teacher", "train/teacher_advantage", "train/entropy", "train/token_mult_prob_error",
          "train/num_masked_seqs_by_logprob_error", "train/grad_norm", "timing/step_s")


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


def _distinct_names(runs: Sequence[RunData]) -> list[str]:
    """Run names for legends; two runs of one name are told apart by their folders."""
    for names in ([r.name for r in runs], [r.path.name for r in runs]):
        if len(set(names)) == len(names):
            return names
    return [str(r.path) for r in runs]


def _latest_compared(runs: Sequence[RunData]) -> list[tuple[str, list]]:
    """Each LATEST metric any run logged, with every run's last value (None where a run has none)."""
    last = [{k: v for r in run.rows for k, v in r.items() if k in LATEST and isinstance(v, (int, float))
             and not isinstance(v, bool)} for run in runs]
    return [(k, [d.get(k) for d in last]) for k in LATEST if any(k in d for d in last)]


def _checks(run: RunData) -> list:
    texts = [c for c in run.config.get("checks") or [] if isinstance(c, str)]
    return evaluate_checks(texts, MetricSeries(run.rows)) if texts else []


def _refuse_links_out(out: Path) -> None:
    """RUN_DIR/report and its folders are written into, never followed: a symbolic link there (in a run
    someone else wrote) would make the report write wherever it points."""
    for path in (out, out / "plots", out / "images"):
        if path.is_symlink():
            raise GymvError("is a symbolic link; the report is only written into the run's own folder", where=str(path),
                            fix="remove the link, or pass --out DIR to write the report elsewhere")


def build_report(run_dir: str | os.PathLike, out_dir: str | os.PathLike | None = None, *,
                 smoothing: float = DEFAULT_SMOOTHING, compare: Sequence[str | os.PathLike] = ()) -> ReportResult:
    """Write the report of `run_dir` into `out_dir` (default: RUN_DIR/report); returns what it holds.

    `compare`: other run directories whose metrics are drawn in the same plots and listed beside this run's
    latest values (the rollouts shown are this run's)."""
    if not 0.0 <= smoothing < 1.0:
        raise GymvError(f"smoothing {smoothing} is outside [0, 1)", where="--smoothing", fix="use 0 (none) to 0.99")
    run = read_run(run_dir)
    others = [read_run(p) for p in compare]
    names = _distinct_names([run, *others])
    out = Path(out_dir) if out_dir is not None else default_out_dir(run_dir)
    if out_dir is None:
        _refuse_links_out(out)
    out.mkdir(parents=True, exist_ok=True)
    plots = write_plots(run.rows, out, smoothing=smoothing, compare=[(n, o.rows) for n, o in zip(names[1:], others)],
                        name=names[0])
    views, images = rollout_views(run.rollouts, out)
    checks = _checks(run)
    step = run.last_step
    status = "finished" if run.finished else "in progress"
    progress = f"step {step if step is not None else '—'}" + (f" of {run.max_steps}" if run.max_steps else "")
    meta = [str(run.config.get("algorithm") or "unknown algorithm"), str((run.config.get("model") or {}).get("path") or ""),
            f"{progress} ({status})", f"{len(views)} rollouts", f"generated {time.strftime('%Y-%m-%d %H:%M:%S')}"]
    if others:
        meta.insert(0, "compared with " + ", ".join(names[1:]) + " (dashed)")
    broken = non_finite_values(run.rows)
    if broken:
        steps = sorted({s for s, _ in broken if isinstance(s, int)})
        meta.append(f"{len(broken)} metric values not finite numbers (null, NaN, inf or text; steps "
                    f"{', '.join(map(str, steps[:5]))}{' …' if len(steps) > 5 else ''}): gaps marked × in the plots")
    meta = [m for m in meta if m]
    atomic_write_text(out / "data.js", render_data({"run": run.name, "rollouts": views, "groups": groups(views)}))
    index = out / "index.html"
    latest, columns = _latest(run), None
    if others:
        latest, columns = _latest_compared([run, *others]), names
    atomic_write_text(index, render_index(title=run.name, meta=meta, plots=plots, checks=checks, latest=latest,
                                          problems=run.problems + [p for o in others for p in o.problems],
                                          n_rollouts=len(views), latest_columns=columns))
    return ReportResult(out, index, tuple(plots), len(views), len(images.written), step, run.finished, tuple(checks),
                        tuple(run.problems))
