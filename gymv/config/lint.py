"""`gymv lint`: every recipe convention checked over a tree of recipes, drivers and suites, with stable IDs.

The checks themselves live in the building blocks (the loader's findings, minimality, names, exemplars,
suite accounting, the driver parser, budgets); this module collects the files, runs each check once per
file, gives every finding a stable rule ID from `RULES`, and keeps the findings that concern what was
asked for. `fix_minimality` rewrites a recipe without its redundant leaves, keeping everything else.
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path

import yaml

from gymv.capabilities import gaps
from gymv.checks.lint import driver_check_findings, recipe_check_findings
from gymv.config.compat import RULES as COMPAT_RULES
from gymv.config.exemplars import RECIPE_DIRS, check_inherits_exemplar, find_recipes_root, is_exemplar
from gymv.findings import Finding
from gymv.config.loader import LoadedRecipe, load_recipe
from gymv.config.minimality import check_minimal, same_value
from gymv.config.naming import RecipeName, check_recipe_name, parse_recipe_name
from gymv.config.suites import suite_accounting
from gymv.config.tree import OVERRIDE_MARKER, split_key
from gymv.yamlfile import display_path, parse_yaml
from gymv.errors import GymvError
from gymv.io import atomic_write_text
from gymv.recipes.drivers import DriverConfig, find_block, parse_driver
from gymv.recipes.gpu_hours import DriverCost, Group, format_gpu_hours, format_hours
from gymv.recipes.suites import (
    BUDGETS_FILE,
    DRIVERS_DIR,
    GPUS_PER_NODE_FILE,
    RECIPE_SUFFIXES,
    SUITES_DIR,
    Suite,
    SuiteEntry,
    SuiteGpus,
    driver_for_recipe,
    load_budgets,
    load_gpus_per_node,
    load_suites,
)


@dataclass(frozen=True)
class LintRule:
    id: str
    name: str
    what: str
    fix: str


RULES: tuple[LintRule, ...] = (
    LintRule("GV001", "recipe-loads", "the recipe file cannot be read as a recipe: YAML syntax error, duplicate key, "
             "a root that is not a mapping, a bad or missing `defaults:` parent, a `defaults` cycle, a misplaced `_override_`",
             "fix the file at the line shown"),
    LintRule("GV002", "inherits-exemplar", "a recipe under llm/ or vlm/ has no `defaults:`, or its chain does not reach the "
             "exemplar of its algorithm; or an exemplar inherits something", "inherit the exemplar (directly or through another recipe)"),
    LintRule("GV003", "minimal", "a leaf repeats the value it inherits", "delete it, or run `gymv lint --fix`"),
    LintRule("GV004", "name-format", "the file name does not match `<algo>-<model>-<N>n<G>g-<strategy>[-modifiers][.vN]` "
             "with a known algorithm and strategy", "rename the file"),
    LintRule("GV005", "name-matches-recipe", "the name's algorithm, `NnGg` or strategy disagrees with `algorithm`, "
             "`cluster.num_nodes`, `cluster.gpus_per_node` or `training.backend`", "rename the file or fix the key"),
    LintRule("GV006", "schema", "the resolved config fails the schema: unknown key, wrong type, bad choice, missing "
             "key, a section of another algorithm, or a broken `${...}` interpolation", "fix the key at the line shown"),
    LintRule("GV007", "compatible", "settings that do not work together (docs/config.md, Compatibility rules), e.g. "
             "`reset_encoder_cache_after_weight_update` with a refit transport that does not implement it, async GRPO "
             "without importance sampling, parallel sizes that do not divide the GPUs", "change one of the settings"),
    LintRule("GV008", "has-driver", "a recipe has no driver `recipes/drivers/<same relative name>.sh`", "add the driver"),
    LintRule("GV009", "driver-has-recipe", "a driver has no recipe of the same relative name", "remove the driver or add the recipe"),
    LintRule("GV010", "in-a-suite", "a recipe is in no suite list", "add it to exactly one suite (disabled.txt counts)"),
    LintRule("GV011", "in-one-suite", "a recipe is listed more than once (in one suite or in several)", "keep exactly one entry"),
    LintRule("GV012", "suite-entry-exists", "a suite entry names no recipe file", "fix the path (relative to recipes/) or remove the line"),
    LintRule("GV013", "disabled-reason", "a `disabled.txt` entry gives no reason", "add `# <why>` on the same line"),
    LintRule("GV014", "driver-block", "a driver's CONFIG block is missing or cannot be read: no BEGIN/END marker, "
             "`$(...)`, an unknown variable, bad arithmetic, a missing or non-integer key, a broken wrapper `exec`",
             "fix the block at the line shown (docs/dry-run.md lists what it may contain)"),
    LintRule("GV015", "driver-matches-recipe", "the driver's NUM_NODES or GPUS_PER_NODE disagrees with the recipe's "
             "`NnGg` (or, when the name does not parse, its `cluster`)", "set the driver's values to the recipe's"),
    LintRule("GV016", "driver-matches-suite", "the driver's GPUS_PER_NODE is not one its suite runs on "
             "(`recipes/suites/gpus_per_node.yaml`)", "move the recipe to a suite with such nodes, or fix GPUS_PER_NODE"),
    LintRule("GV017", "suite-budget", "a suite's GPU-hours (as `gymv dry-run` counts them) exceed its budget in "
             "`recipes/suites/budgets.yaml`", "shorten runs, move recipes to another suite, or raise the budget"),
    LintRule("GV018", "suite-files", "a suite list, `budgets.yaml` or `gpus_per_node.yaml` cannot be read",
             "fix the file at the line shown"),
    LintRule("GV019", "wrapper-values", "a wrapper driver sets a value that never reaches the driver it execs "
             "(not exported, or reassigned there); a warning", "export it, or let the driver default it with `${NAME:-...}`"),
    LintRule("GV020", "check-syntax", "a metric check (a recipe's `checks:` entry or a line of a driver's CHECKS block) "
             "does not parse, or the CHECKS block is malformed; the message gives the column",
             "fix the check at the column shown (docs/smoke-and-report.md gives the grammar)"),
    LintRule("GV021", "check-metric", "a metric check names a metric gymv does not log (docs/algorithms.md §10; a "
             "per-environment `/<agent>` qualifier is allowed)", "fix the name, or register a plugin's metric"),
    LintRule("GV022", "runnable", "a recipe on a suite other than `disabled.txt` asks for something `gymv train` cannot run "
             "with the project's own backends (gymv.capabilities: an unwired backend, logger or key)",
             "make it runnable, or move its entry to `disabled.txt` with the reason"),
    LintRule("GV023", "model-config", "the recipe's model (or a MOPD teacher) is a local checkpoint folder whose config.json "
             "cannot be read, breaks what its model family requires (gymv.models.config_check) or does not match its "
             "weights' layers", "fix the config.json key named, or point the recipe at the right checkpoint"),
)
RULE_IDS: dict[str, LintRule] = {r.id: r for r in RULES}

_CHECK_RULE = {
    "recipe.exemplar": "GV002",
    "recipe.minimal": "GV003",
    "name.format": "GV004",
    "name.mismatch": "GV005",
    "interpolation": "GV006",
    "driver.missing": "GV008",
    "driver.orphan": "GV009",
    "suite.unlisted": "GV010",
    "suite.duplicate": "GV011",
    "suite.missing-recipe": "GV012",
    "suite.disabled-reason": "GV013",
    "check.syntax": "GV020",
    "check.metric": "GV021",
    "model.config": "GV023",
}


def rule_id(check: str) -> str:
    """The lint rule ID of a building block's finding (`Finding.rule`)."""
    if check in _CHECK_RULE:
        return _CHECK_RULE[check]
    if check.startswith("schema."):
        return "GV006"
    if any(r.id == check for r in COMPAT_RULES):  # read now: a plugin may have registered a rule since import
        return "GV007"
    raise KeyError(f"no lint rule for check {check!r}")


