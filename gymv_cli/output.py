"""Shared rendering: one rich console, JSON output for scripts, tables and progress bars."""

from __future__ import annotations

import json
import sys
from collections.abc import Iterable, Sequence
from typing import Any

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn
from rich.table import Table

console = Console()
err_console = Console(stderr=True)


def print_json(obj: Any) -> None:
    """Machine-readable output goes to stdout alone, so `--json | jq` always works."""
    sys.stdout.write(json.dumps(obj, indent=2, default=str) + "\n")
    sys.stdout.flush()


def table(title: str | None, columns: Sequence[str], rows: Iterable[Sequence[Any]], *, justify_numbers: bool = True) -> Table:
    t = Table(title=title, title_justify="left")
    rows = [list(r) for r in rows]
    for i, col in enumerate(columns):
        numeric = justify_numbers and rows and all(isinstance(r[i], (int, float)) for r in rows if r[i] is not None)
        t.add_column(col, justify="right" if numeric else "left")
    for r in rows:
        t.add_row(*("" if v is None else f"{v:.4g}" if isinstance(v, float) else str(v) for v in r))
    return t


def progress(transient: bool = False) -> Progress:
    """A progress bar on stderr so that stdout stays clean for --json."""
    return Progress(
        TextColumn("[bold]{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        TimeRemainingColumn(),
        console=err_console,
        transient=transient,
    )
