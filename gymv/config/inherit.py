"""`defaults:` inheritance: parents first (depth-first, in list order), later wins, mappings deep-merge.

Lists and scalars replace what they inherit; a mapping marked `_override_: true` replaces the inherited
section instead of merging into it. Every key keeps the Origin of the file that last wrote it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from gymv.config.exemplars import (PACKAGED_SCHEME, RECIPE_ROOTS_ENV, default_recipes_root, defaults_roots, inside,
                                   resolve_parent)
from gymv.config.tree import OVERRIDE_MARKER, ConfigTree, dotted, strip_markers
from gymv.yamlfile import KeyPath, Origin, display_path, read_yaml_mapping
from gymv.errors import GymvError

DEFAULTS_KEY = "defaults"
MAX_DEPTH = 64  # files in one line of `defaults:` ancestry (exemplar -> recipe is 2 or 3)


@dataclass
class Composed:
    """One file with its ancestry merged in.

    `tree` is the merged result, `parents` what the `defaults:` alone produce (the recipe without its own
    keys), `own` the file's own keys, `chain` every file in the order it was applied (parents first).
    """

    path: Path
    tree: ConfigTree
    parents: ConfigTree
    own: ConfigTree
    chain: list[Path] = field(default_factory=list)
    parent_paths: list[Path] = field(default_factory=list)

    @property
    def chain_set(self) -> frozenset:
        return frozenset(self.chain)


def _own_tree(path: Path, data: dict, lines: dict) -> ConfigTree:
    where = display_path(path)
    origins = {p: Origin(where, line) for p, line in lines.items() if p and p[0] != DEFAULTS_KEY}
    own = {k: v for k, v in data.items() if k != DEFAULTS_KEY}
    _check_markers(own, (), origins, where)
    if OVERRIDE_MARKER in own:
        raise GymvError(f"`{OVERRIDE_MARKER}` at the top level would discard every parent",
                        where=str(origins.get((OVERRIDE_MARKER,), where)),
                        fix=f"put `{OVERRIDE_MARKER}: true` inside the section to replace, or drop `defaults:`")
    return ConfigTree(own, origins)


def _check_markers(data: Any, prefix: KeyPath, origins: dict, where: str) -> None:
    if isinstance(data, dict):
        for k, v in data.items():
            if k == OVERRIDE_MARKER and not isinstance(v, bool):
                raise GymvError(f"`{dotted(prefix + (k,))}` must be true or false, got {v!r}",
                                where=str(origins.get(prefix + (k,), where)), fix=f"write `{OVERRIDE_MARKER}: true`")
            _check_markers(v, prefix + (k,), origins, where)
    elif isinstance(data, list):
        for i, v in enumerate(data):
            _check_markers(v, prefix + (i,), origins, where)


def _defaults_entries(path: Path, data: dict, lines: dict) -> list[tuple[Path, str, int]]:
    """The parent files a file declares: (resolved path, text as written, line)."""
    if DEFAULTS_KEY not in data:
        return []
    where = display_path(path)
    value = data[DEFAULTS_KEY]
    key_line = lines.get((DEFAULTS_KEY,), 1)
    fix = "write `defaults: ../grpo.yaml` (relative to this file), `defaults: grpo` (a shipped exemplar) or a list"
    if value is None:
        return []
    if isinstance(value, str):
        items = [(value, key_line)]
    elif isinstance(value, list):
        items = [(v, lines.get((DEFAULTS_KEY, i), key_line)) for i, v in enumerate(value)]
    else:
        raise GymvError(f"`defaults` must be a path or a list of paths, got a {type(value).__name__}",
                        where=f"{where}:{key_line}", fix=fix)
    out = []
    for text, line in items:
        if not isinstance(text, str) or not text.strip():
            raise GymvError(f"`defaults` entry {text!r} is not a path", where=f"{where}:{line}", fix=fix)
        out.append((resolve_parent(path, text), text, line))
    return out


def _check_confined(parent: Path, text: str, where: str, top: Path) -> None:
    """A recipe names parents in its own tree or gymv's shipped recipes: another file of the machine is never
    read on a recipe's word (a recipe may come from anyone), only where the user allowed its folder."""
    if text.startswith(PACKAGED_SCHEME):
        shipped = default_recipes_root().resolve()
        if not inside(parent, [shipped]):
            raise GymvError(f"`defaults` entry {text!r} leaves gymv's shipped recipes ({display_path(shipped)})",
                            where=where, fix="name a file under the shipped recipes, e.g. gymv://vlm_grpo.yaml")
        return
    roots = defaults_roots(top)
    if not inside(parent, roots):
        allowed = ", ".join(display_path(r) for r in roots)
        raise GymvError(f"`defaults` entry {text!r} ({display_path(parent)}) is outside the recipe tree; "
                        f"allowed roots: {allowed}", where=where,
                        fix=f"copy the file into the recipe tree, or allow its folder: {RECIPE_ROOTS_ENV}=DIR")