@dataclass(frozen=True)
class LintFinding:
    """One finding at `path:line`; `check` is the building block's finer id (e.g. `refit.encoder-cache-reset`)."""

    path: str
    line: int
    rule: str
    message: str
    fix: str | None = None
    severity: str = "error"
    check: str | None = None

    def one_line(self) -> str:
        text = f"{self.path}:{self.line}: {self.rule} {self.message}"
        return text + (f" (fix: {self.fix})" if self.fix else "")

    def to_dict(self) -> dict:
        return {"path": self.path, "line": self.line, "rule": self.rule, "severity": self.severity,
                "message": self.message, "fix": self.fix, "check": self.check}

    def sort_key(self) -> tuple:
        return (self.path, self.line, self.rule, self.message, self.fix or "", self.check or "")


@dataclass
class LintReport:
    findings: list[LintFinding]
    files: int  # recipes, drivers and suite files looked at

    @property
    def errors(self) -> int:
        return sum(f.severity == "error" for f in self.findings)

    @property
    def warnings(self) -> int:
        return sum(f.severity == "warning" for f in self.findings)

    def to_dict(self) -> dict:
        return {"files": self.files, "errors": self.errors, "warnings": self.warnings,
                "findings": [f.to_dict() for f in self.findings]}


def model_config_findings(rec: LoadedRecipe, cfg) -> list[Finding]:
    """GV023: the recipe's local checkpoint folders (model.path, MOPD teachers' paths; not `embedded:` or hub
    ids, which lint never builds nor fetches) checked as `gymv train`'s pre-flight checks them."""
    from gymv.models.config_check import check_checkpoint
    from gymv.models.init_path import resolve_init_path

    keys = [("model.path", cfg.model.path)]
    mopd = getattr(cfg, "mopd", None)
    keys += [(f"mopd.teachers.{alias}.path", t.path.removeprefix("text:"))
             for alias, t in (mopd.teachers.items() if mopd is not None else ())]
    out, seen = [], set()
    for key, text in keys:
        if not Path(text).expanduser().is_dir():
            continue
        origin = rec.origin(key)
        try:
            folder = resolve_init_path(text, where=key)
            if folder in seen:
                continue
            seen.add(folder)
            check_checkpoint(folder)
        except GymvError as e:
            out.append(Finding("model.config", f"{key} {text}: {e.where + ': ' if e.where else ''}{e.message}", key,
                               str(origin) if origin is not None else None, e.fix))
    return out


