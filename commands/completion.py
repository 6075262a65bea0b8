"""`gymv completion`: print, write or check the bash/zsh/fish completion scripts."""

from __future__ import annotations

from enum import Enum
from pathlib import Path

import typer

from gymv_cli.output import console, err_console


class Shell(str, Enum):
    bash = "bash"
    zsh = "zsh"
    fish = "fish"


def completion(
    ctx: typer.Context,
    shell: Shell = typer.Argument(None, help="The shell whose script to print."),
    write: Path = typer.Option(None, "--write", metavar="DIR", file_okay=False, help="Write gymv.bash, _gymv and gymv.fish for the built-in commands into DIR."),
    check: Path = typer.Option(None, "--check", metavar="DIR", file_okay=False, help="Exit 1 when the scripts in DIR differ from freshly generated ones."),
) -> None:
    """Print, write or check static shell completion scripts generated from the command tree.

    Printing a script covers every command mounted now, installed plugins included; --write and --check cover the built-in commands, which is what the repository commits under completions/.

    Example: gymv completion bash > ~/.local/share/bash-completion/completions/gymv
    """
    from gymv.errors import GymvError
    from gymv_cli import completions as comp

    if (shell is None) == (write is None and check is None):
        raise GymvError("pass exactly one of: a shell name, --write DIR, --check DIR",
                        fix="e.g. gymv completion bash, or gymv completion --write completions")
    if shell is not None:
        tree = comp.command_tree(ctx.find_root().command)
        typer.echo(comp.render(shell.value, tree), nl=False)
        return
    tree, missing = comp.live_root(ctx.find_root().command, builtin_only=True)
    for name in missing:
        err_console.print(f"warning: built-in command {name!r} failed to load, so it is not in the scripts", markup=False, soft_wrap=True)
    if write is not None:
        for path in comp.write_scripts(write, tree):
            console.print(f"wrote {path}", markup=False, highlight=False)
        return
    stale = comp.stale_scripts(check, tree)
    if stale:
        names = ", ".join(str(p) for p in stale)
        typer.echo(f"stale completion scripts: {names}; refresh them with: gymv completion --write {check}", err=True)
        raise typer.Exit(1)
    console.print(f"completion scripts in {check} are fresh", markup=False, highlight=False)
