"""Discover subcommands from the `gymv.commands` entry-point group.

An entry point's name is the command name; its object is either a `typer.Typer` (mounted as a command
group, e.g. `gymv env serve`) or a function (mounted as a single command). Built-in commands use this same
group, so a third-party distribution that declares one appears in `gymv --help` like any other.
"""

from __future__ import annotations

import sys
from importlib.metadata import EntryPoint, entry_points

import typer

GROUP = "gymv.commands"


def _ordered(eps: list[EntryPoint]) -> list[EntryPoint]:
    """Built-ins first in their declared order, then plugins by name; a duplicate name keeps the first."""
    seen: set[str] = set()
    builtins = [ep for ep in eps if ep.value.startswith("gymv_cli.")]
    others = sorted((ep for ep in eps if not ep.value.startswith("gymv_cli.")), key=lambda e: e.name)
    out = []
    for ep in builtins + others:
        if ep.name not in seen:
            seen.add(ep.name)
            out.append(ep)
    return out


def mount_plugins(app: typer.Typer, warn=None) -> list[str]:
    """Mount every command plugin on `app`; a plugin that fails to load warns once and is skipped."""
    warn = warn or (lambda msg: print(msg, file=sys.stderr))
    mounted = []
    for ep in _ordered(list(entry_points(group=GROUP))):
        try:
            obj = ep.load()
        except Exception as e:  # a broken plugin must not take the CLI down
            warn(f"warning: command plugin {ep.name!r} ({ep.value}) failed to load: {type(e).__name__}: {e}")
            continue
        if isinstance(obj, typer.Typer):
            app.add_typer(obj, name=ep.name)
        elif callable(obj):
            app.command(name=ep.name)(obj)
        else:
            warn(f"warning: command plugin {ep.name!r} ({ep.value}) is neither a typer.Typer nor a function")
            continue
        mounted.append(ep.name)
    return mounted