# ---- locations -------------------------------------------------------------------------------------------

_WHERE = re.compile(r"^(?P<file>.+?):(?P<line>\d+)(?::\d+)?$")


@lru_cache(maxsize=None)
def _shown(path: str) -> str:
    return display_path(path)


def _split_where(where: str | None, default: str | os.PathLike) -> tuple[str, int]:
    """`file:line[:col]` -> (shown file, line); a bare file, or nothing, is line 1 of it (or of `default`)."""
    if where:
        m = _WHERE.match(where)
        if m:
            return _shown(m["file"]), int(m["line"])
        return _shown(where), 1
    return _shown(str(default)), 1


def _finding(rule: str, message: str, where: str | None, default: str | os.PathLike, fix: str | None = None,
             severity: str = "error", check: str | None = None) -> LintFinding:
    path, line = _split_where(where, default)
    return LintFinding(path, line, rule, message, fix, severity, check)


def _from_finding(f: Finding, default: str | os.PathLike) -> LintFinding:
    return _finding(rule_id(f.rule), f.message, f.where, default, f.fix, f.severity, f.rule)


def _from_error(rule: str, e: GymvError, default: str | os.PathLike, check: str | None = None) -> LintFinding:
    return _finding(rule, e.message, e.where, default, e.fix, "error", check)


# ---- scope: what was asked for ---------------------------------------------------------------------------

class _Scope:
    """The linted paths; a finding outside them is kept only when it concerns a recipe inside them."""

    def __init__(self, paths: Iterable[Path]):
        resolved = [Path(p).resolve() for p in paths]
        self.dirs = tuple(str(p).rstrip(os.sep) + os.sep for p in resolved if p.is_dir())
        self.files = {str(p) for p in resolved}
        self._memo: dict[str, bool] = {}

    def add(self, path: Path) -> None:
        self.files.add(str(path.resolve()))
        self._memo.clear()

    def covers(self, path: str | os.PathLike) -> bool:
        key = os.fspath(path)
        if key not in self._memo:
            p = str(Path(key).resolve())
            self._memo[key] = p in self.files or p.startswith(self.dirs)
        return self._memo[key]


# ---- collecting files ------------------------------------------------------------------------------------

def _walk(d: Path) -> Iterable[Path]:
    for base, dirs, files in os.walk(d):
        dirs[:] = sorted(x for x in dirs if not x.startswith("."))
        for name in sorted(files):
            yield Path(base) / name


