"""A config tree that remembers where each key came from, with dotted-key access for loader, overrides and lint."""

from __future__ import annotations

import copy
import difflib
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from gymv.yamlfile import KeyPath, Origin

OVERRIDE_MARKER = "_override_"
_MISSING = object()
_ABSENT = object()


def dotted(path: KeyPath) -> str:
    return ".".join(str(p) for p in path)


def iter_leaves(data: Any, prefix: KeyPath = ()) -> Iterator[tuple[KeyPath, Any]]:
    """Leaves are scalars, lists and empty mappings: the units that merge by replacement."""
    if isinstance(data, dict) and data:
        for k, v in data.items():
            yield from iter_leaves(v, prefix + (k,))
    else:
        yield prefix, data


def iter_keys(data: Any, prefix: KeyPath = ()) -> Iterator[KeyPath]:
    """Every mapping key path, sections included (for close-match suggestions)."""
    if isinstance(data, dict):
        for k, v in data.items():
            yield prefix + (k,)
            yield from iter_keys(v, prefix + (k,))


def suggest(wrong: str, candidates: list[str]) -> str | None:
    match = difflib.get_close_matches(wrong, candidates, n=1, cutoff=0.6)
    return match[0] if match else None


def split_key(data: Any, key: str | KeyPath) -> KeyPath | None:
    """Turn a dotted key into a path through `data`, or None when it does not exist.

    A mapping may have keys that contain dots (the `smoke:` section does), so at each level the longest
    run of segments that is an existing key wins; digits index lists.
    """
    if isinstance(key, tuple):
        return key if get_path(data, key, _MISSING) is not _MISSING else None
    parts = key.split(".") if key else []
    path: list = []
    node = data
    i = 0
    while i < len(parts):
        if isinstance(node, dict):
            for j in range(len(parts), i, -1):
                cand = ".".join(parts[i:j])
                if cand in node:
                    path.append(cand)
                    node = node[cand]
                    i = j
                    break
            else:
                return None
        elif isinstance(node, list) and parts[i].isdigit() and int(parts[i]) < len(node):
            path.append(int(parts[i]))
            node = node[int(parts[i])]
            i += 1
        else:
            return None
    return tuple(path)


def get_path(data: Any, path: KeyPath, default: Any = _MISSING) -> Any:
    node = data
    for p in path:
        if isinstance(node, dict) and isinstance(p, str) and p in node:
            node = node[p]
        elif isinstance(node, list) and isinstance(p, int) and 0 <= p < len(node):
            node = node[p]
        elif default is _MISSING:
            raise KeyError(dotted(path))
        else:
            return default
    return node


def strip_markers(value: Any) -> Any:
    """A deep copy without `_override_` markers (they steer merging and never reach the result)."""
    if isinstance(value, dict):
        return {k: strip_markers(v) for k, v in value.items() if k != OVERRIDE_MARKER}
    if isinstance(value, list):
        return [strip_markers(v) for v in value]
    return copy.deepcopy(value)


@dataclass
class ConfigTree:
    """Plain nested data plus `origins`: key path -> Origin for every key (sections, leaves, list items)."""

    data: dict = field(default_factory=dict)
    origins: dict = field(default_factory=dict)

    def copy(self) -> "ConfigTree":
        return ConfigTree(copy.deepcopy(self.data), dict(self.origins))

    def path_of(self, key: str | KeyPath) -> KeyPath | None:
        return split_key(self.data, key)

    def has(self, key: str | KeyPath) -> bool:
        return self.path_of(key) is not None

    def get(self, key: str | KeyPath, default: Any = None) -> Any:
        path = self.path_of(key)
        return default if path is None else get_path(self.data, path)

    def origin(self, key: str | KeyPath) -> Origin | None:
        """Where `key` was last written; for a key that does not exist, where its nearest section was."""
        path = self.path_of(key)
        if path is None:
            return None
        while path:
            if path in self.origins:
                return self.origins[path]
            path = path[:-1]
        return None

    def nearest_origin(self, path: KeyPath) -> Origin | None:
        """Origin of the longest existing prefix of `path` (used to place errors about missing keys)."""
        for n in range(len(path), 0, -1):
            if path[:n] in self.origins:
                return self.origins[path[:n]]
        return None

    def leaves(self) -> Iterator[tuple[KeyPath, Any]]:
        return iter_leaves(self.data)

    def keys(self) -> list[str]:
        return [dotted(p) for p in iter_keys(self.data)]

    def _paths_under(self, path: KeyPath) -> Iterator[KeyPath]:
        """`path` and every key path below it in the data: what origins it can hold, found by walking the
        value rather than scanning every origin (a merge asks once per key: scanning made it quadratic)."""
        value = get_path(self.data, path, _ABSENT)
        return iter(()) if value is _ABSENT else _walk(value, path)  # origins exist only for keys in the data

    def drop_origins_under(self, path: KeyPath) -> None:
        for p in list(self._paths_under(path)):
            self.origins.pop(p, None)

    def origins_under(self, path: KeyPath) -> dict:
        return {p: self.origins[p] for p in self._paths_under(path) if p in self.origins and OVERRIDE_MARKER not in p}


def _walk(value: Any, path: KeyPath) -> Iterator[KeyPath]:
    yield path
    items = value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, list) else ()
    for k, v in items:
        yield from _walk(v, path + (k,))
