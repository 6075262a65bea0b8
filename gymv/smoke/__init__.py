"""`gymv smoke`: run recipes for a few steps in their own processes, then assert their metric checks.

    from gymv.smoke import run_smoke
    report = run_smoke(["nightly"], tiny=True)
    report.passed, [r.status for r in report.results]

Each recipe is prepared (smoke: section, overrides, --steps, --tiny; validated), trained by `gymv train` in a
subprocess with a timeout, and judged: PASS, FAIL (a check failed or could not be evaluated), CRASH (the run
exited non-zero; the reason is its error line), TIMEOUT, or CONFIG (it did not load). One recipe's failure
never stops the others.
"""

from __future__ import annotations

import os
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from gymv.errors import GymvError
from gymv.smoke.junit import junit_xml, write_junit
from gymv.smoke.plan import DEFAULT_STEPS, PreparedRun, SmokeTarget, prepare_run, resolve_targets, run_name
from gymv.smoke.run import RecipeResult, TrainOutcome, evaluate_run, run_training
from gymv.smoke.tiny import tiny_config

__all__ = ["DEFAULT_STEPS", "PreparedRun", "RecipeResult", "SmokeListener", "SmokeReport", "SmokeTarget",
           "TrainOutcome", "default_out_dir", "evaluate_run", "junit_xml", "prepare_run", "resolve_targets",
           "run_smoke", "run_training", "tiny_config", "write_junit"]


class SmokeListener:
    """Progress hooks (the command draws them on stderr); every method may be left as is."""

    def on_recipe_start(self, index: int, total: int, target: SmokeTarget) -> None: ...

    def on_prepared(self, prepared: PreparedRun) -> None: ...

    def on_tick(self, elapsed_s: float) -> None: ...

    def on_result(self, result: RecipeResult) -> None: ...


@dataclass
class SmokeReport:
    title: str
    out_dir: Path
    results: list[RecipeResult] = field(default_factory=list)
    wall_s: float = 0.0

    @property
    def passed(self) -> bool:
        return bool(self.results) and all(r.passed for r in self.results)

    def counts(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for r in self.results:
            out[r.status] = out.get(r.status, 0) + 1
        return out

    def to_dict(self) -> dict:
        return {"title": self.title, "out_dir": str(self.out_dir), "passed": self.passed, "counts": self.counts(),
                "wall_s": round(self.wall_s, 3), "results": [r.to_dict() for r in self.results]}

    def junit(self) -> str:
        return junit_xml(self.results, self.title)


def default_out_dir() -> Path:
    return Path("runs") / "smoke" / time.strftime("%Y%m%d-%H%M%S")


def run_smoke(targets: Sequence[str], *, overrides: Sequence[str] = (), steps: int | None = None, tiny: bool = False,
              out_dir: str | os.PathLike | None = None, timeout_s: float | None = 1800.0, ray_address: str | None = None,
              recipes_dir: str | os.PathLike = "recipes", listener: SmokeListener | None = None) -> SmokeReport:
    """Smoke-test every recipe the targets name; a bad target is a GymvError, a bad recipe is a CONFIG result."""
    if steps is not None and steps < 1:
        raise GymvError(f"--steps must be at least 1, got {steps}", fix="pass --steps 1 or more")
    listener = listener or SmokeListener()
    resolved = resolve_targets(list(targets), recipes_dir)
    out = Path(out_dir) if out_dir is not None else default_out_dir()
    report = SmokeReport(" ".join(targets), out)
    t0 = time.monotonic()
    names: set[str] = set()
    for i, target in enumerate(resolved):
        listener.on_recipe_start(i, len(resolved), target)
        name = run_name(target, names)
        try:
            prepared = prepare_run(target, out_dir=out, name=name, overrides=list(overrides), steps=steps, tiny=tiny)
        except GymvError as e:
            result = RecipeResult(target.shown, name, target.suite, "CONFIG", e.one_line())
        else:
            listener.on_prepared(prepared)
            outcome = run_training(prepared, timeout_s=timeout_s, ray_address=ray_address, on_tick=listener.on_tick)
            result = evaluate_run(prepared, outcome)
        report.results.append(result)
        listener.on_result(result)
    report.wall_s = time.monotonic() - t0
    return report
