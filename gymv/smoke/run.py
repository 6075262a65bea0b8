"""Run one prepared recipe with `gymv train` in its own process (and process group), so that a crash, a hang or
a leaked worker stays that recipe's problem; then evaluate its checks against what it logged."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from gymv.checks import CheckResult, MetricSeries, evaluate_check
from gymv.smoke.plan import PreparedRun

KILL_GRACE_S = 15.0


@dataclass
class TrainOutcome:
    status: str  # ok | crash | timeout
    returncode: int | None
    wall_s: float
    summary: dict | None
    reason: str | None
    log: Path
    pid: int | None = None  # of the `gymv train` process, which led its own process group


def _reason(log: Path, returncode: int | None) -> str:
    """The one line that says why a run failed: gymv's `error:` line, else the last line of the traceback."""
    try:
        lines = [ln.strip() for ln in log.read_text(encoding="utf-8", errors="replace").splitlines() if ln.strip()]
    except OSError:
        lines = []
    for ln in reversed(lines):
        if ln.startswith("error:"):
            return ln.removeprefix("error:").strip()
    if returncode is not None and returncode < 0:
        try:
            name = signal.Signals(-returncode).name
        except ValueError:
            name = str(-returncode)
        return f"killed by signal {name}" + (f"; last output: {lines[-1]}" if lines else "")
    return lines[-1] if lines else f"exited with status {returncode} and no output"


def _stop(proc: subprocess.Popen) -> None:
    """End the run's whole process group (its Ray workers too): TERM, then KILL after a grace period."""
    for sig, wait in ((signal.SIGTERM, KILL_GRACE_S), (signal.SIGKILL, 5.0)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout=wait)
            return
        except subprocess.TimeoutExpired:
            continue


def _reap(pgid: int) -> None:
    """After `gymv train` exits, end whatever it left in its process group (e.g. workers of a hard crash)."""
    try:
        os.killpg(pgid, signal.SIGTERM)
    except (ProcessLookupError, PermissionError):
        pass


def train_command(prepared: PreparedRun, ray_address: str | None = None) -> list[str]:
    cmd = [sys.executable, "-m", "gymv_cli.main", "train", str(prepared.config_file), "--json"]
    if ray_address:
        cmd += ["--ray-address", ray_address]
    return cmd


def run_training(prepared: PreparedRun, *, timeout_s: float | None = None, ray_address: str | None = None,
                 on_tick: Callable[[float], None] | None = None, poll_s: float = 0.5) -> TrainOutcome:
    """`gymv train <resolved recipe> --json` in a new session; stdout (the JSON summary) and stderr go to files
    beside the run, so a failure can be read afterwards."""
    out_dir = prepared.config_file.parent
    log = out_dir / f"{prepared.name}.train.log"
    stdout_path = out_dir / f"{prepared.name}.train.json"
    env = {**os.environ, "NO_COLOR": "1", "COLUMNS": "160", "PYTHONUNBUFFERED": "1"}
    t0 = time.monotonic()
    with open(stdout_path, "w", encoding="utf-8") as out, open(log, "w", encoding="utf-8") as err:
        proc = subprocess.Popen(train_command(prepared, ray_address), stdout=out, stderr=err, stdin=subprocess.DEVNULL,
                                env=env, start_new_session=True)
        try:
            while True:
                try:
                    rc = proc.wait(timeout=poll_s)
                    break
                except subprocess.TimeoutExpired:
                    elapsed = time.monotonic() - t0
                    if on_tick is not None:
                        on_tick(elapsed)
                    if timeout_s is not None and elapsed > timeout_s:
                        _stop(proc)
                        return TrainOutcome("timeout", proc.returncode, time.monotonic() - t0, None,
                                            f"no result after {timeout_s:g} s; stopped", log, proc.pid)
        except BaseException:  # Ctrl-C in smoke: do not leave the run (and its workers) behind
            _stop(proc)
            raise
    wall = time.monotonic() - t0
    _reap(proc.pid)
    summary = None
    try:
        summary = json.loads(stdout_path.read_text(encoding="utf-8") or "null")
    except (OSError, ValueError):
        summary = None
    if rc != 0:
        return TrainOutcome("crash", rc, wall, summary, _reason(log, rc), log, proc.pid)
    return TrainOutcome("ok", rc, wall, summary, None, log, proc.pid)


@dataclass
class RecipeResult:
    recipe: str  # as shown (relative to the working directory)
    name: str
    suite: str | None
    status: str  # PASS | FAIL | CRASH | TIMEOUT | CONFIG
    reason: str | None = None
    algorithm: str | None = None
    steps: int | None = None  # last step logged
    max_steps: int | None = None
    steps_from: str | None = None
    wall_s: float = 0.0
    checks: list[CheckResult] = field(default_factory=list)
    driver_checks: list[CheckResult] = field(default_factory=list)
    run_dir: str | None = None
    log: str | None = None
    tiny_changes: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    @property
    def passed(self) -> bool:
        return self.status == "PASS"

    def to_dict(self) -> dict:
        return {"recipe": self.recipe, "name": self.name, "suite": self.suite, "status": self.status,
                "reason": self.reason, "algorithm": self.algorithm, "steps": self.steps, "max_steps": self.max_steps,
                "steps_from": self.steps_from, "wall_s": round(self.wall_s, 3),
                "checks": [c.to_dict() for c in self.checks], "driver_checks": [c.to_dict() for c in self.driver_checks],
                "run_dir": self.run_dir, "log": self.log, "tiny_changes": self.tiny_changes, "notes": self.notes}


def evaluate_run(prepared: PreparedRun, outcome: TrainOutcome) -> RecipeResult:
    """PASS when the run finished and every recipe check passed; driver checks count only for a full run."""
    result = RecipeResult(prepared.target.shown, prepared.name, prepared.target.suite, "PASS", algorithm=prepared.algorithm,
                          max_steps=prepared.max_steps, steps_from=prepared.steps_from, wall_s=outcome.wall_s,
                          run_dir=str(prepared.run_dir), log=str(outcome.log), tiny_changes=prepared.tiny_changes,
                          notes=list(prepared.notes))
    metrics = MetricSeries.from_run(prepared.run_dir)
    result.steps = metrics.last_step
    if outcome.status != "ok":
        result.status = "TIMEOUT" if outcome.status == "timeout" else "CRASH"
        result.reason = prepared.explain(outcome.reason or "")
        result.checks = [CheckResult(c.text, "skip", (), "the run did not finish", c.where) for c in prepared.checks]
        return result
    result.checks = [evaluate_check(c.text, metrics, where=c.where) for c in prepared.checks]
    full = prepared.driver_max_steps is not None and (metrics.last_step or 0) >= prepared.driver_max_steps
    for c in prepared.driver_checks:
        if full:
            result.driver_checks.append(evaluate_check(c.text, metrics, where=c.where))
        else:
            result.driver_checks.append(CheckResult(
                c.text, "skip", (), f"a full-run check: the run stopped at step {metrics.last_step} of the driver's "
                f"MAX_STEPS {prepared.driver_max_steps}", c.where))
    bad = [c for c in (*result.checks, *result.driver_checks) if c.status in ("fail", "error")]
    if bad:
        result.status = "FAIL"
        result.reason = f"{len(bad)} of {len(result.checks) + sum(c.status != 'skip' for c in result.driver_checks)} " \
                        f"checks failed: " + "; ".join(c.text for c in bad)
    return result
