"""Command-line overrides, applied to the merged tree before interpolation.

`a.b=v` changes an existing key, `+a.b=v` adds a new one, `++a.b=v` sets it either way, `~a.b` deletes it.
Values are read as YAML (`8`, `1e-5`, `null`, `true`, `[1,2]`, `{k: v}`); an empty value is an empty string.
"""

from __future__ import annotations

import copy
import re
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any, Literal

from gymv.config.nemo_rl import override_hint
from gymv.config.tree import OVERRIDE_MARKER, ConfigTree, dotted, get_path, iter_keys, split_key, suggest
from gymv.errors import GymvError
from gymv.yamlfile import KeyPath, Origin, parse_scalar

Op = Literal["set", "add", "upsert", "delete"]
_KEY = re.compile(r"^[\w-]+(?:\.[\w-]+)*$")
COMMAND_LINE = "<command line>"


def _from_cli(origin: Origin) -> bool:
    return origin.file.startswith("<command line")


@dataclass(frozen=True)
class Override:
    op: Op
    key: str
    value: Any = None
    text: str = ""
    origin: Origin = Origin(COMMAND_LINE, None)

    @property
    def where(self) -> str:
        return f"override {self.text!r}" if _from_cli(self.origin) else str(self.origin)


def looks_like_override(text: str) -> bool:
    """Whether a command-line word is an override (`a.b=v`, `+a.b=v`, `++a.b=v`, `~a.b`) rather than a path:
    `gymv train --resume DIR ~grpo` has no recipe, only overrides."""
    if text.startswith("~"):
        return bool(_KEY.match(text[1:].strip()))
    key, eq, _ = text.lstrip("+").partition("=")
    return bool(eq) and bool(_KEY.match(key.strip()))


def parse_override(text: str, origin: Origin = Origin(COMMAND_LINE, None)) -> Override:
    """Parse `a.b=v`, `+a.b=v`, `++a.b=v` or `~a.b`."""
    where = f"override {text!r}" if _from_cli(origin) else str(origin)
    fix = "write key=value, +new.key=value, ++key=value or ~key"
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:  # bytes the terminal's locale could not decode arrive as lone surrogates
        raise GymvError("override is not UTF-8 text", where=where.encode("utf-8", "backslashreplace").decode(),
                        fix="write the override in UTF-8 (check the terminal's locale, e.g. LANG=C.UTF-8)") from None
    op: Op
    if text.startswith("~"):
        op, body = "delete", text[1:]
        if "=" in body:
            raise GymvError("a delete override takes no value", where=where, fix=f"write ~{body.split('=', 1)[0]}")
        key, value = body, None
    else:
        if text.startswith("++"):
            op, body = "upsert", text[2:]
        elif text.startswith("+"):
            op, body = "add", text[1:]
        else:
            op, body = "set", text
        if "=" not in body:
            raise GymvError("override has no '='", where=where, fix=fix)
        key, raw = body.split("=", 1)
        value = parse_scalar(raw)
    key = key.strip()
    if not _KEY.match(key):
        raise GymvError(f"override key {key!r} is not a dotted key", where=where, fix=fix)
    return Override(op, key, value, text, origin)


def as_overrides(items: Iterable[str | Override]) -> list[Override]:
    """Parse command-line strings; each keeps its text as its origin (`<command line: a.b=1>`)."""
    return [o if isinstance(o, Override) else parse_override(o, Origin(f"<command line: {o}>", None)) for o in items]


def smoke_overrides(tree: ConfigTree) -> list[Override]:
    """The `smoke:` section (dotted key -> value, `+key`/`~key` allowed) as overrides placed at its lines."""
    section = tree.data.get("smoke") or {}
    if not isinstance(section, Mapping):
        return []
    out = []
    for key, value in section.items():
        origin = tree.origins.get(("smoke", key), Origin("smoke", None))
        op: Op = "set"
        if key.startswith("~"):
            op, key = "delete", key[1:]
        elif key.startswith("++"):
            op, key = "upsert", key[2:]
        elif key.startswith("+"):
            op, key = "add", key[1:]
        out.append(Override(op, key, copy.deepcopy(value), f"smoke.{key}", origin))
    return out


def _fail_missing(tree: ConfigTree, o: Override) -> GymvError:
    nemo = override_hint(o.key, tree.get("algorithm"))
    if nemo:
        return GymvError(f"unknown key {o.key!r}", where=o.where, fix=nemo)
    near = suggest(o.key, tree.keys())
    hint = f"did you mean {near}?" if near else "check the key against the recipe"
    if o.op == "set":
        hint += f" To add a new key write +{o.text}"
    return GymvError(f"unknown key {o.key!r}", where=o.where, fix=hint)


def apply_overrides(tree: ConfigTree, overrides: Iterable[str | Override],
                    known: Callable[[str], bool] | None = None) -> ConfigTree:
    """A new tree with the overrides applied in order; origins of changed keys point at the override.

    `known(key)` says whether the schema has a key the tree lacks, so `a.b=v` may set a key that the
    recipe leaves at its schema default.
    """
    out = tree.copy()
    for o in as_overrides(overrides):
        path = split_key(out.data, o.key)
        if o.op == "set" and path is None and known is not None and known(o.key):
            o = Override("upsert", o.key, o.value, o.text, o.origin)
        if o.op in ("set", "delete"):
            if path is None:
                raise _fail_missing(out, o)
            parent = get_path(out.data, path[:-1])
            out.drop_origins_under(path)
            if o.op == "delete":
                del parent[path[-1]]
            else:
                parent[path[-1]] = copy.deepcopy(o.value)
                _record(out, path, o)
            continue
        if path is not None and o.op == "add":
            raise GymvError(f"key {o.key!r} already exists", where=o.where,
                            fix=f"drop the '+' to change it: {o.text.lstrip('+')}")
        if path is None:
            path = _create_path(out, o)
        parent = get_path(out.data, path[:-1])
        out.drop_origins_under(path)
        parent[path[-1]] = copy.deepcopy(o.value)
        _record(out, path, o)
    return out


def _create_path(tree: ConfigTree, o: Override) -> KeyPath:
    """Make the sections a new key needs, reusing the longest existing prefix."""
    parts = o.key.split(".")
    for n in range(len(parts) - 1, -1, -1):
        prefix = split_key(tree.data, ".".join(parts[:n])) if n else ()
        if prefix is None:
            continue
        node = get_path(tree.data, prefix)
        if not isinstance(node, dict):
            raise GymvError(f"cannot add {o.key!r}: {dotted(prefix)!r} is not a mapping", where=o.where,
                            fix=f"replace it whole: {dotted(prefix)}={{...}}")
        path = prefix
        for p in parts[n:-1]:
            node = node.setdefault(p, {})
            path = path + (p,)
            tree.origins[path] = o.origin
        return path + (parts[-1],)
    raise AssertionError("unreachable: the empty prefix always exists")


def _record(tree: ConfigTree, path: KeyPath, o: Override) -> None:
    tree.origins[path] = o.origin
    value = get_path(tree.data, path)
    if isinstance(value, dict | list):
        for sub in iter_keys(value, path):
            tree.origins[sub] = o.origin
        if isinstance(value, list):
            for i in range(len(value)):
                tree.origins[path + (i,)] = o.origin
    if isinstance(value, dict) and OVERRIDE_MARKER in value:
        del value[OVERRIDE_MARKER]
