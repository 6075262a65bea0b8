"""Which complete, documented exemplar each algorithm's recipes must inherit from, and where recipes live."""

from __future__ import annotations

import os
from functools import lru_cache
from pathlib import Path

from gymv.findings import Finding
from gymv.yamlfile import display_path

EXEMPLARS: dict[str, str] = {
    "sft": "sft.yaml",
    "vlm_sft": "sft.yaml",
    "grpo": "grpo.yaml",
    "vlm_grpo": "vlm_grpo.yaml",
    "mopd": "mopd.yaml",
    "vlm_mopd": "mopd.yaml",
}
RECIPE_DIRS: tuple[str, ...] = ("llm", "vlm")  # minimal recipes live below these, exemplars at the top


PACKAGED_SCHEME = "gymv://"  # `defaults: gymv://vlm_grpo.yaml` names a file of the recipes gymv ships


def _has_exemplars(d: Path) -> bool:
    return all((d / name).is_file() for name in set(EXEMPLARS.values()))


def packaged_recipes_root() -> Path:
    """The recipes gymv ships as package data (gymv/_recipes in an installed wheel)."""
    return Path(__file__).resolve().parents[1] / "_recipes"


def default_recipes_root() -> Path:
    """The recipes gymv ships: the source checkout's recipes/ when gymv runs from one, else the package data."""
    checkout = Path(__file__).resolve().parents[2] / "recipes"
    return checkout if _has_exemplars(checkout) or not packaged_recipes_root().is_dir() else packaged_recipes_root()


def project_recipes_dir(start: str | os.PathLike = ".") -> Path:
    """The recipes directory a command works on when given none: the nearest enclosing project's recipes/
    (from any sub-folder of it, or from inside recipes/ itself), else the recipes gymv ships."""
    p = Path(start).resolve()
    for d in [p, *p.parents]:
        if _looks_like_recipes(d / "recipes"):
            return Path("recipes") if d == Path.cwd().resolve() and start == "." else d / "recipes"
    return default_recipes_root()


def _looks_like_recipes(d: Path) -> bool:
    """A gymv recipes folder: it holds suite lists, drivers or the exemplars."""
    return d.is_dir() and ((d / "suites").is_dir() or (d / "drivers").is_dir() or _has_exemplars(d))


def resolve_parent(declaring: Path, text: str) -> Path:
    """The file a `defaults:` entry names: a path relative to the declaring file; `gymv://<file>` (a shipped
    recipe); or an exemplar's bare name (`vlm_grpo`, `grpo.yaml`) when no such file sits beside the recipe."""
    if text.startswith(PACKAGED_SCHEME):
        return (default_recipes_root() / text[len(PACKAGED_SCHEME):].lstrip("/")).resolve()
    local = (declaring.parent / text).resolve()
    if local.exists() or "/" in text or os.sep in text:
        return local
    name = text if text.endswith((".yaml", ".yml")) else f"{text}.yaml"
    if name in set(EXEMPLARS.values()):
        return (default_recipes_root() / name).resolve()
    return local


RECIPE_ROOTS_ENV = "GYMV_RECIPE_ROOTS"  # more folders `defaults:` may name, os.pathsep-separated (the user's opt-in)


PROJECT_MARKERS = (".git", "pyproject.toml")


def recipe_tree(recipe: Path) -> Path:
    """The tree a recipe's `defaults:` may reach into: its nearest enclosing recipes folder (one named
    `recipes`, or holding suites, drivers or the exemplars), else its project (the nearest folder with a
    .git or pyproject.toml), else the recipe's own folder."""
    parents = recipe.resolve().parents
    for d in parents:
        if d.name == "recipes" or _looks_like_recipes(d):
            return d
    for d in parents:
        if any((d / m).exists() for m in PROJECT_MARKERS):
            return d
    return recipe.resolve().parent


def defaults_roots(recipe: Path) -> list[Path]:
    """Where `defaults:` of `recipe` may point: its recipe tree, the shipped recipes, and the folders the user
    named in $GYMV_RECIPE_ROOTS."""
    extra = [Path(p).resolve() for p in os.environ.get(RECIPE_ROOTS_ENV, "").split(os.pathsep) if p.strip()]
    roots = [recipe_tree(recipe), default_recipes_root().resolve(), packaged_recipes_root().resolve(), *extra]
    return list(dict.fromkeys(roots))


def inside(path: Path, roots: list[Path]) -> bool:
    return any(path == r or path.is_relative_to(r) for r in roots)


def find_recipes_root(start: str | os.PathLike) -> Path | None:
    """The nearest enclosing directory that holds the exemplars (so lint works on a copied tree too)."""
    p = Path(start).resolve()
    for d in [p, *p.parents] if p.is_dir() else list(p.parents):
        if _has_exemplars(d):
            return d
    return None


def exemplar_path(algorithm: str, root: str | os.PathLike | None = None) -> Path:
    return Path(root or default_recipes_root()).resolve() / EXEMPLARS[algorithm]


def exemplar_paths(root: str | os.PathLike | None = None) -> list[Path]:
    return list(_exemplars_under(os.path.abspath(root or default_recipes_root())))


@lru_cache(maxsize=64)
def _exemplars_under(root: str) -> tuple[Path, ...]:
    """Resolved exemplar paths of an absolute root (cached: `gymv lint` asks once per recipe)."""
    r = Path(root).resolve()
    return tuple(r / n for n in dict.fromkeys(EXEMPLARS.values()))


def is_exemplar(path: str | os.PathLike, root: str | os.PathLike | None = None) -> bool:
    return Path(path).resolve() in exemplar_paths(root)


def recipe_files(root: str | os.PathLike | None = None) -> list[Path]:
    """Every minimal recipe (recipes/llm/**, recipes/vlm/**), sorted."""
    r = Path(root or default_recipes_root())
    return sorted(p for d in RECIPE_DIRS for p in (r / d).rglob("*.yaml"))


def check_inherits_exemplar(loaded, root: str | os.PathLike | None = None) -> list:
    """A recipe's `defaults:` chain must reach its algorithm's exemplar; an exemplar itself has no parents.

    `loaded` is a LoadedRecipe (typed loosely to keep this module free of the loader).
    """
    r = Path(root) if root else (find_recipes_root(loaded.path) or default_recipes_root())
    where = f"{display_path(loaded.path)}:1"
    if not loaded.parents and not is_exemplar(loaded.path, r):
        return [Finding("recipe.exemplar", "the recipe has no `defaults:`, so it inherits no exemplar", "defaults",
                        where, "add `defaults: ../<exemplar>.yaml` (the exemplar of its algorithm) and keep only what differs")]
    algo = loaded.raw.get("algorithm")
    if algo not in EXEMPLARS:
        return []  # the schema reports a bad algorithm
    want = exemplar_path(algo, r)
    if is_exemplar(loaded.path, r):
        if loaded.parents:
            return [Finding("recipe.exemplar", "an exemplar must be complete and inherit nothing", "defaults", where,
                            "remove `defaults:` and write every key")]
        return []
    if want.resolve() not in loaded.chain:  # the loader resolves every path of the chain
        return [Finding("recipe.exemplar", f"the `defaults:` chain does not reach {want.name}, the exemplar for {algo}",
                        "defaults", where, f"inherit {os.path.relpath(want, loaded.path.parent)} or a recipe that does")]
    return []