def _collect(paths: Sequence[Path]) -> tuple[list[Path], list[Path], list[Path]]:
    """(recipe files, driver files, suite files) named by `paths`, directories searched recursively."""
    recipes: list[Path] = []
    drivers: list[Path] = []
    suites: list[Path] = []
    for p in paths:
        try:
            kind = "dir" if p.is_dir() else "file" if p.is_file() else "other" if p.exists() else None
        except OSError as e:  # a name too long, a loop of links
            raise GymvError(f"cannot read: {e.strerror or e}", where=str(p)[:200], fix="pass existing paths (default: recipes/)") from None
        if kind == "other":
            raise GymvError("is not a regular file or directory", where=str(p), fix="pass recipes, drivers, suite lists or directories")
        if kind == "dir":
            found = list(_walk(p))
        elif kind == "file":
            if not p.name.endswith((*RECIPE_SUFFIXES, ".sh", ".txt")):
                raise GymvError("not a recipe (.yaml), driver (.sh), suite list (.txt) or directory", where=str(p),
                                fix="pass recipes, drivers, suite lists or directories (default: recipes/)")
            found = [p]
        else:
            raise GymvError("no such file or directory", where=str(p), fix="pass existing paths (default: recipes/)")
        for f in found:
            if f.name.endswith(RECIPE_SUFFIXES):
                recipes.append(f)
            elif f.suffix == ".sh":
                drivers.append(f)
            elif f.suffix == ".txt" and f.parent.name == SUITES_DIR:
                suites.append(f)
    return recipes, drivers, suites


# ---- one recipes directory -------------------------------------------------------------------------------

@dataclass
class _RecipeInfo:
    path: Path
    rel: str
    name: RecipeName | None = None  # when the file name parses
    cluster: tuple[int, int] | None = None  # (num_nodes, gpus_per_node) of a schema-valid recipe
    gaps: list = field(default_factory=list)  # what gymv train cannot run (gymv.capabilities.gaps)


@dataclass
class _Root:
    """A recipes directory (holds the exemplars, llm/, vlm/, drivers/, suites/) and what was read from it."""

    root: Path
    recipes: dict[str, _RecipeInfo] = field(default_factory=dict)  # rel -> info, recipes in scope
    drivers: dict[str, DriverConfig | GymvError] = field(default_factory=dict)
    suites: dict[str, Suite] | None = None
    gpus: dict[str, SuiteGpus] = field(default_factory=dict)  # suite -> GPUS_PER_NODE its nodes have
    _recipe_of: dict[str, str | None] = field(default_factory=dict)

    def rel(self, path: Path) -> str:
        return path.resolve().relative_to(self.root).as_posix()

    def recipe_of(self, driver: Path) -> str | None:
        """The recipe (relative to the root) that a driver runs, when that recipe file exists."""
        key = os.path.abspath(driver)
        if key not in self._recipe_of:
            self._recipe_of[key] = None
            try:
                rel = Path(driver).resolve().relative_to(self.root / DRIVERS_DIR)
            except ValueError:
                return None
            for suffix in RECIPE_SUFFIXES:
                if (self.root / rel.with_suffix(suffix)).is_file():
                    self._recipe_of[key] = rel.with_suffix(suffix).as_posix()
                    break
        return self._recipe_of[key]

    def driver(self, path: Path) -> DriverConfig | GymvError:
        key = os.path.abspath(path)
        if key not in self.drivers:
            try:
                self.drivers[key] = parse_driver(path)
            except GymvError as e:
                self.drivers[key] = e
        return self.drivers[key]