def merge(base: ConfigTree, over: ConfigTree) -> ConfigTree:
    """Apply `over` on top of `base` (both unchanged); returns the merged tree."""
    if not base.data and not base.origins:  # the first parent: a copy of it, without markers
        return ConfigTree(strip_markers(over.data), {p: o for p, o in over.origins.items() if OVERRIDE_MARKER not in p})
    out = base.copy()
    _merge_into(out, out.data, over, over.data, ())
    return out


def _merge_into(out: ConfigTree, dst: dict, over: ConfigTree, src: dict, prefix: KeyPath) -> None:
    for k, v in src.items():
        if k == OVERRIDE_MARKER:
            continue
        path = prefix + (k,)
        if isinstance(v, dict) and v.get(OVERRIDE_MARKER) is not True and isinstance(dst.get(k), dict):
            if path in over.origins:
                out.origins[path] = over.origins[path]
            _merge_into(out, dst[k], over, v, path)
        else:
            out.drop_origins_under(path)
            dst[k] = strip_markers(v)
            out.origins.update(over.origins_under(path))


def compose(path: str | Path, _stack: tuple[Path, ...] = (), cache: dict[Path, Composed] | None = None) -> Composed:
    """Load `path` and everything its `defaults:` name, merged; raises GymvError on any bad input.

    `cache` (resolved path -> Composed), shared across calls, loads each parent once when many recipes
    inherit the same files (`gymv lint`); results are never mutated, so sharing them is safe. Without one, a
    cache private to this call still resolves every file once (a `defaults:` diamond is linear, not
    exponential).
    """
    path = Path(path).resolve()
    if cache is None:
        cache = {}  # even for one recipe: a `defaults:` diamond reaches the same file by many paths
    if len(_stack) >= MAX_DEPTH:
        raise GymvError(f"`defaults` chain deeper than {MAX_DEPTH} files", where=display_path(_stack[-1]),
                        fix="inherit from an exemplar in a few steps")
    hit = cache.get(path)
    if hit is not None and hit.chain_set.isdisjoint(_stack):
        return hit  # a chain that meets the stack is a cycle: compose again below to report it
    doc = read_yaml_mapping(path)
    parents = ConfigTree()
    chain: list[Path] = []
    seen: set[Path] = set()  # each file once in the chain, however many parents share it
    parent_paths: list[Path] = []
    stack = _stack + (path,)
    for parent, text, line in _defaults_entries(path, doc.data, doc.lines):
        where = f"{display_path(path)}:{line}"
        if parent in stack:
            cycle = " -> ".join(display_path(p) for p in stack[stack.index(parent):] + (parent,))
            raise GymvError(f"`defaults` cycle: {cycle}", where=where,
                            fix="remove one of these `defaults` entries so the chain ends at an exemplar")
        _check_confined(parent, text, where, stack[0])
        if not parent.exists():
            raise GymvError(f"parent recipe {text!r} not found (looked for {display_path(parent)})", where=where,
                            fix="paths in `defaults` are relative to the file that declares them")
        if not parent.is_file():
            raise GymvError(f"parent recipe {text!r} is not a regular file ({display_path(parent)})", where=where,
                            fix="`defaults` names YAML files")
        sub = compose(parent, stack, cache)
        parents = merge(parents, sub.tree)
        chain.extend(p for p in sub.chain if p not in seen)
        seen.update(sub.chain)
        parent_paths.append(parent)
    own = _own_tree(path, doc.data, doc.lines)
    tree = merge(parents, own)
    out = Composed(path=path, tree=tree, parents=parents, own=own, chain=chain + [path], parent_paths=parent_paths)
    cache[path] = out
    return out
