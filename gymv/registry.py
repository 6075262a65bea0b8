"""Named extension points: a name maps to a class (or factory), found among the built-ins, the in-process
registrations and one entry-point group, in that order; a built-in name cannot be taken over.

Ray workers run in other processes, where an in-process registration does not exist: `locate` turns a
name into an importable "module:attribute" path that a worker resolves on its own side (`load` accepts
such a path in place of a name).

A registry may fold names its own way (environments treat `_` and `-` alike, in any case) and give built-ins
other names (aliases); both apply to every lookup, registration and entry point.

An entry may declare what it can do (its `capabilities`: a frozen dataclass of the registry's own kind), which
the checks that run before anything starts read instead of naming entries. A built-in declares them beside
its import path, so reading them imports nothing; a registered class or an entry point's class declares them
as its `capabilities` attribute; an entry that declares none gets the registry's `default`.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping
from importlib.metadata import entry_points
from typing import Any

from gymv.errors import GymvError


def normalize(name: str) -> str:
    return name.strip()


def import_path(obj: Any) -> str:
    """"module:qualname" of a class or function defined at module level."""
    return f"{obj.__module__}:{obj.__qualname__}"


def import_object(path: str) -> Any:
    module, _, attr = path.partition(":")
    target: Any = importlib.import_module(module)
    for part in attr.split("."):
        target = getattr(target, part)
    return target


class Registry:
    """One kind of extension (`what`, for messages), its config key (`where`; None where the name comes from
    several places) and its entry-point group.

    `builtins` maps a name to its import path, or to (import path, capabilities).
    `normalize` folds a name before any lookup; `aliases` maps other names to built-in ones."""

    def __init__(self, what: str, group: str, builtins: Mapping[str, str | tuple[str, Any]], *, where: str | None,
                 default: Any = None, normalize: Callable[[str], str] = normalize,
                 aliases: Mapping[str, str] | None = None):
        self.what, self.group, self.where, self.default = what, group, where, default
        self._normalize = normalize
        self.builtins: dict[str, str] = {}
        self._declared: dict[str, Any] = {}
        for name, entry in builtins.items():
            path, caps = entry if isinstance(entry, tuple) else (entry, default)
            self.builtins[normalize(name)], self._declared[normalize(name)] = path, caps
        self.aliases = {normalize(alias): normalize(name) for alias, name in (aliases or {}).items()}
        if not set(self.aliases.values()) <= set(self.builtins):
            raise ValueError(f"{what} aliases must name built-ins: {sorted(set(self.aliases.values()) - set(self.builtins))}")
        self._registered: dict[str, Any] = {}

    def key(self, name: str) -> str:
        """The name as this registry files it: folded, an alias resolved; a "module:attribute" path unchanged."""
        if ":" in name:
            return name.strip()
        key = self._normalize(name)
        return self.aliases.get(key, key)

    def register(self, name: str, obj: Any, *, capabilities: Any = None) -> None:
        """Add a class in this process (tests, notebooks, embedding); a built-in name stays the built-in.
        `capabilities` (else the class's own `capabilities` attribute) says what it can do."""
        key = self.key(name)
        if key in self.builtins:
            raise GymvError(f"{self.what} {name!r} is built in and cannot be replaced", where=self.where,
                            fix="register it under another name")
        self._registered[key] = obj
        self._declared[key] = capabilities if capabilities is not None else getattr(obj, "capabilities", self.default)

    def unregister(self, name: str) -> None:
        key = self.key(name)
        if key not in self.builtins:
            self._registered.pop(key, None)
            self._declared.pop(key, None)

    def capabilities(self, name: str) -> Any:
        """What the entry `name` (or its located path) declares it can do; an entry point's class is imported
        to read them. A name nothing registers declares the defaults (its own check says it is unknown)."""
        key = self.key(name)
        if ":" in key:  # located (a worker's spec): the entry whose path it is
            key = next((n for n, path in self.builtins.items() if path == key), None) or next(
                (n for n, obj in self._registered.items() if import_path(obj) == key), key)
        if key in self._declared:
            return self._declared[key]
        if ":" not in key and key not in self._plugins():
            return self.default
        return getattr(self.load(key), "capabilities", self.default)

    def declared(self) -> dict[str, Any]:
        """Every available name and its capabilities."""
        return {name: self.capabilities(name) for name in self.available()}

    def having(self, declares: Callable[[Any], bool]) -> list[str]:
        """The names whose capabilities satisfy `declares` (for a fix: "use one of them")."""
        return [name for name, caps in self.declared().items() if declares(caps)]

    def _plugins(self) -> dict[str, Any]:
        found: dict[str, Any] = {}
        for ep in sorted(entry_points(group=self.group), key=lambda e: e.name):
            found.setdefault(self._normalize(ep.name), ep)
        return found

    def available(self) -> dict[str, str]:
        """Every name and where it comes from: 'builtin', 'registered' or the entry point's value."""
        out = {name: "builtin" for name in self.builtins}
        for name in self._registered:
            out.setdefault(name, "registered")
        for name, ep in self._plugins().items():
            out.setdefault(name, ep.value)
        return dict(sorted(out.items()))

    def __contains__(self, name: str) -> bool:
        key = self.key(name)  # built-ins first: the schema asks this of every recipe, entry points cost a scan
        return key in self.builtins or key in self._registered or key in self._plugins()

    def portable(self, name: str) -> str:
        """`name` where every process knows it (a built-in, an entry point), else its import path."""
        key = self.key(name)
        return self.locate(key) if key in self._registered and key not in self.builtins else name

    def locate(self, name: str) -> str:
        """An import path for `name` that resolves in any process of the run."""
        if ":" in name:
            return name
        key = self.key(name)
        if key in self.builtins:
            return self.builtins[key]
        if key in self._registered:
            return import_path(self._registered[key])
        ep = self._plugins().get(key)
        if ep is None:
            raise self._unknown(name)
        return ep.value

    def load(self, name: str) -> Any:
        """The class (or factory) registered under `name` (or at the "module:attribute" path `name`)."""
        key = self.key(name)
        if ":" not in name and key in self._registered and key not in self.builtins:
            return self._registered[key]
        path = self.locate(name)
        try:
            return import_object(path)
        except Exception as e:  # a broken plugin is reported, never a traceback
            raise GymvError(f"{self.what} {name!r} ({path}) failed to load: {type(e).__name__}: {e}",
                            where=self.where, fix="reinstall or fix the distribution that provides it") from None

    def _unknown(self, name: str) -> GymvError:
        return GymvError(f"unknown {self.what} {name!r}", where=self.where,
                         fix=f"use one of: {', '.join(self.available())}")
