"""Named extension points: a name maps to a class (or factory), found among the built-ins, the in-process
registrations and one entry-point group, in that order; a built-in name cannot be taken over.

Ray workers run in other processes, where an in-process registration does not exist: `locate` turns a
name into an importable "module:attribute" path that a worker resolves on its own side (`load` accepts
such a path in place of a name).

An entry may declare what it can do (its `capabilities`: a frozen dataclass of the registry's own kind), which
the checks that run before anything starts read instead of naming entries. A built-in declares them beside
its import path, so reading them imports nothing; a registered class or an entry point's class declares them
as its `capabilities` attribute; an entry that declares none gets the registry's `default`.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
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
    """One kind of extension (`what`, for messages), its config key (`where`) and its entry-point group.

    `builtins` maps a name to its import path, or to (import path, capabilities)."""

    def __init__(self, what: str, group: str, builtins: dict[str, str | tuple[str, Any]], *, where: str,
                 default: Any = None):
        self.what, self.group, self.where, self.default = what, group, where, default
        self.builtins: dict[str, str] = {}
        self._declared: dict[str, Any] = {}
        for name, entry in builtins.items():
            path, caps = entry if isinstance(entry, tuple) else (entry, default)
            self.builtins[normalize(name)], self._declared[normalize(name)] = path, caps
        self._registered: dict[str, Any] = {}

    def register(self, name: str, obj: Any, *, capabilities: Any = None) -> None:
        """Add a class in this process (tests, notebooks, embedding); a built-in name stays the built-in.
        `capabilities` (else the class's own `capabilities` attribute) says what it can do."""
        key = normalize(name)
        if key in self.builtins:
            raise GymvError(f"{self.what} {name!r} is built in and cannot be replaced", where=self.where,
                            fix="register it under another name")
        self._registered[key] = obj
        self._declared[key] = capabilities if capabilities is not None else getattr(obj, "capabilities", self.default)

    def unregister(self, name: str) -> None:
        key = normalize(name)
        if key not in self.builtins:
            self._registered.pop(key, None)
            self._declared.pop(key, None)

    def capabilities(self, name: str) -> Any:
        """What the entry `name` (or its located path) declares it can do; an entry point's class is imported
        to read them. A name nothing registers declares the defaults (its own check says it is unknown)."""
        key = normalize(name)
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
            found.setdefault(normalize(ep.name), ep)
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
        key = normalize(name)  # built-ins first: the schema asks this of every recipe, entry points cost a scan
        return key in self.builtins or key in self._registered or key in self._plugins()

    def portable(self, name: str) -> str:
        """`name` where every process knows it (a built-in, an entry point), else its import path."""
        key = normalize(name)
        return self.locate(key) if key in self._registered and key not in self.builtins else name

    def locate(self, name: str) -> str:
        """An import path for `name` that resolves in any process of the run."""
        if ":" in name:
            return name
        key = normalize(name)
        if key in self.builtins:
            return self.builtins[key]
        if key in self._registered:
            return import_path(self._registered[key])
        ep = self._plugins().get(key)
        if ep is None:
            raise self._unknown(name)
        return ep.value

    def load(self, name: str) -> Any:
        """The class registered under `name` (or at the "module:attribute" path `name`)."""
        key = normalize(name)
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