class _Linter:
    def __init__(self, scope: _Scope):
        self.scope = scope
        self.cache: dict = {}  # compose cache: each parent file is read once
        self.out: set[LintFinding] = set()
        self.roots: dict[Path, _Root] = {}
        self._root_of_dir: dict[Path, Path | None] = {}
        self._parent_findings: dict[str, frozenset[LintFinding]] = {}

    def add(self, f: LintFinding, subjects: Iterable[str | os.PathLike] = ()) -> None:
        """Keep `f` when it is in a linted file or concerns (`subjects`) a linted recipe or driver."""
        if self.scope.covers(f.path) or any(self.scope.covers(s) for s in subjects):
            self.out.add(f)

    def root_of(self, path: Path) -> _Root | None:
        d = Path(os.path.abspath(path.parent))
        if d not in self._root_of_dir:
            self._root_of_dir[d] = find_recipes_root(d)
        r = self._root_of_dir[d]
        if r is None:
            return None
        if r not in self.roots:
            self.roots[r] = _Root(r)
        return self.roots[r]

    # -- recipes ----------------------------------------------------------------------------------------

    def recipe(self, path: Path) -> None:
        root = self.root_of(path)
        rel = root.rel(path) if root else None
        parts = rel.split("/") if rel else []
        if parts and parts[0] in (SUITES_DIR, DRIVERS_DIR):
            return  # budgets.yaml, gpus_per_node.yaml: read by the suite rules
        suite_recipe = len(parts) > 1 and parts[0] in RECIPE_DIRS
        exemplar = root is not None and len(parts) == 1 and is_exemplar(path, root.root)
        info = _RecipeInfo(path, rel) if suite_recipe else None
        if info is not None:
            root.recipes[rel] = info
            try:
                info.name = parse_recipe_name(path.name)
            except ValueError:
                pass
        try:
            rec = load_recipe(path, validate=False, cache=self.cache)
        except GymvError as e:
            self.out.add(_from_error("GV001", e, path))
            return
        for f in self._recipe_findings(rec, path, root, suite_recipe, exemplar):
            self.out.add(f)
        cfg = rec.checked[0]
        if cfg is not None:
            for f in model_config_findings(rec, cfg):
                self.add(_from_finding(f, path), [path])
        if info is not None and cfg is not None:
            info.cluster = (cfg.cluster.num_nodes, cfg.cluster.gpus_per_node)
            info.gaps = gaps(cfg)

    def _recipe_findings(self, rec: LoadedRecipe, path: Path, root: _Root | None, suite_recipe: bool,
                         exemplar: bool) -> Iterable[LintFinding]:
        cfg, found = rec.checked
        for f in [*found, *recipe_check_findings(rec)]:
            yield self._placed(_from_finding(f, path), path)
        if suite_recipe or exemplar:
            for f in check_inherits_exemplar(rec, root.root):
                yield _from_finding(f, path)
        if suite_recipe:
            for f in check_minimal(rec):
                yield _from_finding(f, path)
            for f in check_recipe_name(path, cfg, rec.locate):
                yield self._placed(_from_finding(f, path), path, always=True)

    def _placed(self, f: LintFinding, path: Path, always: bool = False) -> LintFinding:
        """A recipe's finding blamed on a key its parent wrote stays at the parent's line when the parent has
        the same problem on its own; otherwise (it arises from this recipe, or it is about this file's name)
        it moves to this recipe, saying where the value comes from."""
        here = _shown(str(path))
        if f.path == here or (not always and f in self._own_findings(f.path)):
            return f
        return LintFinding(here, 1, f.rule, f"{f.message} (the value comes from {f.path}:{f.line})", f.fix,
                           f.severity, f.check)

    def _own_findings(self, shown: str) -> frozenset[LintFinding]:
        if shown not in self._parent_findings:
            try:
                rec = load_recipe(shown, validate=False, cache=self.cache)
                found = frozenset(_from_finding(f, shown) for f in [*rec.checked[1], *recipe_check_findings(rec)])
            except GymvError:
                found = frozenset()
            self._parent_findings[shown] = found
        return self._parent_findings[shown]

    # -- a recipes directory's drivers and suites -------------------------------------------------------

    def tree(self, r: _Root, drivers: list[Path], suite_files: list[Path]) -> None:
        root = r.root
        try:
            r.suites = load_suites(root)
            accounting = suite_accounting(root)
        except GymvError as e:
            self.add(_from_error("GV018", e, root / SUITES_DIR), subjects=self._every_recipe(r))
            r.suites, accounting = None, []
        try:
            r.gpus = load_gpus_per_node(root)
        except GymvError as e:
            self.add(_from_error("GV018", e, root / SUITES_DIR / GPUS_PER_NODE_FILE), subjects=self._every_recipe(r))
        entry_at: dict[tuple[str, int], SuiteEntry] = {}
        by_recipe: dict[str, list[SuiteEntry]] = {}
        for suite in (r.suites or {}).values():
            for e in suite.entries:
                entry_at[(_shown(str(e.file)), e.line)] = e
                by_recipe.setdefault(e.recipe, []).append(e)
        for f in accounting:
            lf = _from_finding(f, root)
            entry = entry_at.get((lf.path, lf.line))
            self.add(lf, subjects=[root / entry.recipe] if entry else ())
        for suite in (r.suites or {}).values():
            if not suite.disabled:
                for e in suite.entries:
                    self.runnable(r, e)
        for rel, info in sorted(r.recipes.items()):
            driver = driver_for_recipe(root, rel)
            if driver.is_file():
                self.driver_rules(r, info, driver, by_recipe.get(rel, []))
        for d in drivers:
            if r.recipe_of(d) not in r.recipes:
                cfg = r.driver(d)
                if isinstance(cfg, GymvError):
                    self.add(_from_error("GV014", cfg, d), subjects=[d])
        self.budgets(r)

    def runnable(self, r: _Root, entry: SuiteEntry) -> None:
        """GV022 at the suite entry of a recipe that gymv train cannot run here."""
        info = r.recipes.get(entry.recipe)
        if info is None or not info.gaps:
            return
        first, more = info.gaps[0], len(info.gaps) - 1
        also = f" (and {more} more: {', '.join(g.key for g in info.gaps[1:])})" if more else ""
        self.add(_finding("GV022", f"{entry.recipe} is on the {entry.suite} suite but gymv train cannot run it: "
                          f"{first}{also}", f"{entry.file}:{entry.line}", entry.file,
                          "make it runnable, or move the entry to disabled.txt with `# <why>`"), subjects=[info.path])

    @staticmethod
    def _every_recipe(r: _Root) -> list[Path]:
        """An unreadable suite file concerns every linted recipe of its directory: their suite rules cannot run."""
        return [info.path for info in r.recipes.values()]

    def driver_rules(self, r: _Root, info: _RecipeInfo, driver: Path, entries: list[SuiteEntry]) -> None:
        subject = [info.path]
        cfg = r.driver(driver)
        if isinstance(cfg, GymvError):
            self.add(_from_error("GV014", cfg, driver), subject)
            return
        if info.name is not None:
            want, said = (info.name.num_nodes, info.name.gpus_per_node), f"name says {info.name.num_nodes}n{info.name.gpus_per_node}g"
        elif info.cluster is not None:
            want, said = info.cluster, "cluster says {}n{}g".format(*info.cluster)
        else:
            want = said = None
        if want is not None:
            for key, have, expect in (("NUM_NODES", cfg.num_nodes, want[0]), ("GPUS_PER_NODE", cfg.gpus_per_node, want[1])):
                if have != expect:
                    self.add(_finding("GV015", f"driver sets {key}={have}, the recipe's {said}", _source(cfg, key), driver,
                                      f"set {key}={expect} (or rename the recipe)"), subject)
        for e in entries:
            allowed = r.gpus.get(e.suite)
            if allowed is not None and cfg.gpus_per_node not in allowed.allowed:
                shown = " or ".join(map(str, allowed.allowed))
                at = "{}:{}".format(*_split_where(allowed.where, allowed.where))
                self.add(_finding("GV016", f"driver sets GPUS_PER_NODE={cfg.gpus_per_node}, but suite {e.suite} runs on "
                                  f"nodes of {shown} GPUs ({at})",
                                  _source(cfg, "GPUS_PER_NODE"), driver,
                                  f"list the recipe in a suite for {cfg.gpus_per_node}-GPU nodes, or fix GPUS_PER_NODE"), subject)
        for iv in cfg.ignored_wrapper_values:
            self.add(_finding("GV019", iv.message(), iv.where, driver,
                              f"export {iv.name} in the wrapper, or have the driver default it: {iv.name}=\"${{{iv.name}:-...}}\"",
                              "warning"), subject)
        for f in driver_check_findings(driver):
            self.add(_from_finding(f, driver), subject)

    def budgets(self, r: _Root) -> None:
        budgets_file = r.root / SUITES_DIR / BUDGETS_FILE
        try:
            budgets = load_budgets(r.root)
        except GymvError as e:
            self.add(_from_error("GV018", e, budgets_file), subjects=self._every_recipe(r))
            return
        for suite in (r.suites or {}).values():
            budget = budgets.get(suite.name)
            if suite.disabled or budget is None:
                continue
            recipes = {e.recipe: e for e in suite.entries}
            subjects = [r.root / rel for rel in recipes]
            if not any(self.scope.covers(s) for s in subjects) and not self.scope.covers(budgets_file):
                continue
            costs, unread = [], 0
            for rel, e in recipes.items():
                driver = driver_for_recipe(r.root, rel)
                cfg = r.driver(driver) if driver.is_file() else None
                if isinstance(cfg, DriverConfig):
                    costs.append(DriverCost(cfg, rel, e))
                else:
                    unread += 1
            group = Group(suite.name, suite.path, budget, tuple(costs))
            if group.over_budget:
                at_least = f" (at least: {unread} driver{'s' if unread > 1 else ''} could not be read)" if unread else ""
                self.add(_finding("GV017", f"suite {suite.name} needs {format_gpu_hours(group.gpu_minutes)} GPU-hours{at_least}, "
                                  f"over its budget of {format_hours(budget)}", _budget_where(budgets_file, suite.name),
                                  budgets_file, "shorten runs (NUM_MINUTES, MAX_STEPS), move recipes to another suite, "
                                  "or raise the budget"), subjects)


