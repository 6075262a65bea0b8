"""What `gymv smoke` runs: recipes named directly or through suites, each with its driver (if any), and how
each one is turned into a short run: a resolved recipe file with the smoke settings, validated before it runs.

The run gets exactly the config that was validated here: the recipe is loaded with its `smoke:` section and
the command-line overrides, `--steps` and `--tiny` are applied to the resolved config, and the result is
written as a complete recipe (no `defaults:`) that `gymv train` then runs in its own process.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from gymv.capabilities import gaps
from gymv.checks.sources import CheckSource, driver_checks, recipe_checks
from gymv.config import load_recipe
from gymv.config.exemplars import find_recipes_root
from gymv.errors import GymvError
from gymv.io import atomic_write_text
from gymv.recipes.drivers import parse_driver
from gymv.recipes.suites import SUITES_DIR, driver_for_recipe, load_suite
from gymv.smoke.tiny import VLLM_CPU_REFUSED, tiny_config, vllm_runs_here
from gymv.yamlfile import display_path, parse_yaml

DEFAULT_STEPS = 2  # when neither --steps nor the recipe's smoke: section says how many


@dataclass(frozen=True)
class SmokeTarget:
    recipe: Path
    suite: str | None = None
    driver: Path | None = None

    @property
    def shown(self) -> str:
        return display_path(self.recipe)


def _driver_for(recipe: Path) -> Path | None:
    root = find_recipes_root(recipe.resolve().parent)
    if root is None:
        return None
    try:
        rel = recipe.resolve().relative_to(root).as_posix()
    except ValueError:
        return None
    d = driver_for_recipe(root, rel)
    return d if d.is_file() else None


def resolve_targets(targets: list[str], recipes_dir: str | os.PathLike = "recipes") -> list[SmokeTarget]:
    """Recipes (.yaml), suite files (.txt) and suite names (recipes/suites/<name>.txt), in order, each once."""
    recipes_dir = Path(recipes_dir)
    if not targets:
        raise GymvError("nothing to run", fix="name a recipe (.yaml) or a suite (nightly, release, a suites/*.txt file)")
    out: list[SmokeTarget] = []
    seen: set[str] = set()

    def add(path: Path, suite: str | None) -> None:
        key = os.path.abspath(path)
        if key not in seen:
            seen.add(key)
            out.append(SmokeTarget(path, suite, _driver_for(path)))

    for t in targets:
        p = Path(t)
        if p.is_file() and p.suffix in (".yaml", ".yml"):
            add(p, None)
        elif p.is_file() and p.suffix == ".txt":
            suite = load_suite(p, p.resolve().parent.parent)
            for e in suite.entries:
                add(p.resolve().parent.parent / e.recipe, suite.name)
        elif (recipes_dir / SUITES_DIR / f"{t}.txt").is_file():
            suite = load_suite(recipes_dir / SUITES_DIR / f"{t}.txt", recipes_dir)
            for e in suite.entries:
                add(recipes_dir / e.recipe, suite.name)
        else:
            known = sorted(f.stem for f in (recipes_dir / SUITES_DIR).glob("*.txt"))
            raise GymvError(f"{t!r} is neither a recipe file nor a suite", where=t,
                            fix=f"pass a .yaml recipe, a suite .txt file, or a suite name ({', '.join(known) or 'none found'})")
    return out


@dataclass
class PreparedRun:
    """A recipe made ready for its smoke run."""

    target: SmokeTarget
    name: str
    algorithm: str
    max_steps: int
    steps_from: str  # "--steps", "smoke:" or "default"
    config_file: Path
    run_dir: Path
    checks: list[CheckSource]
    driver_checks: list[CheckSource] = field(default_factory=list)
    driver_max_steps: int | None = None
    tiny_changes: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    origins: dict[int, str] = field(default_factory=dict)  # line of config_file -> where the recipe wrote that key

    def explain(self, text: str) -> str:
        """Point a `config_file:LINE: ...` message at the recipe line that wrote that key as well."""
        prefix = f"{self.config_file}:"
        if not text.startswith(prefix):
            return text
        line, _, rest = text[len(prefix):].partition(":")
        origin = self.origins.get(int(line)) if line.isdigit() else None
        return f"{origin} (run as {self.config_file}:{line}):{rest}" if origin else text


def _escape_interpolation(value):
    """Resolved text may hold a literal `${`; written back as a recipe it must stay literal."""
    if isinstance(value, str):
        return value.replace("${", "\\${")
    if isinstance(value, dict):
        return {k: _escape_interpolation(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_escape_interpolation(v) for v in value]
    return value


def run_name(target: SmokeTarget, taken: set[str]) -> str:
    base = re.sub(r"[^A-Za-z0-9._=+-]", "_", target.recipe.stem) or "recipe"
    name, n = base, 2
    while name in taken:
        name, n = f"{base}-{n}", n + 1
    taken.add(name)
    return name


def _origins(rec, text: str, where: str) -> dict[int, str]:
    out = {}
    for path, line in parse_yaml(text, where).lines.items():
        try:
            origin = rec.origin(path)
        except (KeyError, TypeError):  # a key the schema or the smoke settings added: the recipe never wrote it
            continue
        if origin is not None and origin.line:
            out[line] = str(origin)
    return out


def stand_in_notes(cfg, tiny: dict) -> list[str]:
    """What a --tiny run says about itself: it checks the plumbing with stand-ins, and which of the recipe's
    own settings gymv train could not run here at all (gymv.capabilities), so a pass is not read as more."""
    generation = tiny["generation"]["backend"]
    engine = ("vLLM's CPU build as the vllm generation backend" if generation == "vllm"
              else f"the {generation} generation")
    notes = [f"--tiny checks the plumbing with stand-ins ({tiny['model']['path']} on a CPU, {engine} and the "
             f"{tiny['training']['backend']} training backend, small sizes), not that the recipe itself runs"]
    notes += [f"stand-in for what gymv train cannot run here: {g}" for g in gaps(cfg)]
    arch = str(tiny["model"]["path"]).removeprefix("embedded:")
    mopd = getattr(cfg, "mopd", None)
    teachers = mopd.teachers.values() if mopd is not None else ()
    asked = cfg.generation.backend == "vllm" or any(t.backend == "vllm" for t in teachers)
    if asked and arch in VLLM_CPU_REFUSED and vllm_runs_here():
        notes.append(f"vLLM's CPU build cannot run {arch} ({VLLM_CPU_REFUSED[arch]}): hf generates and torch "
                     "teachers score in its place")
    return notes


def prepare_run(target: SmokeTarget, *, out_dir: str | os.PathLike, name: str, overrides: list[str] = (),
                steps: int | None = None, tiny: bool = False) -> PreparedRun:
    """Load, shrink and validate one recipe; a problem is a GymvError naming the recipe's file and line."""
    out_dir = Path(out_dir)
    rec = load_recipe(target.recipe, list(overrides), smoke=True)
    cfg = rec.validated
    base = cfg.base_algorithm
    d = cfg.to_dict()
    smoke_keys = {str(k).lstrip("+") for k in (rec.raw.get("smoke") or {})}
    if steps is not None:
        d[base]["max_steps"], steps_from = int(steps), "--steps"
    elif f"{base}.max_steps" in smoke_keys:
        steps_from = "smoke:"
    else:
        d[base]["max_steps"], steps_from = min(int(d[base]["max_steps"]), DEFAULT_STEPS), "default"
    changes: list[str] = []
    if tiny:
        d, changes = tiny_config(d, cfg.algorithm)
    d["name"] = name
    d["checkpoint"].update({"dir": str(out_dir), "resume": False, "steps_per_run": None})
    d.pop("smoke", None)
    run_dir = out_dir / name
    if run_dir.exists() and any(run_dir.iterdir()):
        raise GymvError("run directory already exists", where=str(run_dir), fix="pick another --out folder")
    out_dir.mkdir(parents=True, exist_ok=True)
    config_file = out_dir / f"{name}.recipe.yaml"
    header = f"# gymv smoke: {target.shown} resolved{' with --tiny' if tiny else ''}; runs as written here\n"
    text = header + yaml.safe_dump(_escape_interpolation(d), sort_keys=False, allow_unicode=True)
    atomic_write_text(config_file, text)
    try:
        load_recipe(config_file)  # what will run must validate: --tiny or --steps could have broken a rule
    except GymvError as e:
        raise GymvError(f"after the smoke settings{' and --tiny' if tiny else ''}: {e.message}", where=e.where,
                        fix=e.fix) from None

    prepared = PreparedRun(target, name, cfg.algorithm, int(d[base]["max_steps"]), steps_from, config_file, run_dir,
                           recipe_checks(rec), tiny_changes=changes, origins=_origins(rec, text, str(config_file)))
    if tiny:
        prepared.notes.extend(stand_in_notes(cfg, d))
    if target.driver is not None:
        try:
            prepared.driver_checks = driver_checks(target.driver)
            if prepared.driver_checks:
                prepared.driver_max_steps = parse_driver(target.driver).max_steps
        except GymvError as e:
            prepared.notes.append(f"driver checks not read: {e.one_line()}")
    return prepared
