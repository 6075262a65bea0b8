"""Suite lists (`recipes/suites/*.txt`), their GPU-hour budgets, and the recipe <-> driver mapping.

A suite file lists one recipe per line, relative to the recipes directory (`llm/x.yaml`; a leading
`recipes/` is accepted too), with `#` comments. Entries of `disabled.txt` must say why on the same line;
the loader keeps that comment as data (`SuiteEntry.reason`) so that `gymv lint` can report a missing one.
"""

from __future__ import annotations

from dataclasses import dataclass
from fractions import Fraction
from pathlib import Path, PurePosixPath

import yaml

from gymv.errors import GymvError
from gymv.yaml_bounds import safe_load

SUITES_DIR = "suites"
DRIVERS_DIR = "drivers"
BUDGETS_FILE = "budgets.yaml"
GPUS_PER_NODE_FILE = "gpus_per_node.yaml"
DISABLED_SUITE = "disabled"
RECIPE_SUFFIXES = (".yaml", ".yml")


@dataclass(frozen=True)
class SuiteEntry:
    """One recipe line of a suite file."""

    suite: str
    recipe: str  # normalised, relative to the recipes directory: "llm/x.yaml"
    file: Path
    line: int
    reason: str | None  # the same-line '#' comment, stripped; None when there is none

    @property
    def where(self) -> str:
        return f"{self.file}:{self.line}"


@dataclass(frozen=True)
class Suite:
    name: str
    path: Path
    entries: tuple[SuiteEntry, ...]

    @property
    def disabled(self) -> bool:
        return self.name == DISABLED_SUITE


def _strip_comment(line: str) -> tuple[str, str | None]:
    """Split at the first '#' that starts a word (as a shell would); a path may still contain '#' mid-word."""
    for i, c in enumerate(line):
        if c == "#" and (i == 0 or line[i - 1] in " \t"):
            comment = line[i + 1:].strip()
            return line[:i].strip(), comment or None
    return line.strip(), None


def normalize_recipe(written: str, recipes_dir: Path, *, where: str) -> str:
    """`recipes/llm/x.yaml`, `./llm/x.yaml` and `llm/x.yaml` all name `llm/x.yaml`."""
    p = PurePosixPath(written)
    if p.is_absolute() or "\\" in written:
        raise GymvError(f"suite entry {written!r} must be a path relative to the recipes directory", where=where,
                        fix="write it as llm/<name>.yaml")
    parts = [s for s in p.parts if s != "."]
    if parts and parts[0] in ("recipes", recipes_dir.name) and len(parts) > 1:
        parts = parts[1:]
    if not parts or ".." in parts:
        raise GymvError(f"suite entry {written!r} points outside the recipes directory", where=where,
                        fix="write it as llm/<name>.yaml")
    if not parts[-1].endswith(RECIPE_SUFFIXES):
        raise GymvError(f"suite entry {written!r} is not a recipe .yaml path", where=where,
                        fix="list recipes (llm/<name>.yaml), or only driver .sh paths as NeMo RL's suite lists do "
                            "(gymv dry-run reads those)")
    return "/".join(parts)


def load_suite(path: str | Path, recipes_dir: str | Path | None = None) -> Suite:
    path = Path(path)
    recipes_dir = Path(recipes_dir) if recipes_dir is not None else path.parent.parent
    name = path.stem
    entries = []
    for lineno, body, comment in _entries(path):
        where = f"{path}:{lineno}"
        if len(body.split()) > 1:
            raise GymvError(f"more than one path on a line: {body!r}", where=where, fix="put one recipe per line")
        entries.append(SuiteEntry(name, normalize_recipe(body, recipes_dir, where=where), path, lineno, comment))
    return Suite(name, path, tuple(entries))


DRIVER_SUFFIX = ".sh"


@dataclass(frozen=True)
class DriverEntry:
    """One line of a suite list that names a driver script (NeMo RL's own lists do: tests/test_suites/llm/x.sh)."""

    written: str
    driver: Path
    file: Path
    line: int

    @property
    def where(self) -> str:
        return f"{self.file}:{self.line}"


