"""Load a recipe: inherit (`defaults:`), apply overrides, interpolate, validate, check compatibility.

`load_recipe` is what `gymv train`, `gymv smoke` and `gymv lint` call. The result keeps every stage
(raw merged tree, resolved data, validated model) and where each key was written.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from dataclasses import dataclass, field
from functools import cached_property, partial
from pathlib import Path
from typing import Any

from gymv.config.compat import check_compatibility
from gymv.findings import Finding, raise_first_error
from gymv.config.inherit import Composed, compose
from gymv.config.interpolate import interpolation_errors, resolve
from gymv.config.overrides import Override, apply_overrides, as_overrides, smoke_overrides
from gymv.config.schema import RecipeBase
from gymv.config.tree import ConfigTree
from gymv.config.validate import schema_findings, schema_has_key
from gymv.yamlfile import KeyPath, Origin, display_path
from gymv.errors import GymvError


@dataclass
class LoadedRecipe:
    path: Path
    composed: Composed
    tree: ConfigTree  # merged + overrides, uninterpolated, with origins
    overrides: list[Override] = field(default_factory=list)

    @property
    def chain(self) -> list[Path]:
        """Every file applied, parents first (depth-first, in `defaults:` order), this file last."""
        return self.composed.chain

    @property
    def parents(self) -> list[Path]:
        """The files this recipe's own `defaults:` names, resolved."""
        return self.composed.parent_paths

    @property
    def raw(self) -> dict:
        return self.tree.data

    @property
    def own(self) -> ConfigTree:
        """Only the keys this file writes itself (without `defaults`)."""
        return self.composed.own

    def parent_view(self) -> ConfigTree:
        """The recipe as its parents alone make it: what each of its own leaves would be without it."""
        return self.composed.parents

    @property
    def where(self) -> str:
        return display_path(self.path)

    def origin(self, key: str | KeyPath) -> Origin | None:
        """(file, line) that last wrote `key` (an override names "<command line>")."""
        return self.tree.origin(key)

    def locate(self, path: KeyPath) -> Origin | None:
        """Like origin(), but a missing key falls back to its nearest written section, else the file."""
        return self.tree.nearest_origin(path) or Origin(self.where, None)

    @cached_property
    def resolved(self) -> dict:
        """Data with `${...}` resolved and `name` defaulted to the file stem; raises GymvError."""
        data = resolve(self.tree)
        if data.get("name") is None:
            data["name"] = self.path.stem
        return data

    @cached_property
    def validated(self) -> RecipeBase:
        """The pydantic model; raises the first schema or compatibility error as a GymvError."""
        cfg, findings = schema_findings(self.resolved, self.locate, self.where)
        raise_first_error(findings)
        assert cfg is not None
        raise_first_error(check_compatibility(cfg, self.locate))
        return cfg

    @cached_property
    def checked(self) -> tuple[RecipeBase | None, list[Finding]]:
        """(the schema-valid model or None, every finding), never raising: a model with compatibility
        errors is still returned, so `gymv lint` can run its name and driver rules on it."""
        try:
            data = self.resolved
        except GymvError as e:
            errors = interpolation_errors(self.tree) or [e]
            return None, [Finding("interpolation", x.message, None, x.where, x.fix) for x in errors]
        cfg, found = schema_findings(data, self.locate, self.where)
        if cfg is not None:
            found += check_compatibility(cfg, self.locate)
        return cfg, found

    def findings(self) -> list[Finding]:
        """Every problem (schema, compatibility, interpolation) without raising; for `gymv lint`."""
        return list(self.checked[1])


def load_recipe(path: str | os.PathLike, overrides: Iterable[str | Override] = (), *, smoke: bool = False,
                validate: bool = True, cache: dict | None = None) -> LoadedRecipe:
    """Load, merge and (by default) validate a recipe; any problem raises a one-line GymvError.

    `overrides` are applied after the recipe's `smoke:` section (when `smoke`), so the command line wins.
    With `validate=False` only YAML/inheritance/override errors raise; `findings()` lists the rest.
    `cache` (an empty dict kept across calls) loads each shared parent file once.
    """
    path = Path(path)
    composed = compose(path, cache=cache)
    ovs = (smoke_overrides(composed.tree) if smoke else []) + as_overrides(overrides)
    known = partial(schema_has_key, composed.tree.data)
    tree = apply_overrides(composed.tree, ovs, known) if ovs else composed.tree
    loaded = LoadedRecipe(path=path.resolve(), composed=composed, tree=tree, overrides=ovs)
    if validate:
        loaded.validated  # noqa: B018 - raises on the first problem
    return loaded


def load_config(path: str | os.PathLike, overrides: Iterable[str | Override] = (), *, smoke: bool = False) -> RecipeBase:
    """Shortcut for commands that only need the validated config."""
    return load_recipe(path, overrides, smoke=smoke).validated


def resolved_dict(path: str | os.PathLike, overrides: Iterable[str | Override] = ()) -> dict[str, Any]:
    """The complete resolved config (schema defaults filled in), as written to a run directory."""
    return load_config(path, overrides).to_dict()
