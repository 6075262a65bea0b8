"""The `gymv dry-run` engine: which drivers a request names, what each costs, and per-suite budgets.

Rounding rule: a driver's cost is kept exact, as GPU-minutes (NUM_RUNS × NUM_NODES × GPUS_PER_NODE ×
NUM_MINUTES, a whole number); subtotals and the total are exact sums of those, and budgets are compared
exactly. Only the figures shown are rounded: GPU-hours = GPU-minutes / 60, half up, to 2 decimals.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from fractions import Fraction
from pathlib import Path

from gymv.errors import GymvError
from gymv.recipes.drivers import DriverConfig, parse_driver
from gymv.recipes.suites import (
    DRIVERS_DIR,
    RECIPE_SUFFIXES,
    SUITES_DIR,
    Suite,
    SuiteEntry,
    duplicate_entries,
    driver_for_recipe,
    is_driver_suite,
    load_budgets,
    load_driver_suite,
    load_suite,
    load_suites,
    recipe_for_driver,
    recipe_path,
)

ROUNDING_RULE = (
    "GPU-hours = NUM_RUNS x NUM_NODES x GPUS_PER_NODE x NUM_MINUTES / 60, kept exact per driver and summed "
    "exactly; only printed figures are rounded, half up, to 2 decimals."
)


def round_hours(hours: Fraction) -> Fraction:
    """Half up to hundredths, the one rounding applied to anything shown."""
    cents = (hours * 100 + Fraction(1, 2)).__floor__()
    return Fraction(cents, 100)


def format_hours(hours: Fraction) -> str:
    cents = int(round_hours(hours) * 100)
    sign = "-" if cents < 0 else ""
    cents = abs(cents)
    return f"{sign}{cents // 100}.{cents % 100:02d}"


def format_gpu_hours(gpu_minutes: int) -> str:
    """Printed form of a GPU-minute count, e.g. 80 -> '1.33'."""
    return format_hours(Fraction(gpu_minutes, 60))


def _json_hours(hours: Fraction) -> float:
    return float(format_hours(hours))


@dataclass(frozen=True)
class DriverCost:
    config: DriverConfig
    recipe: str | None
    entry: SuiteEntry | None = None

    @property
    def gpu_minutes(self) -> int:
        return self.config.gpu_minutes


@dataclass(frozen=True)
class Group:
    """The drivers of one suite, or (suite None) the drivers named by paths."""

    suite: str | None
    file: Path | None
    budget: Fraction | None
    drivers: tuple[DriverCost, ...]

    @property
    def gpu_minutes(self) -> int:
        return sum(d.gpu_minutes for d in self.drivers)

    @property
    def gpu_hours(self) -> Fraction:
        return Fraction(self.gpu_minutes, 60)

    @property
    def over_budget(self) -> bool | None:
        return None if self.budget is None else self.gpu_hours > self.budget


@dataclass(frozen=True)
class Skipped:
    """A driver or suite line that could not be costed (with --keep-going): where, and the error."""

    where: str
    error: str


@dataclass(frozen=True)
class DryRun:
    groups: tuple[Group, ...]
    skipped: tuple[Skipped, ...] = ()

    @property
    def total_gpu_minutes(self) -> int:
        return sum(g.gpu_minutes for g in self.groups)

    @property
    def total_gpu_hours(self) -> Fraction:
        return Fraction(self.total_gpu_minutes, 60)

    def warnings(self) -> list[str]:
        seen: set[tuple[str, str]] = set()
        out = []
        for g in self.groups:
            for d in g.drivers:
                for iv in d.config.ignored_wrapper_values:
                    if (iv.where, iv.name) not in seen:
                        seen.add((iv.where, iv.name))
                        sized = iv.name in ("NUM_NODES", "GPUS_PER_NODE", "NUM_MINUTES", "NUM_RUNS", "MAX_STEPS", "STEPS_PER_RUN")
                        out.append(f"{iv.where}: {iv.message()}" + ("; GPU-hours count the wrapper's value, which the "
                                                                      "launcher allocates" if sized else ""))
        return out

    def to_dict(self) -> dict:
        return {
            "rounding": ROUNDING_RULE,
            "suites": [_group_dict(g) for g in self.groups],
            "total_gpu_minutes": self.total_gpu_minutes,
            "total_gpu_hours": _json_hours(self.total_gpu_hours),
            "not_costed": [{"where": k.where, "error": k.error} for k in self.skipped],
            "warnings": self.warnings(),
        }


def _group_dict(g: Group) -> dict:
    return {
        "suite": g.suite,
        "file": None if g.file is None else str(g.file),
        "budget_gpu_hours": None if g.budget is None else float(g.budget),
        "gpu_minutes": g.gpu_minutes,
        "gpu_hours": _json_hours(g.gpu_hours),
        "over_budget": g.over_budget,
        "drivers": [_driver_dict(d) for d in g.drivers],
    }


def _driver_dict(d: DriverCost) -> dict:
    c = d.config
    return {
        "driver": str(c.path),
        "recipe": d.recipe,
        "num_nodes": c.allocation("NUM_NODES"),
        "gpus_per_node": c.allocation("GPUS_PER_NODE"),
        "steps_per_run": c.steps_per_run,
        "max_steps": c.max_steps,
        "num_runs": c.allocation("NUM_RUNS"),
        "num_minutes": c.allocation("NUM_MINUTES"),
        "runs_with": {k.lower(): v for k, v in (("NUM_NODES", c.num_nodes), ("GPUS_PER_NODE", c.gpus_per_node),
                                                ("NUM_RUNS", c.num_runs), ("NUM_MINUTES", c.num_minutes))
                      if k in c.allocated},
        "gpu_minutes": c.gpu_minutes,
        "gpu_hours": _json_hours(c.gpu_hours),
        "defaulted": sorted(c.defaulted),
        "exec_chain": [str(p) for p in c.chain[1:]],
        "extras": dict(c.extras),
    }


class _Planner:
    def __init__(self, recipes_dir: Path, keep_going: bool = False):
        self.recipes_dir = recipes_dir
        self.recipes_abs = Path(os.path.abspath(recipes_dir))
        self.cache: dict[Path, DriverConfig] = {}
        self.keep_going = keep_going
        self.skipped: list[Skipped] = []

    def driver(self, path: Path) -> DriverConfig:
        key = Path(os.path.abspath(path))
        if key not in self.cache:
            self.cache[key] = parse_driver(path)
        return self.cache[key]

    def cost(self, where: str, make: Callable[[], DriverCost]) -> list[DriverCost]:
        """[the cost], or, keeping going, [] with the error noted (the others are still costed)."""
        try:
            return [make()]
        except GymvError as e:
            if not self.keep_going:
                raise
            self.skipped.append(Skipped(where, e.one_line()))
            return []

    def suite_group(self, suite: Suite, budgets: dict[str, Fraction]) -> Group:
        dups = duplicate_entries(suite)
        if dups:
            repeat, first = dups[0]
            raise GymvError(f"{repeat.recipe} is listed twice in suite {suite.name!r} (first on line {first.line})",
                            where=repeat.where, fix="remove the repeated line")
        costs = []
        for e in suite.entries:
            costs += self.cost(e.where, lambda e=e: self.entry_cost(e))
        return Group(suite.name, suite.path, budgets.get(suite.name), tuple(costs))

    def entry_cost(self, e: SuiteEntry) -> DriverCost:
        if not recipe_path(self.recipes_dir, e.recipe).is_file():
            raise GymvError(f"recipe {e.recipe} does not exist under {self.recipes_dir}", where=e.where,
                            fix="fix the path or remove the line")
        driver = driver_for_recipe(self.recipes_dir, e.recipe)
        if not driver.is_file():
            raise GymvError(f"recipe {e.recipe} has no driver", where=e.where, fix=f"create {driver}")
        return DriverCost(self.driver(driver), e.recipe, e)

    def driver_suite_group(self, path: Path, budgets: dict[str, Fraction]) -> Group:
        """A suite list of driver scripts (NeMo RL's format): each driver costed from its own CONFIG block."""
        entries = load_driver_suite(path)
        seen: dict[Path, int] = {}
        for e in entries:
            key = e.driver.resolve()
            if key in seen:
                raise GymvError(f"{e.written} is listed twice in suite {path.stem!r} (first on line {seen[key]})",
                                where=e.where, fix="remove the repeated line")
            seen[key] = e.line
        costs = tuple(c for e in entries for c in self.cost(str(e.driver), lambda e=e: DriverCost(self.driver(e.driver), None)))
        ours = path.resolve().parent == (self.recipes_abs / SUITES_DIR).resolve()  # budgets.yaml speaks of our suites
        return Group(path.stem, path, budgets.get(path.stem) if ours else None, costs)

    def path_drivers(self, target: Path) -> list[Path]:
        if target.is_dir():
            found: list[Path] = []
            for p in sorted(target.rglob("*")):
                if not p.is_file():
                    continue
                if p.suffix == ".sh":
                    found.append(p)
                elif p.suffix in RECIPE_SUFFIXES and self._is_suite_recipe(p):
                    driver = self.recipe_driver(p)
                    if driver is not None:
                        found.append(driver)
            if not found:
                raise GymvError("no drivers (*.sh) or recipes with drivers found", where=str(target),
                                fix="pass a suite name, a drivers directory, or driver/recipe files")
            return found
        if target.suffix == ".sh":
            return [target]
        if target.suffix in RECIPE_SUFFIXES:
            if not self._is_suite_recipe(target):
                raise GymvError("not a recipe under the recipes directory's subfolders, so it has no driver",
                                where=str(target), fix=f"pass a recipe under {self.recipes_dir}/llm or vlm, or use --recipes-dir")
            driver = self.recipe_driver(target)
            if driver is None:
                raise GymvError("recipe has no driver", where=str(target),
                                fix=f"create {driver_for_recipe(self.recipes_dir, self._relative(target))}")
            return [driver]
        raise GymvError("not a driver (.sh), recipe (.yaml), suite (.txt) or directory", where=str(target),
                        fix="pass a suite name or driver/recipe paths")

    def _relative(self, recipe: Path) -> str:
        return Path(os.path.abspath(recipe)).relative_to(self.recipes_abs).as_posix()

    def _is_suite_recipe(self, p: Path) -> bool:
        """A recipe under a subfolder of the recipes directory (not an exemplar, not a suites/drivers file)."""
        try:
            rel = Path(os.path.abspath(p)).relative_to(self.recipes_abs)
        except ValueError:
            return False
        return len(rel.parts) > 1 and rel.parts[0] not in (SUITES_DIR, DRIVERS_DIR)

    def recipe_driver(self, recipe: Path) -> Path | None:
        driver = driver_for_recipe(self.recipes_dir, self._relative(recipe))
        return driver if driver.is_file() else None


def plan(targets: Sequence[str | Path] = (), recipes_dir: str | Path = "recipes", *, keep_going: bool = False) -> DryRun:
    """Resolve targets (suite names, suite files, drivers, recipes, directories) and cost every driver.

    With no targets: every suite under `<recipes_dir>/suites/` except `disabled`. Suites are costed one
    group each; everything named by a path is one group with suite None. `keep_going`: a driver that cannot
    be costed is left out and named in `DryRun.skipped` instead of stopping everything.
    """
    recipes_dir = Path(recipes_dir)
    planner = _Planner(recipes_dir, keep_going)
    budgets = load_budgets(recipes_dir)
    groups: list[Group] = []
    if not targets:
        if not recipes_dir.is_dir():
            raise GymvError("recipes directory not found", where=str(recipes_dir),
                            fix="run from the project root or pass --recipes-dir")
        suites = [s for s in load_suites(recipes_dir).values() if not s.disabled]
        if not suites:
            raise GymvError("no suite files", where=str(recipes_dir / SUITES_DIR),
                            fix="add suites/<name>.txt or pass drivers, recipes or directories")
        groups = [planner.suite_group(s, budgets) for s in suites]
        return DryRun(tuple(groups), tuple(planner.skipped))
    seen_suites: set[Path] = set()
    path_drivers: list[Path] = []
    for t in targets:
        text = str(t)
        suite_file = recipes_dir / SUITES_DIR / f"{text}.txt"
        as_path = Path(text)
        if "/" not in text and not as_path.suffix and suite_file.is_file():
            suite_path = suite_file
        elif as_path.suffix == ".txt" and as_path.is_file():
            suite_path = as_path
        elif as_path.exists():
            path_drivers.extend(planner.path_drivers(as_path))
            continue
        else:
            names = ", ".join(sorted(p.stem for p in (recipes_dir / SUITES_DIR).glob("*.txt"))) or "none found"
            raise GymvError(f"no suite or path named {text!r}",
                            fix=f"pass a suite name (suites in {recipes_dir / SUITES_DIR}: {names}) or an existing path")
        if suite_path.resolve() not in seen_suites:
            seen_suites.add(suite_path.resolve())
            if is_driver_suite(suite_path):
                groups.append(planner.driver_suite_group(suite_path, budgets))
            else:
                groups.append(planner.suite_group(load_suite(suite_path, recipes_dir), budgets))
    if path_drivers:
        unique: dict[Path, Path] = {}
        for p in path_drivers:
            unique.setdefault(Path(os.path.abspath(p)), p)
        costs = [c for p in unique.values()
                 for c in planner.cost(str(p), lambda p=p: DriverCost(planner.driver(p), recipe_for_driver(recipes_dir, p)))]
        groups.append(Group(None, None, None, tuple(costs)))
    return DryRun(tuple(groups), tuple(planner.skipped))