def _entries(path: Path) -> list[tuple[int, str, str]]:
    """(line number, entry, comment) of each non-blank line of a suite list."""
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise GymvError("suite file not found", where=str(path), fix="check the suite name") from None
    except (OSError, UnicodeDecodeError) as e:
        raise GymvError(f"cannot read suite file: {e}", where=str(path),
                        fix="check that the suite file exists and is readable") from None
    out = []
    for lineno, raw in enumerate(text.splitlines(), 1):
        body, comment = _strip_comment(raw)
        if body:
            out.append((lineno, body, comment))
    return out


def is_driver_suite(path: str | Path) -> bool:
    """A suite list whose entries are all driver scripts (.sh), as NeMo RL writes them."""
    entries = _entries(Path(path))
    return bool(entries) and all(body.endswith(DRIVER_SUFFIX) for _, body, _ in entries)


def resolve_listed_driver(written: str, suite_file: Path) -> Path | None:
    """Where a listed driver is: the path as written, relative to the suite file's folder or to any folder above
    it (NeMo RL writes paths from its repository root), else relative to the working directory."""
    p = Path(written)
    if p.is_absolute():
        return p if p.is_file() else None
    folder = Path(suite_file).resolve().parent
    for base in [folder, *folder.parents]:
        if (base / p).is_file():
            return base / p
    return p if p.is_file() else None


def load_driver_suite(path: str | Path) -> list[DriverEntry]:
    """The drivers a NeMo-RL-style suite list names, each resolved to a file; a missing one is an error at its line."""
    path = Path(path)
    out = []
    for lineno, body, _ in _entries(path):
        where = f"{path}:{lineno}"
        if len(body.split()) > 1:
            raise GymvError(f"more than one path on a line: {body!r}", where=where, fix="put one driver per line")
        driver = resolve_listed_driver(body, path)
        if driver is None:
            raise GymvError(f"driver {body} not found (looked beside {path.parent} and in the folders above it)",
                            where=where, fix="fix the path or run from the repository the list belongs to")
        out.append(DriverEntry(body, driver, path, lineno))
    return out


def suite_files(recipes_dir: str | Path) -> list[Path]:
    d = Path(recipes_dir) / SUITES_DIR
    return sorted(d.glob("*.txt")) if d.is_dir() else []


def load_suites(recipes_dir: str | Path) -> dict[str, Suite]:
    """Every suite under `<recipes_dir>/suites/`, by name, in name order (disabled included)."""
    recipes_dir = Path(recipes_dir)
    return {p.stem: load_suite(p, recipes_dir) for p in suite_files(recipes_dir)}


def entries_missing_reason(suite: Suite) -> list[SuiteEntry]:
    """Entries of the disabled suite that do not say why they are disabled."""
    return [e for e in suite.entries if e.reason is None] if suite.disabled else []


def duplicate_entries(suite: Suite) -> list[tuple[SuiteEntry, SuiteEntry]]:
    """(repeat, first occurrence) for each recipe listed twice in one suite."""
    first: dict[str, SuiteEntry] = {}
    out = []
    for e in suite.entries:
        if e.recipe in first:
            out.append((e, first[e.recipe]))
        else:
            first[e.recipe] = e
    return out


def load_budgets(recipes_dir: str | Path) -> dict[str, Fraction]:
    """Suite name -> GPU-hour budget from `<recipes_dir>/suites/budgets.yaml` (absent file: no budgets).

    Budgets are returned as exact fractions (parsed from their decimal text), so that comparing a suite's
    exact GPU-hours against them never depends on float rounding.
    """
    path = Path(recipes_dir) / SUITES_DIR / BUDGETS_FILE
    if not path.is_file():
        return {}
    text = path.read_text(encoding="utf-8")
    data = safe_load(text, str(path))  # bounded: an alias bomb is refused, not expanded
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise GymvError("budgets must be a mapping of suite name to GPU-hours", where=str(path),
                        fix="write lines like 'nightly: 1200'")
    budgets: dict[str, Fraction] = {}
    for name, value in data.items():
        if isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0:
            line = next((i for i, t in enumerate(text.splitlines(), 1) if t.split(":", 1)[0].strip() == str(name)), None)
            raise GymvError(f"budget for {name!r} must be a non-negative number of GPU-hours, got {value!r}",
                            where=f"{path}:{line}" if line else f"{path} key {name}", fix=f"write '{name}: 1200'")
        budgets[str(name)] = Fraction(str(value))
    return budgets


