"""Which complete, documented exemplar each algorithm's recipes must inherit from, and where recipes live."""

from __future__ import annotations

import os
from functools import lru_cache
from pathlib import Path

EXEMPLARS: dict[str, str] = {
    "sft": "sft.yaml",
    "vlm_sft": "sft.yaml",
    "grpo": "grpo.yaml",
    "vlm_grpo": "vlm_grpo.yaml",
    "mopd": "mopd.yaml",
    "vlm_mopd": "mopd.yaml",
}
RECIPE_DIRS: tuple[str, ...] = ("llm", "vlm")  # minimal recipes live below these, exemplars at the top


def default_recipes_root() -> Path:
    """The repository's recipes/ (next to the gymv package in a source checkout)."""
    return Path(__file__).resolve().parents[2] / "recipes"


def find_recipes_root(start: str | os.PathLike) -> Path | None:
    """The nearest enclosing directory that holds the exemplars (so lint works on a copied tree too)."""
    p = Path(start).resolve()
    for d in [p, *p.parents] if p.is_dir() else list(p.parents):
        if all((d / name).is_file() for name in set(EXEMPLARS.values())):
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
    from gymv.config.findings import Finding
    from gymv.config.yamlfile import display_path

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