def _source(cfg: DriverConfig, key: str) -> str:
    """Where a driver value was set; a defaulted one points at the CONFIG block of the driver that ran."""
    where = cfg.sources.get(key)
    if where and _WHERE.match(where):
        return where
    last = cfg.chain[-1] if cfg.chain else cfg.path
    try:
        return f"{last}:{find_block(last).begin_line}"
    except GymvError:
        return str(last)


def _budget_where(path: Path, suite: str) -> str:
    try:
        doc = parse_yaml(path.read_text(encoding="utf-8"), str(path))
        line = doc.lines.get((suite,))
    except (GymvError, OSError):
        line = None
    return f"{path}:{line}" if line else str(path)


def lint_paths(paths: Sequence[str | os.PathLike] = ("recipes",)) -> LintReport:
    """Run every rule over `paths` (files or directories, recursively); findings sorted by path and line.

    Raises GymvError only for usage problems (a path that does not exist or is not a recipe, driver, suite
    list or directory); every problem in the files themselves is a finding.
    """
    given = [Path(p) for p in paths] or [Path("recipes")]
    recipes, drivers, suite_files = _collect(given)
    scope = _Scope(given)
    linter = _Linter(scope)
    for d in drivers:  # a driver named alone lints its recipe too
        root = linter.root_of(d)
        rel = root.recipe_of(d) if root else None
        if rel and not scope.covers(root.root / rel):
            scope.add(root.root / rel)
            recipes.append(root.root / rel)
    seen: set[str] = set()
    for p in recipes:
        key = os.path.abspath(p)
        if key not in seen:
            seen.add(key)
            linter.recipe(p)
    for p in [*drivers, *suite_files]:
        linter.root_of(p)
    by_root: dict[Path, tuple[list[Path], list[Path]]] = {r: ([], []) for r in linter.roots}
    for d in drivers:
        r = linter.root_of(d)
        if r is not None:
            by_root[r.root][0].append(d)
            continue
        try:  # a driver outside any recipes directory: only its block can be checked
            parse_driver(d)
        except GymvError as e:
            linter.add(_from_error("GV014", e, d))
    for s in suite_files:
        r = linter.root_of(s)
        if r is not None:
            by_root[r.root][1].append(s)
    for r, (drv, sts) in by_root.items():
        linter.tree(linter.roots[r], drv, sts)
    files = len(seen) + len({os.path.abspath(d) for d in drivers}) + len(suite_files)
    return LintReport(sorted(linter.out, key=LintFinding.sort_key), files)