@dataclass(frozen=True)
class SuiteGpus:
    """The GPUS_PER_NODE values a suite's drivers may set (its machines; 0 = a CPU-only job), and where."""

    allowed: tuple[int, ...]
    where: str


def load_gpus_per_node(recipes_dir: str | Path) -> dict[str, SuiteGpus]:
    """Suite name -> allowed GPUS_PER_NODE, from `<recipes_dir>/suites/gpus_per_node.yaml` (absent: none).

    Each value is a whole number or a list of them, e.g. `nightly: [0, 8]` (CPU jobs and 8-GPU nodes).
    """
    path = Path(recipes_dir) / SUITES_DIR / GPUS_PER_NODE_FILE
    if not path.is_file():
        return {}
    fix = "write lines like 'nightly: [0, 8]' (suite name: GPUs per node, or a list of them)"
    try:
        root = yaml.compose(path.read_text(encoding="utf-8"), Loader=yaml.SafeLoader)
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f"{path}:{mark.line + 1}" if mark is not None else str(path)
        raise GymvError(f"invalid YAML: {getattr(e, 'problem', None) or e}", where=where,
                        fix="fix the YAML syntax") from None
    except (OSError, UnicodeDecodeError) as e:
        raise GymvError(f"cannot read: {e}", where=str(path),
                        fix="check that the file exists and is readable") from None
    if root is None:
        return {}
    if not isinstance(root, yaml.MappingNode):
        raise GymvError("GPUs per node must be a mapping of suite name to GPUs per node", where=f"{path}:1", fix=fix)
    out: dict[str, SuiteGpus] = {}
    for k, v in root.value:
        where = f"{path}:{k.start_mark.line + 1}"
        items = v.value if isinstance(v, yaml.SequenceNode) else [v]
        allowed = []
        for item in items:
            text = item.value if isinstance(item, yaml.ScalarNode) and item.tag.endswith(":int") else None
            if text is None or not text.isdigit():
                shown = repr(item.value) if isinstance(item, yaml.ScalarNode) else "a nested collection"
                raise GymvError(f"GPUs per node of suite {k.value!r} must be whole numbers >= 0, got {shown}",
                                where=f"{path}:{item.start_mark.line + 1}", fix=fix)
            allowed.append(int(text))
        if not allowed:
            raise GymvError(f"suite {k.value!r} allows no GPUs-per-node value", where=where, fix=fix)
        out[str(k.value)] = SuiteGpus(tuple(allowed), where)
    return out


def driver_for_recipe(recipes_dir: str | Path, recipe: str) -> Path:
    """`llm/x.yaml` -> `<recipes_dir>/drivers/llm/x.sh` (the 1:1 naming rule)."""
    rel = PurePosixPath(recipe)
    return Path(recipes_dir) / DRIVERS_DIR / rel.with_suffix(".sh")


def recipe_for_driver(recipes_dir: str | Path, driver: str | Path) -> str | None:
    """`<recipes_dir>/drivers/llm/x.sh` -> `llm/x.yaml`, or None for a driver outside the drivers directory."""
    drivers = (Path(recipes_dir) / DRIVERS_DIR).resolve()
    try:
        rel = Path(driver).resolve().relative_to(drivers)
    except ValueError:
        return None
    for suffix in RECIPE_SUFFIXES:
        recipe = PurePosixPath(rel.as_posix()).with_suffix(suffix).as_posix()
        if (Path(recipes_dir) / recipe).is_file():
            return recipe
    return PurePosixPath(rel.as_posix()).with_suffix(".yaml").as_posix()


def recipe_path(recipes_dir: str | Path, recipe: str) -> Path:
    return Path(recipes_dir) / PurePosixPath(recipe)
