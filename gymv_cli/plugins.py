"""Subcommands: the built-ins below and the `gymv.commands` entry-point group, through the shared
`gymv.registry.Registry` (`COMMANDS`).

An entry point's name is the command name; its object is either a `typer.Typer` (mounted as a command
group, e.g. `gymv env serve`) or a function (mounted as a single command). A third-party distribution that
declares one appears in `gymv --help` like a built-in; a built-in name cannot be taken over.
"""

from __future__ import annotations

import sys

import typer

from gymv.errors import GymvError
from gymv.registry import Registry

GROUP = "gymv.commands"

# by name, the order `gymv --help` lists them in (typer puts single commands before command groups)
BUILTINS: dict[str, str] = {
    "cluster": "gymv_cli.commands.cluster:app",
    "completion": "gymv_cli.commands.completion:completion",
    "dry-run": "gymv_cli.commands.dry_run:dry_run",
    "env": "gymv_cli.commands.env:app",
    "lint": "gymv_cli.commands.lint:lint",
    "model": "gymv_cli.commands.model:app",
    "prepare": "gymv_cli.commands.prepare:prepare",
    "report": "gymv_cli.commands.report:report",
    "smoke": "gymv_cli.commands.smoke:smoke",
    "train": "gymv_cli.commands.train:train",
}
COMMANDS = Registry("command plugin", GROUP, BUILTINS, where=None)


def command_names() -> list[str]:
    """Built-ins first, then the others by name (a plugin's command is listed after gymv's own)."""
    return [*COMMANDS.builtins, *(n for n in COMMANDS.available() if n not in COMMANDS.builtins)]


def mount_plugins(app: typer.Typer, warn=None) -> list[str]:
    """Mount every command on `app`; one that fails to load warns once and is skipped."""
    warn = warn or (lambda msg: print(msg, file=sys.stderr))
    mounted = []
    for name in command_names():
        try:
            obj = COMMANDS.load(name)
        except GymvError as e:  # a broken plugin must not take the CLI down
            warn(f"warning: {e.message}")
            continue
        if isinstance(obj, typer.Typer):
            app.add_typer(obj, name=name)
        elif callable(obj):
            app.command(name=name)(obj)
        else:
            warn(f"warning: command plugin {name!r} ({COMMANDS.locate(name)}) is neither a typer.Typer nor a function")
            continue
        mounted.append(name)
    return mounted
