"""Minimality: a recipe writes only what differs from what it inherits."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from gymv.findings import Finding
from gymv.config.loader import LoadedRecipe
from gymv.config.tree import OVERRIDE_MARKER, ConfigTree, dotted, get_path, strip_markers
from gymv.yamlfile import KeyPath

_MISSING = object()


def same_value(a: Any, b: Any) -> bool:
    """Equal as config values: numbers numerically (1 == 1.0), booleans only with booleans."""
    if isinstance(a, bool) or isinstance(b, bool):
        return type(a) is type(b) and a == b
    if isinstance(a, int | float) and isinstance(b, int | float):
        return a == b
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(same_value(a[k], b[k]) for k in a)
    if isinstance(a, list) and isinstance(b, list):
        return len(a) == len(b) and all(same_value(x, y) for x, y in zip(a, b))
    return type(a) is type(b) and a == b


def _own_units(data: Any, prefix: KeyPath = ()) -> Iterator[tuple[KeyPath, Any]]:
    """Leaves, except that an `_override_: true` section is one unit (its leaves are needed to rebuild it)."""
    if isinstance(data, dict) and data:
        if data.get(OVERRIDE_MARKER) is True and prefix:
            yield prefix, strip_markers(data)
            return
        for k, v in data.items():
            if k != OVERRIDE_MARKER:
                yield from _own_units(v, prefix + (k,))
    else:
        yield prefix, data


def redundant_leaves(own: ConfigTree, parents: ConfigTree) -> list[Finding]:
    out = []
    for path, value in _own_units(own.data):
        inherited = get_path(parents.data, path, _MISSING)
        if inherited is not _MISSING and same_value(value, inherited):
            key = dotted(path)
            src = parents.origins.get(path)
            out.append(Finding("recipe.minimal", f"`{key}` repeats the inherited value {value!r}"
                               + (f" (from {src})" if src else ""), key, str(own.origins.get(path) or ""),
                               "delete it"))
    return out


def check_minimal(loaded: LoadedRecipe) -> list[Finding]:
    """Leaves of the recipe's own file that equal what its parents already give."""
    return redundant_leaves(loaded.own, loaded.parent_view())