# ---- --fix: delete redundant leaves ----------------------------------------------------------------------

@dataclass(frozen=True)
class FixResult:
    path: Path
    removed: tuple[str, ...]  # dotted keys deleted (a section emptied by the deletions counts as one)
    lines_removed: int
    left: tuple[str, ...]  # redundant keys that could not be deleted line-wise (inside a flow `{...}` mapping)

    @property
    def changed(self) -> bool:
        return self.lines_removed > 0


def _mapping_entries(node: yaml.MappingNode) -> dict[str, tuple[yaml.Node, yaml.Node]]:
    return {k.value: (k, v) for k, v in node.value if isinstance(k, yaml.ScalarNode)}


def _node_at(root: yaml.Node, path: tuple) -> tuple[yaml.MappingNode, yaml.Node, yaml.Node] | None:
    """(parent mapping, key node, value node) of a key path in the composed document."""
    parent = root
    for i, p in enumerate(path):
        if not isinstance(parent, yaml.MappingNode):
            return None
        hit = _mapping_entries(parent).get(p)
        if hit is None:
            return None
        if i == len(path) - 1:
            return parent, hit[0], hit[1]
        parent = hit[1]
    return None


def _prune_emptied(root: yaml.MappingNode, doomed: set[tuple]) -> set[tuple]:
    """Replace all the children of a mapping with the mapping itself, bottom-up (so no empty `key:` is left)."""

    def visit(node: yaml.Node, path: tuple) -> bool:
        """Whether everything under `node` goes (then `path` itself is doomed instead of its children)."""
        if path in doomed:
            return True
        if not isinstance(node, yaml.MappingNode) or not node.value:
            return False
        all_gone = True
        for k, v in node.value:
            key = k.value if isinstance(k, yaml.ScalarNode) else None
            if key == OVERRIDE_MARKER and v.value in ("false", "False", "FALSE"):
                continue  # `_override_: false` alone changes nothing
            if key is None or not visit(v, path + (key,)):
                all_gone = False
        if all_gone and path and path != ("defaults",):
            for p in [p for p in doomed if p[: len(path)] == path]:
                doomed.discard(p)
            doomed.add(path)
            return True
        return False

    visit(root, ())
    return doomed


def _line_span(lines: list[str], key: yaml.Node, value: yaml.Node) -> tuple[int, int] | None:
    """0-based inclusive lines holding exactly `key: value`, or None when they hold something else too."""
    start = key.start_mark.line
    if lines[start][: key.start_mark.column].strip():
        return None  # something else precedes the key on its line
    end_mark = value.end_mark
    end = end_mark.line - 1 if end_mark.column == 0 and end_mark.line > start else end_mark.line
    end = min(end, len(lines) - 1)
    rest = lines[end][end_mark.column:] if end == end_mark.line else ""
    if rest.strip() and not rest.strip().startswith("#"):
        return None  # something follows the value on its last line
    return start, end


def _is_comment_or_blank(line: str) -> bool:
    s = line.strip()
    return not s or s.startswith("#")


def fix_minimality(path: str | os.PathLike) -> FixResult:
    """Delete the leaves of a recipe that repeat what it inherits (and any section they leave empty), keeping
    every other line as it was: whole-line comments and blank lines always stay (a comment at the end of a
    deleted key's line goes with it).

    Running it again changes nothing. The rewritten file is loaded again and must give the same merged
    config, else the original is put back and a GymvError says why.
    """
    path = Path(path)
    loaded = load_recipe(path, validate=False)
    redundant = check_minimal(loaded)
    if not redundant:
        return FixResult(path, (), 0, ())
    text = path.read_text(encoding="utf-8")
    lines = text.splitlines(keepends=True)
    root = yaml.compose(text, Loader=yaml.SafeLoader)
    doomed = {split_key(loaded.own.data, f.key) for f in redundant if f.key}
    doomed.discard(None)
    doomed = _prune_emptied(root, set(doomed))
    drop: set[int] = set()
    removed, left = [], []
    for p in sorted(doomed, key=lambda p: tuple(map(str, p))):
        hit = _node_at(root, p)
        span = None
        if hit is not None and not hit[0].flow_style:
            span = _line_span(lines, hit[1], hit[2])
        dotted_key = ".".join(map(str, p))
        if span is None:
            left.append(dotted_key)
            continue
        drop.update(i for i in range(span[0], span[1] + 1) if i == span[0] or not _is_comment_or_blank(lines[i]))
        removed.append(dotted_key)
    if not drop:
        return FixResult(path, (), 0, tuple(left))
    new_text = "".join(line for i, line in enumerate(lines) if i not in drop)
    mode = path.stat().st_mode
    atomic_write_text(path, new_text)
    os.chmod(path, mode & 0o7777)
    try:
        again = load_recipe(path, validate=False)
        same = same_value(again.raw, loaded.raw)
    except GymvError as e:
        same, err = False, e
    else:
        err = None
    if not same:
        atomic_write_text(path, text)
        os.chmod(path, mode & 0o7777)
        why = f"the result did not load: {err.one_line()}" if err else "it would change the merged config"
        raise GymvError(f"cannot fix minimality automatically: {why}; the file is unchanged", where=display_path(path),
                        fix="delete the redundant keys by hand")
    return FixResult(path, tuple(removed), len(drop), tuple(left))


def fixable_files(report: LintReport) -> list[Path]:
    """Recipe files with GV003 findings, in report order."""
    return [Path(p) for p in dict.fromkeys(f.path for f in report.findings if f.rule == "GV003")]
